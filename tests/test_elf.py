"""sandbox.images.elf reads DT_NEEDED as binutils' readelf does, and sandbox.images.verifier_libs finds every library
the dynamic loader (ldd) loads for the verifier's programs, on this host's own files."""

from __future__ import annotations

import glob
import os
import re
import shutil
import struct
import subprocess
import sys

import pytest

from sandbox.images.elf import ElfFormatError, needed_libraries
from sandbox.images.verifier_libs import ROOT_PATTERNS, _glob_image, verifier_library_names
from sandbox.images.protected import PROTECTED_FILES
from sandbox.runtime.verify import _LIB_DIRS

_HOST_FILES = sorted({os.path.realpath(p) for p in [sys.executable, "/bin/bash", "/usr/bin/timeout",
                                                      *glob.glob("/usr/lib/python3*/lib-dynload/*.so"),
                                                      *glob.glob("/usr/lib/x86_64-linux-gnu/lib*.so.*")[:80]]
                      if os.path.isfile(p)})


@pytest.mark.skipif(shutil.which("readelf") is None, reason="binutils' readelf is not installed")
def test_needed_libraries_match_readelf() -> None:
    assert len(_HOST_FILES) > 20
    for path in _HOST_FILES:
        out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
        with open(path, "rb") as f:
            assert (needed_libraries(f.read()) or []) == re.findall(r"\(NEEDED\)\s+Shared library: \[(.*?)\]", out), path


def test_not_elf_and_truncated_files() -> None:
    assert needed_libraries(b"#!/bin/sh\necho hi\n" * 4) is None
    assert needed_libraries(b"/* GNU ld script */ GROUP ( /lib/libc.so.6 )" * 2) is None
    with open(os.path.realpath(sys.executable), "rb") as f:
        head = f.read(64)
    phoff = struct.unpack_from("<Q", head, 0x20)[0]
    with pytest.raises(ElfFormatError, match="past the end"):
        needed_libraries(head + b"\0" * (phoff - len(head) + 8))  # program headers cut short


def test_verifier_libraries_cover_what_ldd_loads() -> None:
    """The closure over this host's Python, its extension modules and the verifier's tools holds every library
    the loader maps for them (ldd, an independent reading)."""
    names = verifier_library_names(("/",), _LIB_DIRS, PROTECTED_FILES)
    roots = sorted({p for pattern in ROOT_PATTERNS for p in _glob_image(("/",), pattern)}
                   | {t for t in PROTECTED_FILES if os.path.exists(t)})
    loaded = set()
    for root in roots:
        out = subprocess.run(["ldd", root], capture_output=True, text=True).stdout
        loaded |= {m.group(1) for m in re.finditer(r"^\s*(\S+) => /", out, re.M)}
    assert len(loaded) > 10 and loaded <= names, sorted(loaded - names)
    assert not any(name.startswith("libapt") for name in names)  # present here, loaded by none of them
