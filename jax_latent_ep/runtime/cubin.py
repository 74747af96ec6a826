"""Reads a compiled cubin's ELF records: its sections, the `.nv.info` attributes, a kernel's registers and spills
(no CuTe DSL, no GPU: the tests read the cubins the build wrote)."""

from __future__ import annotations

import struct


def elf_sections(elf: bytes) -> dict[str, bytes]:
    """Section name -> bytes of a 64-bit little-endian ELF (a cubin)."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError("not a 64-bit ELF")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx]
    strtab = elf[names[4] : names[4] + names[5]]
    return {strtab[h[0] : strtab.index(b"\0", h[0])].decode(): elf[h[4] : h[4] + h[5]] for h in headers}


def nv_info_records(info: bytes):
    """`(attribute, payload)` of each record of an `.nv.info*` section (EIFMT_SVAL: a u16 size and its payload;
    EIFMT_HVAL / BVAL: a u16 value; EIFMT_NVAL: none)."""
    i = 0
    while i < len(info):
        fmt, attr = info[i], info[i + 1]
        if fmt == 0x04:
            size, = struct.unpack_from("<H", info, i + 2)
            yield attr, info[i + 4 : i + 4 + size]
            i += 4 + size
        elif fmt in (0x02, 0x03):
            yield attr, info[i + 2 : i + 4]
            i += 4
        else:
            yield attr, b""
            i += 2


def cubin_resources(cubin: bytes) -> tuple[int, int]:
    """`(registers a thread, local-memory frame bytes a thread)` of a one-kernel cubin, from `.nv.info`'s
    EIATTR_REGCOUNT (0x2f) and EIATTR_FRAME_SIZE (0x11) records: a frame above 0 is spilled registers (the
    kernels keep no local arrays)."""
    found = {}
    for attr, payload in nv_info_records(elf_sections(cubin)[".nv.info"]):
        if attr in (0x2F, 0x11):
            found[attr] = struct.unpack_from("<II", payload)[1]  # (symbol index, value)
    if 0x2F not in found:
        raise ValueError("the cubin has no EIATTR_REGCOUNT record")
    return found[0x2F], found.get(0x11, 0)
