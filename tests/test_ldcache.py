"""sandbox.images.ldcache against glibc's own tools: `ldconfig -C` writes the caches, `ldconfig -p` reads them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from sandbox.images.ldcache import CacheFormatError, entries, read_cache, repointed

LDCONFIG = shutil.which("ldconfig") or ("/sbin/ldconfig" if Path("/sbin/ldconfig").exists() else None)
LIBZ = Path("/lib/x86_64-linux-gnu/libz.so.1")
pytestmark = pytest.mark.skipif(LDCONFIG is None or not LIBZ.exists(), reason="needs glibc's ldconfig and libz")


def _cache(tmp: Path, name: str, *dirs: Path) -> bytes:
    """A cache of the trusted directories plus `dirs`, written by ldconfig itself (no links touched)."""
    conf = tmp / f"{name}.conf"
    conf.write_text("".join(f"{d}\n" for d in dirs))
    subprocess.run([LDCONFIG, "-X", "-C", str(tmp / name), "-f", str(conf)], check=True, capture_output=True)
    return (tmp / name).read_bytes()


def test_entries_are_what_ldconfig_lists(tmp_path: Path) -> None:
    data = _cache(tmp_path, "cache", tmp_path)
    listed = subprocess.run([LDCONFIG, "-p", "-C", str(tmp_path / "cache")], check=True, capture_output=True,
                            text=True).stdout.splitlines()
    pairs = [(ln.split(" (", 1)[0].strip(), ln.rsplit("=> ", 1)[1]) for ln in listed if "=>" in ln]
    assert pairs and [(name, path) for name, _, _, path in entries(data)] == pairs


def test_a_shadowing_library_repoints_its_name_and_new_ones_repoint_nothing(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "shadow").mkdir()
    shutil.copy(LIBZ, tmp_path / "shadow" / "libz.so.1")
    base = _cache(tmp_path, "base")
    assert repointed(base, _cache(tmp_path, "same", tmp_path / "empty")) == []
    moved = repointed(base, _cache(tmp_path, "moved", tmp_path / "shadow"))  # listed first: the loader's pick
    old = next(path for (name, _, _), path in read_cache(base).items() if name == "libz.so.1")
    assert moved == [f"libz.so.1: {old} -> {tmp_path}/shadow/libz.so.1"]
    assert repointed(_cache(tmp_path, "moved2", tmp_path / "shadow"), base)  # and back is a change too


def test_other_bytes_are_refused() -> None:
    for bad in (b"", b"ld.so-1.7.0" + bytes(40), b"glibc-ld.so.cache1.1" + b"\xff\xff\x00\x00" + bytes(24)):
        with pytest.raises(CacheFormatError):
            read_cache(bad)
