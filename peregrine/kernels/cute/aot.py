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


# A C entry point over the DSL's export: load(), then run(pointers...) launches the kernel on the default stream.
# The export's own header needs the CUDA headers; these few declarations do not (a tensor of static layout is a
# struct of its data pointer, and the module is loaded through the export's init / load_to_device functions).
_WRAPPER = r"""
#include <stdint.h>
typedef struct { void *data; } cute_tensor_t;
extern void INIT(void **);
extern void LOAD(void **);
extern void CIFACE(void **args, int32_t num_args);
extern int cudaGetDeviceCount(int *);
static void *library;
int cute_load(void) {
    void **library_ptr = &library;
    int ret = 0;
    struct { void ***library_ptr; int *ret; } init_args = {&library_ptr, &ret};
    INIT((void **)&init_args);
    if (ret) return ret;
    int n = 0, err = cudaGetDeviceCount(&n);
    if (err) return err;
    for (int32_t i = 0; i < n; i++) {
        int32_t dev = i;
        struct { void ***library_ptr; int32_t *dev; int *ret; } load_args = {&library_ptr, &dev, &ret};
        LOAD((void **)&load_args);
        if (ret) return ret;
    }
    return 0;
}
int cute_run(NPARAMS) {
    cute_tensor_t t[NT] = {TENSORS};
    int32_t ret = 0;
    void *args[NT + 1] = {ARGS &ret};
    CIFACE(args, NT + 1);
    return ret;
}
"""


def runtime_archive() -> str:
    """The DSL flavor's static launch runtime (cu12 or cu13, whichever the DSL loaded)."""
    import glob
    import nvidia_cutlass_dsl
    root = list(nvidia_cutlass_dsl.__path__)[0]
    import cutlass._mlir._mlir_libs as libs
    flavor = "cu13" if ".cu13." in os.path.basename(getattr(libs._cutlass_ir, "__file__", "")) else "cu12"
    found = glob.glob(os.path.join(root, flavor, "lib", "libcuda_dialect_runtime_static.a"))
    if not found:
        raise FileNotFoundError(f"no {flavor} launch runtime under {root}")
    return found[0]


def build_shared(jit_fn, args, num_tensors: int, out: str) -> str:
    """Export jit_fn(*args) for sm_90a and link it with the DSL's launch runtime and a C entry point into the
    shared library `out` (cute_load(), cute_run(void *t0, ..)); its CUDA runtime symbols resolve where it is
    loaded (launch.py). Needs a C compiler (cc)."""
    import subprocess
    os.environ["CUTE_DSL_ARCH"] = ARCH
    import cutlass.cute as cute
    f = cute.compile(jit_fn, *args)
    with tempfile.TemporaryDirectory() as d:
        f.export_to_c(d, "k")
        syms = subprocess.run(["nm", os.path.join(d, "k.o")], capture_output=True, text=True, check=True).stdout
        ciface = next(s.split()[-1] for s in syms.splitlines() if " T _mlir_k__mlir_ciface_" in s)
        params = ", ".join(f"void *p{i}" for i in range(num_tensors))
        src = (_WRAPPER.replace("INIT", "_mlir_k_cuda_init").replace("LOAD", "_mlir_k_cuda_load_to_device")
               .replace("CIFACE", ciface).replace("NPARAMS", params).replace("NT", str(num_tensors))
               .replace("TENSORS", ", ".join(f"{{p{i}}}" for i in range(num_tensors)))
               .replace("ARGS", "".join(f"&t[{i}], " for i in range(num_tensors))))
        with open(os.path.join(d, "entry.c"), "w") as fh:
            fh.write(src)
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-Wl,-Bsymbolic", os.path.join(d, "entry.c"), os.path.join(d, "k.o"),
                        runtime_archive(), "-o", out], check=True, capture_output=True, text=True)
    return out
