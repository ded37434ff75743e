"""MXFP4 (OCP microscaling FP4): E2M1 values in groups of 32 sharing one E8M0 scale.

Layout (K3's compressed-tensors "mxfp4-pack-quantized"): a weight [R, C] is stored as
``weight_packed [R, C/2] uint8`` — two E2M1 codes a byte, element 2j in the LOW
nibble and 2j+1 in the high nibble — and ``weight_scale [R, C/32] uint8`` (E8M0:
value 2^(byte − 127)). An E2M1 code is sign bit 3 | magnitude index bits 0–2 into
E2M1_VALUES. pack/unpack below are exact inverses of each other.
"""
from __future__ import annotations

import math

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


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """[..., C/2] uint8 + [..., C/32] uint8 E8M0 -> [..., C] in `dtype`.

    Computed in `dtype` throughout (a code times a power of two is exact in BF16 and
    FP32), through a 256-entry byte table with int32 indices to keep temporaries small.
    """
    vals = F.embedding(packed.int(), byte_table(packed.device, dtype)).flatten(-2)
    s = torch.exp2(scale.to(dtype) - E8M0_BIAS).masked_fill(scale == E8M0_NAN, float("nan"))
    return (vals.unflatten(-1, (-1, GROUP)) * s.unsqueeze(-1)).flatten(-2)


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


@torch.no_grad()
def random_fill(packed: torch.Tensor, scale: torch.Tensor, std: float, gen: torch.Generator) -> None:
    """Dummy weights: uniform random codes, one scale chosen so the dequantized RMS ≈ std."""
    packed.copy_(torch.randint(0, 256, packed.shape, generator=gen, device=packed.device, dtype=torch.int32))
    e = round(math.log2(std / math.sqrt(E2M1_MEAN_SQ)))
    scale.fill_(e + E8M0_BIAS)


# ---- Triton GEMV over MXFP4 weights (decode: FP4 read, dequantized in registers) ----
# Lives here until the specialized K3 path adopts it (then: peregrine/kernels/).
try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - the standard path never needs triton
    triton = None

GEMV_BLOCK_R = 16   # output rows per program
GEMV_BLOCK_B = 128  # packed bytes (256 values, 8 scale groups) per inner step
BYTES_PER_GROUP = GROUP // 2

if triton is not None:
    @triton.jit
    def _e2m1(code):
        """E2M1 code (int32, 0..15) -> FP32 value, by its bit fields."""
        e = (code >> 1) & 3
        m = (code & 1).to(tl.float32)
        mag = tl.where(e == 0, 0.5 * m, tl.where(e == 1, 1.0 + 0.5 * m, tl.where(e == 2, 2.0 + m, 4.0 + 2.0 * m)))
        return tl.where((code & 8) != 0, -mag, mag)

    @triton.jit
    def _mxfp4_gemv_kernel(x_ptr, q_ptr, s_ptr, ids_ptr, y_ptr, R, C2, stride_xm, stride_ym,
                           HAS_IDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, BPG: tl.constexpr):
        pid_r, m = tl.program_id(0), tl.program_id(1)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        rows = offs_r.to(tl.int64)
        if HAS_IDS:  # this row's expert
            rows += tl.load(ids_ptr + m).to(tl.int64) * R
        CG = C2 // BPG
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        for b0 in range(0, C2, BLOCK_B):
            offs_b = b0 + tl.arange(0, BLOCK_B)
            mask_b = offs_b < C2
            mask = mask_r[:, None] & mask_b[None, :]
            byte = tl.load(q_ptr + rows[:, None] * C2 + offs_b[None, :], mask=mask, other=0).to(tl.int32)
            sc = tl.load(s_ptr + rows[:, None] * CG + (offs_b // BPG)[None, :], mask=mask, other=127).to(tl.int32)
            scale = (sc << 23).to(tl.float32, bitcast=True)  # E8M0 -> 2^(s-127) (s = 0 reads as 0)
            xe = tl.load(x_ptr + m * stride_xm + 2 * offs_b, mask=mask_b, other=0.0).to(tl.float32)
            xo = tl.load(x_ptr + m * stride_xm + 2 * offs_b + 1, mask=mask_b, other=0.0).to(tl.float32)
            part = _e2m1(byte & 15) * xe[None, :] + _e2m1(byte >> 4) * xo[None, :]
            acc += tl.sum(part * scale, axis=1)
        tl.store(y_ptr + m * stride_ym + offs_r, acc, mask=mask_r)


def mxfp4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """y[m] = W_{ids[m]} x[m] in FP32, reading the 4-bit weights directly.

    x [M, C] (BF16/FP32, unit stride), packed [E, R, C/2] uint8 and scale [E, R, C/32] uint8
    (or [R, ...] without ids: every row uses the same weight), ids [M] int -> out [M, R] FP32.
    """
    M, C = x.shape
    if ids is None:
        packed, scale = packed.unsqueeze(0), scale.unsqueeze(0)
    E, R, C2 = packed.shape
    assert C == 2 * C2 and C % GROUP == 0 and scale.shape == (E, R, C // GROUP)
    assert packed.is_contiguous() and scale.is_contiguous() and x.stride(1) == 1
    if out is None:
        out = torch.empty(M, R, dtype=torch.float32, device=x.device)
    assert out.shape == (M, R) and out.stride(1) == 1 and out.dtype == torch.float32
    ids_arg = ids.contiguous() if ids is not None else packed  # unread when HAS_IDS is off
    _mxfp4_gemv_kernel[(triton.cdiv(R, GEMV_BLOCK_R), M)](
        x, packed, scale, ids_arg, out, R, C2, x.stride(0), out.stride(0),
        HAS_IDS=ids is not None, BLOCK_R=GEMV_BLOCK_R, BLOCK_B=GEMV_BLOCK_B, BPG=BYTES_PER_GROUP)
    return out
