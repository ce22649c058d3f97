"""The shared libraries the verifier's own processes load, read from an image's layers on this host.

The verifier runs the image's Python (`python3 -I`, the standard library, pytest) and a few shell tools (bash, env,
timeout, tail, ...). A library file the agent changes can only reach that machinery if one of those programs, or a
library they need, names it: their DT_NEEDED entries (sandbox.images.elf), transitively, resolved in the library
directories the loader searches. Those names stay protected; another library of the image (say, libapt-private when
a solution reinstalls apt) is as much the agent's as any package it installs. glibc's own libraries are always
protected: libc loads libnss_* and libgcc_s by name at run time, which no DT_NEEDED entry shows.
"""

from __future__ import annotations

import functools
import glob
import os
from collections.abc import Callable, Iterable

from sandbox.images.elf import ElfFormatError, needed_libraries

# What the verifier executes, besides the tools sandbox.runtime.verify protects by path.
ROOT_PATTERNS = ("/usr/bin/python3*", "/usr/local/bin/python3*", "/usr/lib/python3*/lib-dynload/*.so",
                 "/usr/local/lib/python3*/lib-dynload/*.so")
# glibc's libraries and the loader, by name prefix (loaded by name at run time: NSS modules, libgcc_s for unwinding).
GLIBC_PREFIXES = ("ld-linux", "ld64.so", "libc.so", "libc_malloc", "libnss_", "libgcc_s", "libpthread", "libdl.",
                  "libdl-", "libm.so", "libm-", "libmvec", "librt", "libresolv", "libutil", "libanl", "libthread_db",
                  "libBrokenLocale", "libnsl", "libcrypt", "libmemusage", "libpcprofile", "libSegFault")
_MAX_LINKS = 40


def verifier_library_names(lowers: tuple[str, ...], lib_dirs: Iterable[str], tools: Iterable[str]) -> frozenset[str]:
    """File names (a soname, each link on its way, the file it ends at) of every library the verifier's programs
    load, in the image whose overlay2 lower directories are `lowers` (the top layer first). `tools`: absolute paths
    of the other programs it runs."""
    lib_dirs = tuple(lib_dirs)
    entry = functools.partial(layer_entry, lowers)
    names: set[str] = set()
    roots = {path for pattern in ROOT_PATTERNS for path in _glob_image(lowers, pattern)} | set(tools)
    todo = [host for path in sorted(roots) if (host := _resolve(path, entry, names=None)) is not None]
    seen_files: set[str] = set()
    while todo:
        host = todo.pop()
        if host in seen_files:
            continue
        seen_files.add(host)
        for soname in _needed(host):
            for d in lib_dirs:
                found = _resolve(f"{d}/{soname}", entry, names=names)
                if found is not None:
                    names.add(soname)
                    todo.append(found)
                    break
    return frozenset(names)


def layer_entry(lowers: tuple[str, ...], path: str) -> str | None:
    """Where the image's `path` lies on this host (the top layer first, as LowerDir lists them), None if absent."""
    return next((full for d in lowers if os.path.lexists(full := os.path.join(d, path.lstrip("/")))), None)


def is_glibc(name: str) -> bool:
    return name.startswith(GLIBC_PREFIXES)


def _glob_image(lowers: tuple[str, ...], pattern: str) -> set[str]:
    out = set()
    for lower in lowers:
        for full in glob.glob(os.path.join(lower, pattern.lstrip("/"))):
            out.add("/" + os.path.relpath(full, lower))
    return out


def _resolve(path: str, entry: Callable[[str], str | None], *, names: set[str] | None) -> str | None:
    """The host path of the regular file the image's `path` ends at after its symbolic links (their names and the
    file's added to `names`), or None when it is absent, a loop, or not a regular file."""
    for _ in range(_MAX_LINKS):
        host = entry(path)
        if host is None:
            return None
        if names is not None:
            names.add(os.path.basename(path))
        if not os.path.islink(host):
            return host if os.path.isfile(host) else None
        target = os.readlink(host)
        path = target if target.startswith("/") else os.path.normpath(os.path.join(os.path.dirname(path), target))
    return None


def _needed(host: str) -> list[str]:
    try:
        with open(host, "rb") as f:
            data = f.read()
        return needed_libraries(data) or []
    except (OSError, ElfFormatError):
        return []
