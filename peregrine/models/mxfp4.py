"""MXFP4 weights on the model side: dummy initialisation, and the format (kernels/mxfp4_format.py,
re-exported here: GROUP, E8M0_*, E2M1_*, pack / unpack / dequantize / quantize) the loader and the
standard path's dequantize-then-GEMM use.
"""
from __future__ import annotations

import math

import torch

from ..kernels.mxfp4_format import (E2M1_MEAN_SQ, E2M1_VALUES, E8M0_BIAS, E8M0_NAN, GROUP,  # noqa: F401
                                    byte_table, dequantize, e2m1_table, pack_codes, quantize, unpack_codes)


@torch.no_grad()
def random_fill(packed: torch.Tensor, scale: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """Dummy weights: uniform random codes, one scale chosen so the dequantized RMS ≈ std."""
    packed.copy_(torch.randint(0, 256, packed.shape, generator=gen, device=packed.device, dtype=torch.int32))
    e = round(math.log2(std / math.sqrt(E2M1_MEAN_SQ)))
    scale.fill_(e + E8M0_BIAS)


def mxfp4_gemv(*args, **kwargs):
    """The Triton GEMV over packed weights lives with the expert kernels (kernels/moe_mxfp4.py);
    imported on use, so the standard path never needs triton."""
    from ..kernels.moe_mxfp4 import mxfp4_gemv as gemv
    return gemv(*args, **kwargs)
