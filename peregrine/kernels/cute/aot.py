"""Ahead-of-time sm_90a compiles of CuTe DSL kernels, no GPU needed: the DSL's export (a host object with the
device code embedded) and the sm_90 cubins cut out of it (ELF objects for EM_CUDA inside the host ELF)."""
from __future__ import annotations

import os
import struct
import tempfile

EM_CUDA = 190     # ELF e_machine of NVIDIA GPU code
SHT_NOBITS = 8    # a section with no bytes in the file
ARCH = "sm_90a"   # Hopper with its architecture-specific instructions (wgmma, setmaxnreg)


def cubins(obj: bytes) -> list[bytes]:
    """Every CUDA ELF embedded in a host object, each cut at the end of its furthest section or segment."""
    out, i = [], 0
    while (i := obj.find(b"\x7fELF", i + 1)) >= 0:
        e = obj[i:]
        if len(e) < 64 or struct.unpack_from("<H", e, 0x12)[0] != EM_CUDA:
            continue
        ph_off, sh_off = struct.unpack_from("<QQ", e, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", e, 0x36)
        end = sh_off + shentsize * shnum
        for k in range(shnum):
            typ = struct.unpack_from("<I", e, sh_off + k * shentsize + 4)[0]
            off, size = struct.unpack_from("<QQ", e, sh_off + k * shentsize + 0x18)
            if typ != SHT_NOBITS:
                end = max(end, off + size)
        for k in range(phnum):
            off, _, _, filesz = struct.unpack_from("<QQQQ", e, ph_off + k * phentsize + 8)
            end = max(end, off + filesz)
        out.append(e[:end])
    return out


def compile_sm90(jit_fn, *args) -> tuple[object, list[bytes]]:
    """cute.compile(jit_fn, *args) for sm_90a (args may be fake tensors: no GPU, no memory) -> (the compiled
    function, its cubins). CUTE_DSL_ARCH is read when the DSL loads, so this sets it before importing."""
    os.environ["CUTE_DSL_ARCH"] = ARCH
    import cutlass.cute as cute
    f = cute.compile(jit_fn, *args)
    with tempfile.TemporaryDirectory() as d:
        f.export_to_c(d, "k")
        with open(os.path.join(d, "k.o"), "rb") as fh:
            return f, cubins(fh.read())
