"""CuTe DSL kernels for Hopper (issue #46): the building blocks of a warp-specialized persistent decode layer, in
NVIDIA's Python DSL for CUTLASS (`nvidia-cutlass-dsl`, the optional extra `cute`). They compile for sm_90a on a
machine without a GPU (aot.py cuts the cubin out of the DSL's ahead-of-time export, and the tests check its
instructions). The lent GPU cannot install the DSL (its CUDA 13 compiler wheel is 92 MB, over what a call carries),
so scripts/build_cute_gpu.sh links each into a small shared library here and launch.py loads it there. Nothing in
the model calls them yet: weight_stream.py (one GEMV, the ring) and persistent_layer.py (the persistent task kernel over
persistent/table.py's encoding)."""


def available() -> bool:
    try:
        import cutlass.cute  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means the optional extra is not usable here
        return False
    return True
