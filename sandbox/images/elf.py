"""The shared libraries an ELF file names (its DT_NEEDED entries), read from the file's bytes.

The tamper check (sandbox.runtime.verify) protects the libraries the verifier's own processes load: the interpreter, the
standard library's extension modules, the shells and tools it runs, and what those need, transitively. It reads
them from the image's layers on the host, so nothing inside the container is asked (no ldd there to trust).

Only what the dynamic loader reads is parsed: the ELF header, the program headers, the PT_DYNAMIC segment, and the
string table its DT_STRTAB points to (a virtual address, turned into a file offset through the PT_LOAD segment
that maps it). 32- and 64-bit, either byte order.
"""

from __future__ import annotations

import struct

_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_NEEDED, _DT_STRTAB = 0, 1, 5


class ElfFormatError(ValueError):
    """An ELF file whose headers point outside it."""


def needed_libraries(data: bytes) -> list[str] | None:
    """The DT_NEEDED names of the ELF file `data`, in order; None when `data` is not an ELF file (a script, a
    linker script such as libc.so); [] for a static executable."""
    if len(data) < 52 or data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
        return None
    wide, order = data[4] == 2, "<" if data[5] == 1 else ">"
    try:
        if wide:
            phoff, = struct.unpack_from(order + "Q", data, 0x20)
            phentsize, phnum = struct.unpack_from(order + "HH", data, 0x36)
        else:
            phoff, = struct.unpack_from(order + "I", data, 0x1C)
            phentsize, phnum = struct.unpack_from(order + "HH", data, 0x2A)
        loads, dynamic = [], None
        for i in range(phnum):
            at = phoff + i * phentsize
            if wide:  # p_type p_flags p_offset p_vaddr p_paddr p_filesz
                p_type, _, offset, vaddr, _, filesz = struct.unpack_from(order + "IIQQQQ", data, at)
            else:  # p_type p_offset p_vaddr p_paddr p_filesz
                p_type, offset, vaddr, _, filesz = struct.unpack_from(order + "IIIII", data, at)
            if p_type == _PT_LOAD:
                loads.append((vaddr, offset, filesz))
            elif p_type == _PT_DYNAMIC:
                dynamic = (offset, filesz)
        if dynamic is None:
            return []
        entry = struct.Struct(order + ("qQ" if wide else "iI"))
        needed, strtab = [], None
        for at in range(dynamic[0], dynamic[0] + dynamic[1] - entry.size + 1, entry.size):
            tag, value = entry.unpack_from(data, at)
            if tag == _DT_NULL:
                break
            if tag == _DT_NEEDED:
                needed.append(value)
            elif tag == _DT_STRTAB:
                strtab = value
    except struct.error:
        raise ElfFormatError("a header points past the end of the file") from None
    if not needed:
        return []
    if strtab is None:
        raise ElfFormatError("DT_NEEDED entries without a string table")
    base = next((strtab - vaddr + offset for vaddr, offset, size in loads if vaddr <= strtab < vaddr + size), None)
    if base is None:
        raise ElfFormatError("the string table lies in no loaded segment")
    names = []
    for index in needed:
        end = data.find(b"\0", base + index)
        if end < 0:
            raise ElfFormatError("a library name runs past the end of the file")
        names.append(data[base + index:end].decode("utf-8", "replace"))
    return names
