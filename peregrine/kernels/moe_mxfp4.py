"""MXFP4 routed experts for decode: the 4-bit weights are read as stored and
dequantized in registers (weights E2M1 + E8M0, activations BF16, FP32 accumulate).

Layout (models/mxfp4.py): a weight [R, C] is packed [R, C/2] uint8 (element 2j in
the low nibble, 2j+1 in the high one) with one E8M0 scale byte per 32 values
[R, C/32]. Stacked per expert: w13 [E, 2I, Dz/2] + [E, 2I, Dz/32] (gate rows then
up rows), w2 [E, Dz, I/2] + [E, Dz, I/32].

Dequantization: an E2M1 code (sign s, exponent e, mantissa m) placed into FP16 bits
as s<<15 | e<<10 | m<<9 is exactly its value times 2^-14 (e = 0 lands on the FP16
subnormals, which is what E2M1's e = 0 means too), so a code costs a few integer
ops and one conversion; the 2^14 is folded into the group's scale. Low nibbles
multiply the even elements of the activation, high nibbles the odd ones, so the
packed tile never needs to be interleaved.

Same schedule as kernels/moe.py (no host sync, CUDA-graph capturable, no atomics):
 1. up: grid (B·k assignments, I tiles); only the first assignment of each expert
    works and serves every token that chose it, so W1/W3 of a chosen expert are
    read once per step. Writes act(gate, up) FP32 to h [B, k, I].
 2. down: grid (B·k, Dz tiles), same first-occurrence rule over W2, writes
    FP32 partials [B, k, Dz]; kernels/moe.py's combine scales by topk_w and sums over k.
s = 255 (E8M0 NaN) makes its group NaN, as in mxfp4.dequantize; s = 0 (2^-127) reads as 0.

Cost (sm_90a PTX of the down kernel's loop, 32x64-byte tile): ~19 instructions per weight value
(nibble ops, f16->f32, scale multiply, ->bf16, shared-memory staging for the MMA operand),
against ~4 per value that the ALUs can afford at copy bandwidth: expect this to be ALU-bound
(bench/kernels_moe_mxfp4.py measures it). The cheaper form: 32-bit words holding 8 codes paired
16 bits apart (two codes per shift/and/lop3 -> FP16x2 without conversion), scales applied in FP16
relative to the row tile's largest, FP16 MMA with per-token power-of-two scaled activations.
Variant "v2" (kernels/moe_mxfp4_v2.py) takes the word decode with FP32 FMAs and one scale multiply
per 32-value group instead (faster than v1 only at B = 1). Variant "v3" (kernels/moe_mxfp4_v3.py) puts
the weights on the MMA's register side with a packed BF16x2 decode: the fastest at every B, the default.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..models import mxfp4
from .moe import (ACTIVATIONS, MIN_DOT_ROWS, SITU_BETA, SITU_LINEAR_BETA, _dot_meta, _first_use, _pow2,
                  _token_slots, moe_combine, moe_experts_ref)

GROUP = mxfp4.GROUP                  # values per E8M0 scale
BPG = GROUP // 2                     # packed bytes per scale group
E8M0_NAN = tl.constexpr(mxfp4.E8M0_NAN)  # the scale code that means NaN
FP16_CODE_SCALE = tl.constexpr(2.0 ** 14)  # an E2M1 code read as FP16 bits is its value times 2^-14
# H200 sweep (results/2026-11-29-h200-k3-slice-kernels-moe-mxfp4.json): 64-byte steps at 4 warps were the
# fastest tiles at every B = 1..8, 1.85x the earlier 128-byte / 8-warp default
UP_BLOCK_I, UP_BLOCK_KB, UP_WARPS = 32, 64, 4           # gate+up rows, packed bytes per step (2 x 2 KB in flight)
DOWN_BLOCK_D, DOWN_BLOCK_KB, DOWN_WARPS = 32, 64, 4     # W2 rows, packed bytes per step (2 KB in flight)
GEMV_BLOCK_R, GEMV_BLOCK_KB = 16, 128                   # one-matrix GEMV tiles (small M, no tl.dot)
VARIANTS = ("v1", "v2", "v3")  # v1: this file's MMA kernels; v2: kernels/moe_mxfp4_v2.py (word decode, FMA, group
#   scales); v3: kernels/moe_mxfp4_v3.py (weights as the MMA's register operand, packed BF16x2 decode)
# H200, k3-slice, B = 1/2/4/8 (results/2026-12-04-session20, call 1): v3 0.316 / 0.544 / 0.919 / 1.433 ms against
# v2 0.415 / 1.03 / 2.92 / 8.53 and v1 0.470 / 0.876 / 1.58 / 2.68: v3 at every B
DEFAULT_VARIANT = "v3"
VARIANT_ENV = "PEREGRINE_MXFP4_VARIANT"  # overrides the default (A/B runs of the decode step)


def default_variant(B: int) -> str:
    v = os.environ.get(VARIANT_ENV) or DEFAULT_VARIANT
    if v not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV}={v!r}: expected one of {', '.join(VARIANTS)}")
    return v


@triton.jit
def _group_scales(s_ptr, rows, row_ok, offs_g, g_ok, KG):
    """E8M0 scale bytes of groups offs_g of `rows` -> FP32 [R, NG]: 2^(s-127) with the FP16 codes'
    2^14 folded in, NaN for s = 255 (per group, so nearly free)."""
    s = tl.load(s_ptr + rows[:, None] * KG + offs_g[None, :], mask=row_ok[:, None] & g_ok[None, :], other=127)
    sc = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True) * FP16_CODE_SCALE
    return tl.where(s == E8M0_NAN, float("nan"), sc)


@triton.jit
def _act(acc_g, acc_u, ACT: tl.constexpr, BETA: tl.constexpr, BETA_L: tl.constexpr):
    """act(gate, up) in FP32: SwiGLU (ACT 0) or SiTU, tanh from e^{-2|z|} ∈ (0, 1]: no overflow,
    exact ±1 saturation."""
    if ACT == 0:
        return acc_g * tl.sigmoid(acc_g) * acc_u
    eg = tl.exp(-2.0 * tl.abs(acc_g) / BETA)
    eu = tl.exp(-2.0 * tl.abs(acc_u) / BETA_L)
    tg = tl.where(acc_g < 0, -1.0, 1.0) * (1.0 - eg) / (1.0 + eg)
    tu = tl.where(acc_u < 0, -1.0, 1.0) * (1.0 - eu) / (1.0 + eu)
    return BETA * tg * tl.sigmoid(acc_g) * (BETA_L * tu)


@triton.jit
def _dequant(byte, scale, HIGH: tl.constexpr, R: tl.constexpr, NG: tl.constexpr, BPG: tl.constexpr):
    """Packed bytes [R, NG, BPG] (int32) and FP32 group scales [R, NG] (2^14 folded in) -> the low or
    high nibbles' values [R, NG*BPG] FP32."""
    if HIGH:
        bits = ((byte & 0x70) << 5) | ((byte & 0x80) << 8)
    else:
        bits = ((byte & 0x7) << 9) | ((byte & 0x8) << 12)
    v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * scale[:, :, None]
    return tl.reshape(v, [R, NG * BPG])


@triton.jit
def _tile(q_ptr, s_ptr, rows, row_ok, kb0, KB, KG,
          R: tl.constexpr, BLOCK_KB: tl.constexpr, BPG: tl.constexpr):
    """Even- and odd-element weights [R, BLOCK_KB] FP32 of packed columns kb0.. of `rows` (int64 row indices)."""
    NG: tl.constexpr = BLOCK_KB // BPG
    offs_g = kb0 // BPG + tl.arange(0, NG)
    offs_j = tl.arange(0, BPG)
    g_ok = offs_g < KG
    col = offs_g[None, :, None] * BPG + offs_j[None, None, :]
    byte = tl.load(q_ptr + rows[:, None, None] * KB + col, mask=row_ok[:, None, None] & g_ok[None, :, None],
                   other=0).to(tl.int32)
    sc = _group_scales(s_ptr, rows, row_ok, offs_g, g_ok, KG)
    return _dequant(byte, sc, False, R, NG, BPG), _dequant(byte, sc, True, R, NG, BPG)


@triton.jit
def _mx_up_kernel(x_ptr, q_ptr, s_ptr, ids_ptr, h_ptr, B, KB, I, stride_xb,
                  TOP_K: tl.constexpr, B_PAD: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr,
                  BLOCK_I: tl.constexpr, BLOCK_KB: tl.constexpr, BPG: tl.constexpr, ACT: tl.constexpr,
                  DOT_T: tl.constexpr, PREC: tl.constexpr, BETA: tl.constexpr, BETA_L: tl.constexpr):
    n = tl.program_id(0)
    e = tl.load(ids_ptr + n)
    if _first_use(ids_ptr, n, e, B * TOP_K, N_PAD):  # the first assignment of e serves every token that chose it
        chose, slot = _token_slots(ids_ptr, e, B, TOP_K, B_PAD, K_PAD)
        offs_b = tl.arange(0, B_PAD)
        offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        i_ok = offs_i < I
        KG = KB // BPG
        g_rows = e.to(tl.int64) * 2 * I + offs_i.to(tl.int64)
        u_rows = g_rows + I
        offs_k = tl.arange(0, BLOCK_KB)
        acc_g = tl.zeros([B_PAD, BLOCK_I], tl.float32)
        acc_u = tl.zeros([B_PAD, BLOCK_I], tl.float32)
        for kb0 in range(0, KB, BLOCK_KB):
            k = kb0 + offs_k
            xm = chose[:, None] & (k < KB)[None, :]
            xe = tl.load(x_ptr + offs_b[:, None] * stride_xb + 2 * k[None, :], mask=xm, other=0.0).to(DOT_T)
            xo = tl.load(x_ptr + offs_b[:, None] * stride_xb + 2 * k[None, :] + 1, mask=xm, other=0.0).to(DOT_T)
            glo, ghi = _tile(q_ptr, s_ptr, g_rows, i_ok, kb0, KB, KG, BLOCK_I, BLOCK_KB, BPG)
            acc_g = tl.dot(xe, tl.trans(glo.to(DOT_T)), acc_g, input_precision=PREC)
            acc_g = tl.dot(xo, tl.trans(ghi.to(DOT_T)), acc_g, input_precision=PREC)
            ulo, uhi = _tile(q_ptr, s_ptr, u_rows, i_ok, kb0, KB, KG, BLOCK_I, BLOCK_KB, BPG)
            acc_u = tl.dot(xe, tl.trans(ulo.to(DOT_T)), acc_u, input_precision=PREC)
            acc_u = tl.dot(xo, tl.trans(uhi.to(DOT_T)), acc_u, input_precision=PREC)
        h = _act(acc_g, acc_u, ACT, BETA, BETA_L)
        tl.store(h_ptr + (offs_b[:, None] * TOP_K + slot[:, None]) * I + offs_i[None, :], h,
                 mask=chose[:, None] & i_ok[None, :])


@triton.jit
def _mx_down_kernel(h_ptr, q_ptr, s_ptr, ids_ptr, part_ptr, B, D, KB,
                    TOP_K: tl.constexpr, B_PAD: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_KB: tl.constexpr, BPG: tl.constexpr,
                    DOT_T: tl.constexpr, PREC: tl.constexpr, ACT_T: tl.constexpr):
    n = tl.program_id(0)
    e = tl.load(ids_ptr + n)
    if _first_use(ids_ptr, n, e, B * TOP_K, N_PAD):  # the first assignment of e serves every token that chose it
        chose, slot = _token_slots(ids_ptr, e, B, TOP_K, B_PAD, K_PAD)
        offs_b = tl.arange(0, B_PAD)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        I = 2 * KB
        KG = KB // BPG
        rows = e.to(tl.int64) * D + offs_d.to(tl.int64)
        h_rows = h_ptr + (offs_b[:, None] * TOP_K + slot[:, None]) * I
        offs_k = tl.arange(0, BLOCK_KB)
        acc = tl.zeros([B_PAD, BLOCK_D], tl.float32)
        for kb0 in range(0, KB, BLOCK_KB):
            k = kb0 + offs_k
            hm = chose[:, None] & (k < KB)[None, :]
            # h rounds to BF16 (ACT_T) as the standard path's activations do
            he = tl.load(h_rows + 2 * k[None, :], mask=hm, other=0.0).to(ACT_T).to(DOT_T)
            ho = tl.load(h_rows + 2 * k[None, :] + 1, mask=hm, other=0.0).to(ACT_T).to(DOT_T)
            wlo, whi = _tile(q_ptr, s_ptr, rows, d_ok, kb0, KB, KG, BLOCK_D, BLOCK_KB, BPG)
            acc = tl.dot(he, tl.trans(wlo.to(DOT_T)), acc, input_precision=PREC)
            acc = tl.dot(ho, tl.trans(whi.to(DOT_T)), acc, input_precision=PREC)
        row = offs_b * TOP_K + slot
        tl.store(part_ptr + row[:, None] * D + offs_d[None, :], acc, mask=chose[:, None] & d_ok[None, :])


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def moe_mxfp4_experts(x: torch.Tensor, q13: torch.Tensor, s13: torch.Tensor, q2: torch.Tensor, s2: torch.Tensor,
                      topk_ids: torch.Tensor, topk_w: torch.Tensor, *, activation: str = "swiglu",
                      out: torch.Tensor | None = None, config: dict | None = None,
                      variant: str | None = None) -> torch.Tensor:
    """out[b] = Σ_k topk_w[b,k] · W2_e act(W1_e x_b, W3_e x_b) over MXFP4 experts; out in x.dtype.

    x [B, Dz] (BF16 or FP32), q13 [E, 2I, Dz/2] uint8 + s13 [E, 2I, Dz/32] uint8, q2 [E, Dz, I/2] + s2 [E, Dz, I/32],
    topk_ids [B, k] int32 (distinct per token), topk_w [B, k] FP32. config: tile overrides
    (UP_BLOCK_I, UP_BLOCK_KB, UP_WARPS, DOWN_BLOCK_D, DOWN_BLOCK_KB, DOWN_WARPS) for the benchmark sweep;
    with variant "v2"/"v3" its keys are moe_mxfp4_v2.KEYS / moe_mxfp4_v3.KEYS. variant: "v1" | "v2" | "v3",
    default default_variant(B).
    """
    variant = variant or default_variant(x.shape[0])
    assert variant in VARIANTS, variant
    B, Dz = x.shape
    E, two_i, kb_up = q13.shape
    I = two_i // 2
    k = topk_ids.shape[1]
    assert Dz % GROUP == 0 and I % GROUP == 0 and kb_up * 2 == Dz
    assert s13.shape == (E, 2 * I, Dz // GROUP) and q2.shape == (E, Dz, I // 2) and s2.shape == (E, Dz, I // GROUP)
    assert all(t.dtype == torch.uint8 and t.is_contiguous() for t in (q13, s13, q2, s2)), "packed weights: contiguous uint8"
    assert x.stride(1) == 1 and topk_ids.dtype == torch.int32 and topk_ids.is_contiguous() and topk_w.shape == (B, k)
    topk_w = topk_w.float().contiguous()
    if out is None:
        out = torch.empty(B, Dz, dtype=x.dtype, device=x.device)
    assert out.shape == (B, Dz) and out.stride(1) == 1
    h = torch.empty(B, k, I, dtype=torch.float32, device=x.device)
    part = torch.empty(B, k, Dz, dtype=torch.float32, device=x.device)
    if variant in ("v2", "v3"):
        from . import moe_mxfp4_v2, moe_mxfp4_v3
        mod = moe_mxfp4_v2 if variant == "v2" else moe_mxfp4_v3
        mod.launch(x, q13, s13, q2, s2, topk_ids, h, part, activation, _TL[x.dtype], config)
        return moe_combine(part.view(1, B * k, Dz), topk_w, out=out)
    c = {"UP_BLOCK_I": UP_BLOCK_I, "UP_BLOCK_KB": UP_BLOCK_KB, "UP_WARPS": UP_WARPS,
         "DOWN_BLOCK_D": DOWN_BLOCK_D, "DOWN_BLOCK_KB": DOWN_BLOCK_KB, "DOWN_WARPS": DOWN_WARPS, **(config or {})}
    # blocks never wider than the packed row (tiny test shapes), and whole scale groups
    up_kb = max(BPG, min(c["UP_BLOCK_KB"], _pow2(Dz // 2)))
    down_kb = max(BPG, min(c["DOWN_BLOCK_KB"], _pow2(I // 2)))
    meta = dict(TOP_K=k, B_PAD=max(MIN_DOT_ROWS, _pow2(B)), K_PAD=_pow2(k), N_PAD=_pow2(B * k), BPG=BPG,
                **_dot_meta(torch.bfloat16 if x.dtype != torch.float32 else torch.float32))
    _mx_up_kernel[(B * k, triton.cdiv(I, c["UP_BLOCK_I"]))](
        x, q13, s13, topk_ids, h, B, Dz // 2, I, x.stride(0),
        BLOCK_I=c["UP_BLOCK_I"], BLOCK_KB=up_kb, ACT=ACTIVATIONS[activation],
        BETA=SITU_BETA, BETA_L=SITU_LINEAR_BETA, num_warps=c["UP_WARPS"], **meta)
    _mx_down_kernel[(B * k, triton.cdiv(Dz, c["DOWN_BLOCK_D"]))](
        h, q2, s2, topk_ids, part, B, Dz, I // 2, BLOCK_D=c["DOWN_BLOCK_D"], BLOCK_KB=down_kb,
        ACT_T=_TL[x.dtype], num_warps=c["DOWN_WARPS"], **meta)
    return moe_combine(part.view(1, B * k, Dz), topk_w, out=out)  # kernels/moe.py's fixed-order k-sum


def moe_mxfp4_experts_ref(x, q13, s13, q2, s2, topk_ids, topk_w, activation: str = "swiglu") -> torch.Tensor:
    """FP32: each chosen expert dequantized (models/mxfp4.py table path), then the token loop of
    kernels/moe.py's reference. Returns FP32 [B, Dz]."""
    used = sorted(set(topk_ids.flatten().tolist()))
    remap = {e: j for j, e in enumerate(used)}
    u = torch.tensor(used, device=q13.device)
    w13 = mxfp4.dequantize(q13[u], s13[u], torch.float32)
    w2 = mxfp4.dequantize(q2[u], s2[u], torch.float32)
    ids = topk_ids.cpu().clone().apply_(lambda e: remap[e]).to(topk_ids.device)
    return moe_experts_ref(x, w13, w2, ids, topk_w, activation)


# ---- one MXFP4 matrix (or one per row) times activations: y = W x, FMA form for M ≤ 4 ----------------------
@triton.jit
def _mx_gemv_kernel(x_ptr, q_ptr, s_ptr, ids_ptr, y_ptr, R, KB, stride_xm, stride_ym,
                    HAS_IDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr, BPG: tl.constexpr):
    pid_r, m = tl.program_id(0), tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    rows = offs_r.to(tl.int64)
    if HAS_IDS:  # this row's expert
        rows += tl.load(ids_ptr + m).to(tl.int64) * R
    KG = KB // BPG
    offs_k = tl.arange(0, BLOCK_KB)
    acc = tl.zeros([BLOCK_R, BLOCK_KB], tl.float32)
    for kb0 in range(0, KB, BLOCK_KB):
        k = kb0 + offs_k
        k_ok = k < KB
        xe = tl.load(x_ptr + m * stride_xm + 2 * k, mask=k_ok, other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + m * stride_xm + 2 * k + 1, mask=k_ok, other=0.0).to(tl.float32)
        lo, hi = _tile(q_ptr, s_ptr, rows, r_ok, kb0, KB, KG, BLOCK_R, BLOCK_KB, BPG)
        acc += lo * xe[None, :] + hi * xo[None, :]
    tl.store(y_ptr + m * stride_ym + offs_r, tl.sum(acc, axis=1), mask=r_ok)


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
    _mx_gemv_kernel[(triton.cdiv(R, GEMV_BLOCK_R), M)](
        x, packed, scale, ids_arg, out, R, C2, x.stride(0), out.stride(0),
        HAS_IDS=ids is not None, BLOCK_R=GEMV_BLOCK_R, BLOCK_KB=max(BPG, min(GEMV_BLOCK_KB, _pow2(C2))), BPG=BPG)
    return out
