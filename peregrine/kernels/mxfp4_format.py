"""MXFP4 (OCP microscaling FP4): E2M1 values in groups of 32 sharing one E8M0 scale.

The format itself, torch only (no Triton): the constants the MXFP4 kernels decode with, and the
pack / unpack / dequantize / quantize helpers the model code and the kernels' references use
(models/mxfp4.py re-exports them).

Layout (K3's compressed-tensors "mxfp4-pack-quantized"): a weight [R, C] is stored as
``weight_packed [R, C/2] uint8`` — two E2M1 codes a byte, element 2j in the LOW
nibble and 2j+1 in the high nibble — and ``weight_scale [R, C/32] uint8`` (E8M0:
value 2^(byte − 127)). An E2M1 code is sign bit 3 | magnitude index bits 0–2 into
E2M1_VALUES. pack/unpack below are exact inverses of each other.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

GROUP = 32             # values sharing one scale (the MX block size)
E8M0_BIAS = 127        # scale = 2^(byte - 127)
E8M0_NAN = 255         # the one non-finite E8M0 code
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7
# mean of v² over the 16 codes: dummy init picks the scale that gives a target RMS
E2M1_MEAN_SQ = sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES)


def e2m1_table(device=None, dtype=torch.float32) -> torch.Tensor:
    """Value of each of the 16 codes [16]."""
    mag = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return torch.cat([mag, -mag])


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., C/2] uint8 -> [..., C] codes (uint8 in 0..15), low nibble first."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], -1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., C] codes in 0..15 (C even) -> [..., C/2] uint8; inverse of unpack_codes."""
    c = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return c[..., 0] | (c[..., 1] << 4)


def byte_table(device=None, dtype=torch.float32) -> torch.Tensor:
    """[256, 2]: the two values (low nibble, high nibble) of every packed byte."""
    t = e2m1_table(device, dtype)
    b = torch.arange(256, device=device)
    return torch.stack([t[b & 0xF], t[b >> 4]], -1)


@functools.lru_cache(maxsize=None)
def _cached_byte_table(device, dtype) -> torch.Tensor:
    """Made once per device: a host-to-device copy would break CUDA-graph capture of the decode step."""
    return byte_table(device, dtype)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """[..., C/2] uint8 + [..., C/32] uint8 E8M0 -> [..., C] in `dtype`.

    Computed in `dtype` throughout (a code times a power of two is exact in BF16 and
    FP32), through a 256-entry byte table with int32 indices to keep temporaries small.
    """
    vals = F.embedding(packed.int(), _cached_byte_table(packed.device, dtype)).flatten(-2)
    s = torch.exp2(scale.to(dtype) - E8M0_BIAS).masked_fill(scale == E8M0_NAN, float("nan"))
    return vals.unflatten(-1, (-1, GROUP)).mul_(s.unsqueeze(-1)).flatten(-2)  # in place: one full-size temporary


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., C] float (C % 32 == 0) -> (packed, scale): per group the largest power of two
    that keeps max|w| ≤ 6·scale, then round-to-nearest code (ties to the lower magnitude)."""
    g = w.float().unflatten(-1, (-1, GROUP))
    amax = g.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
    e = torch.ceil(torch.log2(amax / E2M1_VALUES[-1])).clamp(-E8M0_BIAS, E8M0_BIAS)
    x = g / torch.exp2(e)
    mag = torch.tensor(E2M1_VALUES, device=w.device)
    idx = (x.abs().unsqueeze(-1) - mag).abs().argmin(-1)
    codes = (idx + 8 * (x < 0)).to(torch.uint8).flatten(-2)
    return pack_codes(codes), (e.squeeze(-1) + E8M0_BIAS).to(torch.uint8)
