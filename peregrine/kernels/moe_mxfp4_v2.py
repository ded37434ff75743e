"""MXFP4 routed experts, variant "v2": word decode + per-group scaling of FMA partial sums.

Same contract, layout and schedule as kernels/moe_mxfp4.py (v1: first assignment of an expert serves
every token that chose it; up writes act(gate, up) FP32 to h [B, k, I], down writes FP32 partials;
moe_combine sums over k). What changes is the inner loop, which v1 spends ~19 instructions per
weight value on (per-element nibble ops, f16->f32, scale multiply, ->bf16, shared-memory MMA staging):

- Codes are read as 32-bit words (8 codes). One shift/and/or sequence on a word yields two FP16 codes
  16 bits apart (an E2M1 code as FP16 bits s<<15 | e<<10 | m<<9 is its value times 2^-14, exactly),
  so a pair costs ~4 integer ops and the halves are read as FP16 with a bitcast, no conversion.
  Word lane j holds elements (J0[j], J0[j] + 4) of the word's 8 (low nibbles of bytes 0/2, high
  nibbles of 0/2, low of 1/3, high of 1/3), so activations are gathered in that order instead.
- No per-element scale: a thread owns whole 32-value groups (4 words = one 16-byte load), sums its
  code x activation products in FP32, and multiplies the group's sum once by its E8M0 scale
  (2^(s-127) · 2^14, NaN for s = 255, 0 for s = 0 as in v1): per value one f16->f32 and one FMA per
  padded token, no MMA operand staging. Tokens are padded to a power of two (not 16), so B = 1
  pays one FMA a value; this is the form for B ≤ 8 (an MMA form would win beyond).
FP32 math throughout: exact products, only the summation order differs from the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..models import mxfp4
from .moe import ACTIVATIONS, SITU_BETA, SITU_LINEAR_BETA, _first_use, _pow2, _token_slots
from .moe_mxfp4 import _act, _group_scales

WPG = mxfp4.GROUP // 8   # 32-bit words per scale group (8 codes a word)
# tiles: rows x scale groups per step; a step reads rows·groups·16 bytes per matrix
DEFAULTS = {"UP_BLOCK_I": 16, "UP_BLOCK_G": 16, "UP_WARPS": 8,     # 2 x 4 KB in flight (H200: best at B = 1, 2)
            "DOWN_BLOCK_D": 32, "DOWN_BLOCK_G": 8, "DOWN_WARPS": 4}  # 4 KB in flight
KEYS = tuple(DEFAULTS)


@triton.jit
def _pair(w, SH_EM: tl.constexpr, SH_S: tl.constexpr, M_EM: tl.constexpr, M_S: tl.constexpr):
    """Two FP16 codes (value · 2^-14) from one uint32 word: exponent+mantissa bits masked by M_EM and
    moved by SH_EM (negative = right), sign bits masked by M_S and moved left by SH_S; FP32 out."""
    if SH_EM >= 0:
        em = (w & M_EM) << SH_EM
    else:
        em = (w & M_EM) >> (-SH_EM)
    p = em | ((w & M_S) << SH_S)
    lo = (p & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (p >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _gsum(lo, hi, xp, xm, c0: tl.constexpr, ROUND_T: tl.constexpr):
    """Σ over a group's words of code x activation for word elements c0 and c0 + 4 -> [B_PAD, R, NG].
    ROUND_T: round the activations to this type first (h to BF16, as the standard path does)."""
    xa = tl.load(xp + c0, mask=xm, other=0.0)
    xb = tl.load(xp + c0 + 4, mask=xm, other=0.0)
    if ROUND_T is not None:
        xa, xb = xa.to(ROUND_T), xb.to(ROUND_T)
    xa, xb = xa.to(tl.float32), xb.to(tl.float32)
    return tl.sum(lo[None, :, :, :] * xa[:, None, :, :] + hi[None, :, :, :] * xb[:, None, :, :], axis=3)


@triton.jit
def _group_dots(q_ptr, s_ptr, rows, row_ok, xb, x_ok, g0, KG, ROUND_T: tl.constexpr,
                R: tl.constexpr, NG: tl.constexpr, WPG: tl.constexpr):
    """Scaled partial dots [B_PAD, R] of groups g0 .. g0+NG of `rows` (int64) with activations at
    xb [B_PAD] (pointers to element 0 of each token's row; x_ok [B_PAD] masks tokens)."""
    offs_g = g0 + tl.arange(0, NG)
    offs_w = tl.arange(0, WPG)
    g_ok = offs_g < KG
    word = tl.load(q_ptr.to(tl.pointer_type(tl.uint32)) + rows[:, None, None] * (KG * WPG)
                   + offs_g[None, :, None] * WPG + offs_w[None, None, :],
                   mask=row_ok[:, None, None] & g_ok[None, :, None], other=0)
    sc = _group_scales(s_ptr, rows, row_ok, offs_g, g_ok, KG)
    col = (offs_g[:, None] * WPG + offs_w[None, :]) * 8                          # element 0 of each word
    xp = xb[:, None, None] + col[None, :, :]
    xm = x_ok[:, None, None] & g_ok[None, :, None]
    # byte b of the word holds elements 2b (low nibble) and 2b+1 (high nibble); bytes 0/2 and 1/3 pair up
    lo, hi = _pair(word, 9, 12, 0x00070007, 0x00080008)     # low nibbles of bytes 0, 2: elements 0, 4
    d = _gsum(lo, hi, xp, xm, 0, ROUND_T)
    lo, hi = _pair(word, 5, 8, 0x00700070, 0x00800080)      # high nibbles of bytes 0, 2: elements 1, 5
    d += _gsum(lo, hi, xp, xm, 1, ROUND_T)
    lo, hi = _pair(word, 1, 4, 0x07000700, 0x08000800)      # low nibbles of bytes 1, 3: elements 2, 6
    d += _gsum(lo, hi, xp, xm, 2, ROUND_T)
    lo, hi = _pair(word, -3, 0, 0x70007000, 0x80008000)     # high nibbles of bytes 1, 3: elements 3, 7
    d += _gsum(lo, hi, xp, xm, 3, ROUND_T)
    return tl.sum(d * sc[None, :, :], axis=2)


@triton.jit
def _mx2_up_kernel(x_ptr, q_ptr, s_ptr, ids_ptr, h_ptr, B, KG, I, stride_xb,
                   TOP_K: tl.constexpr, B_PAD: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr,
                   BLOCK_I: tl.constexpr, BLOCK_G: tl.constexpr, WPG: tl.constexpr, ACT: tl.constexpr,
                   BETA: tl.constexpr, BETA_L: tl.constexpr):
    n = tl.program_id(0)
    e = tl.load(ids_ptr + n)
    if _first_use(ids_ptr, n, e, B * TOP_K, N_PAD):  # the first assignment of e serves every token that chose it
        chose, slot = _token_slots(ids_ptr, e, B, TOP_K, B_PAD, K_PAD)
        offs_b = tl.arange(0, B_PAD)
        offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        i_ok = offs_i < I
        g_rows = e.to(tl.int64) * 2 * I + offs_i.to(tl.int64)
        xb = x_ptr + offs_b * stride_xb
        acc_g = tl.zeros([B_PAD, BLOCK_I], tl.float32)
        acc_u = tl.zeros([B_PAD, BLOCK_I], tl.float32)
        for g0 in range(0, KG, BLOCK_G):
            acc_g += _group_dots(q_ptr, s_ptr, g_rows, i_ok, xb, chose, g0, KG, None, BLOCK_I, BLOCK_G, WPG)
            acc_u += _group_dots(q_ptr, s_ptr, g_rows + I, i_ok, xb, chose, g0, KG, None, BLOCK_I, BLOCK_G, WPG)
        h = _act(acc_g, acc_u, ACT, BETA, BETA_L)
        tl.store(h_ptr + (offs_b[:, None] * TOP_K + slot[:, None]) * I + offs_i[None, :], h,
                 mask=chose[:, None] & i_ok[None, :])


@triton.jit
def _mx2_down_kernel(h_ptr, q_ptr, s_ptr, ids_ptr, part_ptr, B, D, KG,
                     TOP_K: tl.constexpr, B_PAD: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, WPG: tl.constexpr, ACT_T: tl.constexpr):
    n = tl.program_id(0)
    e = tl.load(ids_ptr + n)
    if _first_use(ids_ptr, n, e, B * TOP_K, N_PAD):
        chose, slot = _token_slots(ids_ptr, e, B, TOP_K, B_PAD, K_PAD)
        offs_b = tl.arange(0, B_PAD)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        rows = e.to(tl.int64) * D + offs_d.to(tl.int64)
        hb = h_ptr + (offs_b * TOP_K + slot) * (KG * WPG * 8)
        acc = tl.zeros([B_PAD, BLOCK_D], tl.float32)
        for g0 in range(0, KG, BLOCK_G):
            acc += _group_dots(q_ptr, s_ptr, rows, d_ok, hb, chose, g0, KG, ACT_T, BLOCK_D, BLOCK_G, WPG)
        row = offs_b * TOP_K + slot
        tl.store(part_ptr + row[:, None] * D + offs_d[None, :], acc, mask=chose[:, None] & d_ok[None, :])


def launch(x, q13, s13, q2, s2, topk_ids, h, part, activation: str, act_t, config: dict | None = None) -> None:
    """Up then down kernels into h [B, k, I] and part [B, k, Dz] (FP32); shapes checked by the caller.
    act_t: the Triton type h is rounded to before the down projection."""
    B, Dz = x.shape
    E, two_i, _ = q13.shape
    I, k = two_i // 2, topk_ids.shape[1]
    assert all(t.data_ptr() % 4 == 0 for t in (q13, q2)), "v2 reads the packed codes as 32-bit words"
    c = {**DEFAULTS, **(config or {})}
    kg_up, kg_down = Dz // mxfp4.GROUP, I // mxfp4.GROUP
    meta = dict(TOP_K=k, B_PAD=_pow2(B), K_PAD=_pow2(k), N_PAD=_pow2(B * k), WPG=WPG)
    _mx2_up_kernel[(B * k, triton.cdiv(I, c["UP_BLOCK_I"]))](
        x, q13, s13, topk_ids, h, B, kg_up, I, x.stride(0), BLOCK_I=c["UP_BLOCK_I"],
        BLOCK_G=min(c["UP_BLOCK_G"], _pow2(kg_up)), ACT=ACTIVATIONS[activation], BETA=SITU_BETA,
        BETA_L=SITU_LINEAR_BETA, num_warps=c["UP_WARPS"], **meta)
    _mx2_down_kernel[(B * k, triton.cdiv(Dz, c["DOWN_BLOCK_D"]))](
        h, q2, s2, topk_ids, part, B, Dz, kg_down, BLOCK_D=c["DOWN_BLOCK_D"],
        BLOCK_G=min(c["DOWN_BLOCK_G"], _pow2(kg_down)), ACT_T=act_t, num_warps=c["DOWN_WARPS"], **meta)
