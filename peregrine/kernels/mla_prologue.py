"""MLA absorbed-decode prologue in one launch: the glue between the in-projection and mla_decode.

Per decode row n (N = B, or B·T in a verify step) and head h it computes what this chain does
    entries = cat(RMSNorm(kva[:, :r])·kv_norm, kva[:, r:])        -> the cache at slot_mapping[n]
    qh      = cat(q_nope[n, h] @ W_UK[h], q_rope[n, h])           -> [N, H, r + rope] for mla_decode
(kernels/norm.py rms_norm, torch.cat, ModelCache.write_latent, torch.bmm, torch.cat: five launches,
four of them outside Triton, so each also broke the PDL chain).

Two kinds of program share one 1-D grid:
  absorb programs, H · cdiv(r, BLOCK_R) of them: (head h, a BLOCK_R slice of r) over all N rows.
    The [nope, BLOCK_R] W_UK tile is a weight: loaded before the PDL wait, so at B = 1 the 4 MB
    W_UK stream of a 48B layer is spread over 256 programs and overlaps the previous kernel's
    tail. Rows come in chunks of ROWS (the smallest tensor-core M); FP32 accumulation, written in
    q's dtype. The slice-0 program of each head also copies q_rope into qh[..., r:].
  row programs, N of them: the kv RMSNorm of one row (FP32, the same expression as rms_norm, its
    result rounded to the model dtype as the chain's rms_norm output is), then the entry's write at
    its flat cache slot: cast to the cache dtype, or FP8 e4m3 with a per-row FP32 scale exactly as
    cache.quantize_fp8 computes it (IEEE divisions; torch on CUDA divides amax by FP8_MAX as a
    multiply by its reciprocal, so a scale can be an ulp from the chain's; the FP8 bytes agree).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import available, interpreting
from ..cache import FP8_MAX, FP8_MIN_SCALE
from .pdl import launch_kwargs, pdl_wait

ROWS = 16            # rows per absorb dot: the smallest tensor-core M (mma m16)
MIN_BLOCK = 16       # smallest tl.dot N / K dimension
MAX_BLOCK_R = 64     # a [128, 64] BF16 W_UK tile (16 KB) per program: 32 registers/thread at 4 warps
R_SLICES = 8         # aim: r split this many ways, so H=32 heads give 256 programs (~2 per SM at B=1)
NUM_WARPS = 4        # also the row programs' width: the same reduction layout as rms_norm's 4 warps
DTYPES = (torch.bfloat16, torch.float32)
_FP8_MAX = tl.constexpr(FP8_MAX)
_FP8_MIN_SCALE = tl.constexpr(FP8_MIN_SCALE)
E4M3_MIN_NORMAL = tl.constexpr(2.0 ** -6)
E4M3_SUB_SHIFTER = tl.constexpr(1.5 * 2.0 ** 14)  # FP32 ulp there is 2^-9, e4m3's subnormal step: x + c - c rounds to it


@triton.jit
def _rne_mantissa(x, DROP: tl.constexpr):
    """x (FP32) rounded to nearest-even with its low DROP mantissa bits cleared (finite, normal x)."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + ((1 << (DROP - 1)) - 1) + ((b >> DROP) & 1)) & (0xFFFFFFFF ^ ((1 << DROP) - 1))
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _to_cache(x, dst_ty: tl.constexpr, FP8: tl.constexpr, EXACT: tl.constexpr):
    """FP32 -> the cache dtype, rounded to nearest even as torch's casts are. Compiled casts do that
    (cvt.rn); the interpreter's truncate, so there (EXACT) x is first rounded to a value the cast keeps
    exactly: 16 mantissa bits dropped for BF16; for e4m3 20 above its normal floor, else steps of 2^-9."""
    if EXACT:
        if FP8:
            x = tl.where(tl.abs(x) >= E4M3_MIN_NORMAL, _rne_mantissa(x, 20),
                         (x + E4M3_SUB_SHIFTER) - E4M3_SUB_SHIFTER)
        elif dst_ty == tl.bfloat16:
            x = _rne_mantissa(x, 16)
    return x.to(dst_ty)


@triton.jit
def _absorb(q_ptr, wuk_ptr, qh_ptr, pid, N, s_qn, s_qh, s_wh, s_wk, s_on, s_oh,
            NOPE: tl.constexpr, R: tl.constexpr, ROPE: tl.constexpr, NRB: tl.constexpr,
            BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_ROPE: tl.constexpr,
            CDT: tl.constexpr, PREC: tl.constexpr, USE_PDL: tl.constexpr):
    h = pid // NRB
    rb = pid % NRB
    k = tl.arange(0, BLOCK_K)
    c = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    km, cm = k < NOPE, c < R
    w = tl.load(wuk_ptr + h.to(tl.int64) * s_wh + k[:, None] * s_wk + c[None, :],
                mask=km[:, None] & cm[None, :], other=0.0).to(CDT)  # a weight: ahead of the wait
    pdl_wait(USE_PDL)
    j = tl.arange(0, BLOCK_ROPE)
    jm = j < ROPE
    for n0 in range(0, N, BLOCK_B):
        n = n0 + tl.arange(0, BLOCK_B)
        nm = n < N
        q_row = q_ptr + n.to(tl.int64)[:, None] * s_qn + h * s_qh
        o_row = qh_ptr + n.to(tl.int64)[:, None] * s_on + h * s_oh
        qn = tl.load(q_row + k[None, :], mask=nm[:, None] & km[None, :], other=0.0).to(CDT)
        acc = tl.dot(qn, w, input_precision=PREC)
        tl.store(o_row + c[None, :], acc.to(qh_ptr.dtype.element_ty), mask=nm[:, None] & cm[None, :])
        if rb == 0:  # q_rope passes through: qh[..., r:] = q[..., nope:]
            qr = tl.load(q_row + NOPE + j[None, :], mask=nm[:, None] & jm[None, :], other=0.0)
            tl.store(o_row + R + j[None, :], qr.to(qh_ptr.dtype.element_ty), mask=nm[:, None] & jm[None, :])


@triton.jit
def _cache_row(kva_ptr, kvw_ptr, lat_ptr, scale_ptr, slot_ptr, n, D, eps, s_kn, s_lat,
               R: tl.constexpr, ROPE: tl.constexpr, BLOCK_RR: tl.constexpr, BLOCK_ROPE: tl.constexpr,
               FP8: tl.constexpr, EXACT: tl.constexpr, USE_PDL: tl.constexpr):
    cr = tl.arange(0, BLOCK_RR)
    rm = cr < R
    w = tl.load(kvw_ptr + cr, mask=rm, other=0.0).to(tl.float32)  # a weight: ahead of the wait
    pdl_wait(USE_PDL)
    row = kva_ptr + n.to(tl.int64) * s_kn
    v = tl.load(row + cr, mask=rm, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)  # rms_norm's expression, term for term
    y = (v * rstd * w).to(kva_ptr.dtype.element_ty).to(tl.float32)  # the chain's norm output dtype
    j = tl.arange(0, BLOCK_ROPE)
    jm = j < ROPE
    kr = tl.load(row + R + j, mask=jm, other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    dst = lat_ptr + slot * s_lat
    ty: tl.constexpr = lat_ptr.dtype.element_ty
    if FP8:  # cache.quantize_fp8 over the whole entry [normed, k_rope]
        amax = tl.maximum(tl.max(tl.abs(y), axis=0), tl.max(tl.abs(kr), axis=0))
        sc = tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _FP8_MIN_SCALE)
        y = tl.minimum(tl.maximum(tl.math.div_rn(y, sc), -_FP8_MAX), _FP8_MAX)
        kr = tl.minimum(tl.maximum(tl.math.div_rn(kr, sc), -_FP8_MAX), _FP8_MAX)
        tl.store(scale_ptr + slot, sc)
    tl.store(dst + cr, _to_cache(y, ty, FP8, EXACT), mask=rm)
    tl.store(dst + R + j, _to_cache(kr, ty, FP8, EXACT), mask=jm)


@triton.jit
def _mla_prologue_kernel(
    q_ptr, kva_ptr, wuk_ptr, kvw_ptr, qh_ptr, lat_ptr, scale_ptr, slot_ptr,
    N, D, eps, s_qn, s_qh, s_kn, s_wh, s_wk, s_on, s_oh, s_lat,
    H: tl.constexpr, NOPE: tl.constexpr, R: tl.constexpr, ROPE: tl.constexpr, NRB: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_RR: tl.constexpr,
    BLOCK_ROPE: tl.constexpr, FP8: tl.constexpr, EXACT: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pid = tl.program_id(0)
    if pid < H * NRB:
        _absorb(q_ptr, wuk_ptr, qh_ptr, pid, N, s_qn, s_qh, s_wh, s_wk, s_on, s_oh, NOPE, R, ROPE, NRB,
                BLOCK_B, BLOCK_K, BLOCK_R, BLOCK_ROPE, CDT, PREC, USE_PDL)
    else:
        _cache_row(kva_ptr, kvw_ptr, lat_ptr, scale_ptr, slot_ptr, pid - H * NRB, D, eps, s_kn, s_lat,
                   R, ROPE, BLOCK_RR, BLOCK_ROPE, FP8, EXACT, USE_PDL)


def pick_block_r(r: int) -> int:
    """The r slice per absorb program: r / R_SLICES rounded up to a power of 2, within the dot's bounds."""
    return max(MIN_BLOCK, min(MAX_BLOCK_R, triton.next_power_of_2(triton.cdiv(r, R_SLICES))))


def why_not(q, kva, w_uk, latent) -> str | None:
    """None when mla_prologue can serve these tensors, else why the chain must."""
    if not available(q.device):
        return "kernels unavailable"
    if q.dtype not in DTYPES or kva.dtype not in DTYPES or w_uk.dtype not in DTYPES:
        return f"dtypes {q.dtype}/{kva.dtype}/{w_uk.dtype}"
    if q.dim() != 3 or q.stride(2) != 1 or kva.dim() != 2 or kva.stride(1) != 1 or w_uk.stride(2) != 1:
        return "needs unit inner strides"
    if not latent.is_contiguous():
        return "latent cache not contiguous"
    return None


def mla_prologue(q, kva, w_uk, kv_norm, eps: float, latent, scale, slot_mapping, *, out=None):
    """q [N, H, nope + rope], kva [N, r + rope] (unit inner strides, any row stride), w_uk [H, nope, r]
    (unit inner stride), kv_norm [r]; latent: one layer's cache [..., r + rope] (contiguous; model dtype,
    BF16 or float8_e4m3fn), scale its FP32 [...] per-entry scales when FP8 else None; slot_mapping [N]
    flat entry positions. Writes the N entries into the cache and returns qh [N, H, r + rope] in q.dtype."""
    N, H, QK = q.shape
    Hw, NOPE, R = w_uk.shape
    ROPE, L = QK - NOPE, R + QK - NOPE
    assert Hw == H and kva.shape == (N, L) and kv_norm.shape == (R,) and kv_norm.is_contiguous()
    assert latent.shape[-1] == L and slot_mapping.shape == (N,)
    fp8 = latent.dtype == torch.float8_e4m3fn
    assert (scale is not None) == fp8, "scale is required exactly for an FP8 cache"
    assert why_not(q, kva, w_uk, latent) is None, why_not(q, kva, w_uk, latent)
    flat = latent.view(-1, L)
    sc = scale.view(-1) if fp8 else flat  # placeholder pointer when not FP8
    if out is None:
        out = torch.empty(N, H, L, dtype=q.dtype, device=q.device)
    assert out.shape == (N, H, L) and out.dtype == q.dtype and out.stride(2) == 1
    if N == 0:
        return out
    block_r = pick_block_r(R)
    nrb = triton.cdiv(R, block_r)
    f32 = q.dtype == torch.float32 or w_uk.dtype == torch.float32
    # interpreter: FP32 dots (triton 3.6's interpreted BF16 tl.dot is wrong)
    cdt = tl.float32 if interpreting() or f32 else tl.bfloat16
    _mla_prologue_kernel[(H * nrb + N,)](
        q, kva, w_uk, kv_norm, out, flat, sc, slot_mapping,
        N, R, float(eps), q.stride(0), q.stride(1), kva.stride(0), w_uk.stride(0), w_uk.stride(1),
        out.stride(0), out.stride(1), flat.stride(0),
        H=H, NOPE=NOPE, R=R, ROPE=ROPE, NRB=nrb, BLOCK_B=ROWS,
        BLOCK_K=max(MIN_BLOCK, triton.next_power_of_2(NOPE)), BLOCK_R=block_r,
        BLOCK_RR=triton.next_power_of_2(R), BLOCK_ROPE=max(MIN_BLOCK, triton.next_power_of_2(ROPE)),
        FP8=fp8, EXACT=interpreting(), CDT=cdt, PREC="ieee" if f32 else "tf32", num_warps=NUM_WARPS, **launch_kwargs(q.device),
    )
    return out


def mla_prologue_ref(q, kva, w_uk, kv_norm, eps: float):
    """FP32 reference of the chain's math: (qh [N, H, r + rope], entries [N, r + rope]), unrounded."""
    R = w_uk.shape[2]
    NOPE = w_uk.shape[1]
    qf, kf = q.float(), kva.float()
    c = kf[:, :R]
    normed = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps) * kv_norm.float()
    entries = torch.cat([normed, kf[:, R:]], -1)
    q_lat = torch.einsum("nhk,hkr->nhr", qf[..., :NOPE], w_uk.float())
    return torch.cat([q_lat, qf[..., NOPE:]], -1), entries
