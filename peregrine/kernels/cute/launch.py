"""Loading a CuTe kernel built by aot.build_shared on the GPU machine, where the DSL itself cannot be installed:
the CUDA runtime the library calls is loaded first with its symbols global (torch's own, or the nvidia-cuda-runtime
package's), then the library; run() takes device pointers and launches on the default stream."""
from __future__ import annotations

import ctypes
import glob
import os


def _cudart() -> ctypes.CDLL:
    import torch
    roots = [os.path.dirname(torch.__file__)]
    try:
        import nvidia
        roots += list(nvidia.__path__)
    except ImportError:
        pass
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "**", "libcudart.so.*"), recursive=True), reverse=True):
            return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL("libcudart.so", mode=ctypes.RTLD_GLOBAL)


class CuteLibrary:
    def __init__(self, path: str):
        self.runtime = _cudart()
        self.lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)  # each library its own symbols: they share names
        err = self.lib.cute_load()
        if err:
            raise RuntimeError(f"{path}: loading the kernel failed (CUDA error {err})")

    def run(self, *tensors) -> None:
        """Launch with these tensors' device pointers (their shapes must be the ones compiled in)."""
        err = self.lib.cute_run(*(ctypes.c_void_p(t.data_ptr()) for t in tensors))
        if err:
            raise RuntimeError(f"CuTe kernel launch failed (CUDA error {err})")
