"""Read glibc's /etc/ld.so.cache: which file the dynamic loader opens for each library name.

Why the verifier needs it: installing packages in a sandbox (`apt-get install`, which runs ldconfig) rewrites the
cache. That is harmless while every library the image already had still resolves to the same file; it is tampering
when a name the verifier's interpreter loads (libc.so.6, libpython3.11.so.1.0, ...) now points somewhere else.
`repointed(old, new)` says which names changed. Only the format glibc >= 2.32 writes by default
("glibc-ld.so.cache1.1", alone) is read; anything else is refused (the caller then counts the change as tampering).

Layout (glibc elf/cache.c, `struct cache_file_new` and `struct file_entry_new`): a 48-byte header (magic and
version, number of entries, string table size, flags, extension offset, 3 unused words), then 24-byte entries
(flags i32, key and value offsets u32, osversion u32, hwcap u64); offsets count from the file's first byte.
"""

from __future__ import annotations

import struct

MAGIC = b"glibc-ld.so.cache1.1"
_HEADER = struct.Struct("<20sII4xI12x")  # magic+version, nlibs, len_strings, flags (+3 pad), extension_offset
_ENTRY = struct.Struct("<iIIIQ")  # flags, key, value, osversion, hwcap


class CacheFormatError(ValueError):
    """The bytes are not an ld.so.cache this module reads."""


Entry = tuple[str, int, int]
"""(library name, flags: ABI and word size, hwcap) -- what a lookup matches on."""


def entries(data: bytes) -> list[tuple[str, int, int, str]]:
    """Every entry in cache order: (library name, flags, hwcap, path). Raises CacheFormatError."""
    if len(data) < _HEADER.size or not data.startswith(MAGIC):
        raise CacheFormatError(f"not a {MAGIC.decode()} cache (starts with {data[:20]!r})")
    _, nlibs, _len_strings, _ext = _HEADER.unpack_from(data)
    if _HEADER.size + nlibs * _ENTRY.size > len(data):
        raise CacheFormatError(f"{nlibs} entries do not fit in {len(data)} bytes")
    out = []
    for i in range(nlibs):
        flags, key, value, _osv, hwcap = _ENTRY.unpack_from(data, _HEADER.size + i * _ENTRY.size)
        out.append((_string(data, key), flags, hwcap, _string(data, value)))
    return out


def read_cache(data: bytes) -> dict[Entry, str]:
    """(name, flags, hwcap) -> the path the loader opens for it. A name may be listed more than once (one soname
    in several directories); the loader's lookup (glibc elf/dl-cache.c) takes the first matching entry, so that
    one is the name's. Raises CacheFormatError."""
    out: dict[Entry, str] = {}
    for name, flags, hwcap, path in entries(data):
        out.setdefault((name, flags, hwcap), path)
    return out


def _string(data: bytes, offset: int) -> str:
    end = data.find(b"\0", offset)
    if offset >= len(data) or end < 0:
        raise CacheFormatError(f"string offset {offset} outside the cache")
    return data[offset:end].decode("utf-8", errors="surrogateescape")


def repointed(old: bytes, new: bytes) -> list[str]:
    """Names the old cache resolved that the new one resolves differently or not at all ('name: old -> new').
    Entries only the new cache has (newly installed libraries) are not listed. Raises CacheFormatError."""
    before, after = read_cache(old), read_cache(new)
    return [f"{k[0]}: {path} -> {after.get(k, 'missing')}" for k, path in sorted(before.items())
            if after.get(k) != path]
