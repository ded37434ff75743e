"""MXFP4 routed experts, "v3": weights as the MMA's left operand (swap-AB) with a cheap decode.

The kernels behind kernels/moe_mxfp4.py's moe_mxfp4_experts (the one MXFP4 expert form: v1 and v2 were
removed, docs/experiments.md). Layout as kernels/mxfp4_format.py, schedule as kernels/moe.py: the first
assignment of an expert serves every token that chose it; up writes act(gate, up) FP32 to h [B, k, I],
down FP32 partials, moe_combine sums over k. v1 put the 16 padded tokens on the MMA's M side, so its
dequantized weights were the right operand and went through shared memory, at ~19 instructions per
value. v3 computes out^T [rows, tokens] = W [rows, K] · x^T [K, tokens]: the weights are the left
operand, which Hopper's MMA reads from registers, and the tokens (padded to 16) are the small right operand.

The decode (DECODE, a constexpr):
- "asm" (GPU): per 32-bit word of 4 packed bytes, two byte permutes spread bytes (0, 1) and (2, 3)
  16 bits apart, then per pair of nibbles and / multiply / and place sign and exponent+mantissa
  as BF16 bits (the code's value times 2^-126), one packed BF16x2 multiply by 2^126 makes it exact
  (E2M1's e = 0 lands on BF16 subnormals, which the multiply handles) and one by the group's scale:
  22 instructions per 8 values, no conversions (the form OpenAI's triton_kernels uses on Hopper,
  over the checkpoint's own nibble order instead of a re-packed layout).
- "dot_scaled" (GPU): Triton's tl.dot_scaled, which on Hopper upcasts E2M1 to BF16 in the compiler.
- "plain": the FP16-bits decode (_tile below) in portable Triton ops (the interpreter's form; the reference
  for both).
- "probe", "probe_bf16": measurement stand-ins with wrong values (below, _PROBE_ASM).
Measured on the H200 (results/2026-12-04-session21): the decode is not what limits v3. The probe, with the
decode replaced by 4 moves, runs within 3-8 % of asm at every B and tile (25-29 % of copy). The same bytes
and tiles fed to the MMA from shared memory (probe_bf16) reach 73 / 84 / 90 / 98 % at B = 1 / 2 / 4 / 8.
The limit is the register-operand path: shared memory -> registers -> wgmma with A in registers. Two
rewrites were correct and slower, and are in git history only (d43aa31, df993a5). asm_p decoded straight
into the MMA's register order (19-23 %). asm_t put the tokens on M and the decoded tile on the
shared-memory side, but stored it with 2-byte writes (10-14 %).
Low nibbles multiply the even activations and high nibbles the odd ones (two MMAs per step) so the
decoded tile is never interleaved; dot_scaled takes the packed bytes and the activations in order.
E8M0 255 makes its group NaN, 0 reads as 0.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import mxfp4_format
from .moe import ACTIVATIONS, MIN_DOT_ROWS, SITU_BETA, SITU_LINEAR_BETA, _dot_meta, _first_use, _pow2, _token_slots

GROUP = mxfp4_format.GROUP      # values per E8M0 scale
BPG = GROUP // 2                # packed bytes per scale group
E8M0_NAN = tl.constexpr(mxfp4_format.E8M0_NAN)  # the scale code that means NaN
REAL_DECODES = ("asm", "dot_scaled", "plain")
DECODES = REAL_DECODES + ("probe", "probe_bf16")  # the probes: bench --probe only, by config
DECODE_ENV = "PEREGRINE_MXFP4_V3_DECODE"  # overrides the GPU default decode (A/B runs of the decode step)
# tiles: weight rows x packed bytes per step; 64 rows fill one warpgroup MMA (M = 64 per 4 warps)
DEFAULTS = {"DECODE": "asm", "UP_BLOCK_I": 64, "UP_BLOCK_KB": 64, "UP_WARPS": 4, "UP_STAGES": 3,
            "DOWN_BLOCK_D": 64, "DOWN_BLOCK_KB": 64, "DOWN_WARPS": 4, "DOWN_STAGES": 3}
KEYS = tuple(DEFAULTS)
# H200, k3-slice shapes (results/2026-12-04-session20/call2-*-kernels-moe-mxfp4-v3sweep-7f77f8f.json): the fastest tiles per
# B, 128 rows x 32 bytes at 8 warps, 4 stages for B <= 4 (B = 1/2/4: 0.275 / 0.501 / 0.889 ms against DEFAULTS'
# 0.341 / 0.543 / 0.919), 64 x 32 at 4 warps for B = 8 (1.431 against 1.496); other B take DEFAULTS
_WIDE = {"UP_BLOCK_I": 128, "UP_BLOCK_KB": 32, "UP_WARPS": 8, "UP_STAGES": 4,
         "DOWN_BLOCK_D": 128, "DOWN_BLOCK_KB": 32, "DOWN_WARPS": 8, "DOWN_STAGES": 4}
BY_BATCH = {1: _WIDE, 2: _WIDE, 3: _WIDE, 4: _WIDE,
            8: {"UP_BLOCK_KB": 32, "UP_STAGES": 4, "DOWN_BLOCK_KB": 32, "DOWN_STAGES": 4}}

# One 32-bit word (4 packed bytes = 8 codes, element 2j in the low nibble of byte j) and the BF16x2 scale
# of its group -> 4 registers of BF16x2, register j = elements (2j, 2j+1). v = w >> 4 brings each high
# nibble to bits 3..0 of its byte; one byte permute (selector 0x0{4+j}0{j}) takes byte j of w and byte j of v
# into the two 16-bit halves, so both codes of the pair sit at bits 3..0 of their half (a stray nibble
# above). A nibble n (s e1 e0 m) times 0x1040 is n << 6 | n << 12 (disjoint bits); masked by 0x81C0 that keeps s at bit 15
# and e1 e0 m at bits 8..6: the BF16 bits of the code's value times 2^-126 (E2M1's e = 0 lands on BF16
# subnormals, which is what it means). A BF16x2 multiply by 2^126 makes the pair exact, one by the scale.
_PAIR = """prmt.b32 t, $4, v, 0x0{hi}0{j};
and.b32 t, t, 0x000F000F;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, bias;
mul.rn.bf16x2 ${j}, t, $5;
"""
_DECODE_ASM = tl.constexpr("{\n.reg .b32 v, t, bias;\nmov.b32 bias, 0x7E807E80;\nshr.b32 v, $4, 4;\n"
                           + "".join(_PAIR.format(j=j, hi=4 + j) for j in range(4)) + "}")
WPG = tl.constexpr(BPG // 4)     # 32-bit words per scale group
# Probes (bench kernels_moe_mxfp4 --probe only; wrong values, never a default): "probe" keeps asm's loads,
# layouts and MMAs with the 22-instruction decode replaced by 4 moves; "probe_bf16" feeds the tile's bytes as
# BF16 pairs straight to the MMA from shared memory (half the K). They tell the decode's cost (small) from
# the register-operand path's (what holds v3 back: results/2026-12-04-session21)
_PROBE_ASM = tl.constexpr("mov.b32 $0, $4;\nmov.b32 $1, $5;\nmov.b32 $2, $4;\nmov.b32 $3, $5;")


# ---- the FP16-bits decode ("plain", and mxfp4_gemv's): an E2M1 code (sign s, exponent e, mantissa m) placed
# into FP16 bits as s<<15 | e<<10 | m<<9 is exactly its value times 2^-14 (e = 0 lands on the FP16 subnormals,
# which is what E2M1's e = 0 means too), so a code costs a few integer ops and one conversion; the 2^14 is folded
# into the group's scale. Low nibbles multiply the even elements of the activation, high nibbles the odd ones,
# so the packed tile never needs to be interleaved.
FP16_CODE_SCALE = tl.constexpr(2.0 ** 14)  # an E2M1 code read as FP16 bits is its value times 2^-14


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
def _tile_asm(q_ptr, s_ptr, rows, row_ok, kb0, KB, KG, R: tl.constexpr, BLOCK_KB: tl.constexpr,
              BPG: tl.constexpr, WPG: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr = _DECODE_ASM):
    """Weights [R, 2·BLOCK_KB] BF16 (scaled, element order) of packed columns kb0.. of `rows` (int64):
    whole groups of 4 words (16-byte loads), one scale byte per group. The row stride in words is KG·WPG:
    KG is an argument (Triton specializes it divisible by 16), so the compiler can prove the rows 16-byte
    aligned and copy 16 bytes at a time (KB // 4 computed in the kernel loses that: 4-byte copies)."""
    NG: tl.constexpr = BLOCK_KB // BPG
    offs_g = kb0 // BPG + tl.arange(0, NG)
    offs_w = tl.arange(0, WPG)
    wp = q_ptr.to(tl.pointer_type(tl.uint32)) + rows[:, None, None] * (KG * WPG) + offs_g[None, :, None] * WPG \
        + offs_w[None, None, :]
    sp = s_ptr + rows[:, None] * KG + offs_g[None, :]
    if EVEN:  # whole tiles: no masks (their predicates cost more than the decode's multiplies)
        word = tl.load(wp)
        s = tl.load(sp)
    else:
        g_ok = offs_g < KG
        word = tl.load(wp, mask=row_ok[:, None, None] & g_ok[None, :, None], other=0)
        s = tl.load(sp, mask=row_ok[:, None] & g_ok[None, :], other=0)
    bits = tl.where(s == E8M0_NAN, 0x7FC0, s.to(tl.uint32) << 7)  # 2^(s-127) as BF16 bits; s = 0 gives +0
    sc = tl.broadcast_to(bits.to(tl.uint16)[:, :, None, None], [R, NG, WPG, 2])  # pack=2: one BF16x2 register
    # the word as two 16-bit halves: pack=2 hands the asm one 32-bit register per word, and each output's
    # element pair (2m, 2m+1) is one BF16x2 register
    half = tl.reshape(tl.join(word & 0xFFFF, word >> 16).to(tl.uint16), [R, NG, WPG, 2])
    o0, o1, o2, o3 = tl.inline_asm_elementwise(
        ASM, "=r,=r,=r,=r,r,r", [half, sc], dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2)
    # o_j[..., l] = element 2j + l of the word: order (j, l) within the word
    v = tl.permute(tl.join(tl.join(o0, o1), tl.join(o2, o3)), (0, 1, 2, 5, 4, 3))
    return tl.reshape(v, [R, 2 * BLOCK_KB])


@triton.jit
def _mma_step(acc, q_ptr, s_ptr, rows, row_ok, kb0, KB, KG, xe, xo,
              R: tl.constexpr, BLOCK_KB: tl.constexpr, BPG: tl.constexpr, DECODE: tl.constexpr,
              DOT_T: tl.constexpr, PREC: tl.constexpr, EVEN: tl.constexpr):
    """acc [R, T] += W[rows, packed kb0 ..] · activations: xe/xo [BLOCK_KB, T] the even/odd elements
    (asm, dot_scaled: xe [2·BLOCK_KB, T] all of them in order)."""
    if DECODE == "asm":
        w = _tile_asm(q_ptr, s_ptr, rows, row_ok, kb0, KB, KG, R, BLOCK_KB, BPG, WPG, EVEN)
        acc = tl.dot(w, xe, acc)
    elif DECODE == "probe":
        w = _tile_asm(q_ptr, s_ptr, rows, row_ok, kb0, KB, KG, R, BLOCK_KB, BPG, WPG, EVEN, _PROBE_ASM)
        acc = tl.dot(w, xe, acc)
    elif DECODE == "probe_bf16":  # A from a load: the MMA reads it from shared memory
        offs = kb0 // 2 + tl.arange(0, BLOCK_KB // 2)
        w = tl.load(q_ptr.to(tl.pointer_type(tl.bfloat16)) + rows[:, None] * (KB // 2) + offs[None, :])
        acc = tl.dot(w, xe, acc)
    elif DECODE == "dot_scaled":
        NG: tl.constexpr = BLOCK_KB // BPG
        offs_k = kb0 + tl.arange(0, BLOCK_KB)
        offs_g = kb0 // BPG + tl.arange(0, NG)
        wq = tl.load(q_ptr + rows[:, None] * KB + offs_k[None, :], mask=row_ok[:, None] & (offs_k < KB)[None, :],
                     other=0)
        ws = tl.load(s_ptr + rows[:, None] * KG + offs_g[None, :], mask=row_ok[:, None] & (offs_g < KG)[None, :],
                     other=0)
        acc = tl.dot_scaled(wq, ws, "e2m1", xe, None, "bf16", acc)
    else:
        lo, hi = _tile(q_ptr, s_ptr, rows, row_ok, kb0, KB, KG, R, BLOCK_KB, BPG)
        acc = tl.dot(lo.to(DOT_T), xe, acc, input_precision=PREC)
        acc = tl.dot(hi.to(DOT_T), xo, acc, input_precision=PREC)
    return acc


@triton.jit
def _acts(base, kb0, KB, ROUND_T: tl.constexpr, DOT_T: tl.constexpr, DECODE: tl.constexpr,
          BLOCK_KB: tl.constexpr, EVEN: tl.constexpr):
    """Activations of packed columns kb0 .. kb0+BLOCK_KB for tokens at row pointers base [T] (every one a
    valid row: a token column the program does not serve is computed and never stored, the MMA keeps
    columns apart): (even, odd) elements [BLOCK_KB, T], or for asm and dot_scaled all of them in order
    [2·BLOCK_KB, T] twice."""
    if DECODE != "plain":
        kk = 2 * kb0 + tl.arange(0, 2 * BLOCK_KB)
        if DECODE == "probe_bf16":  # half the K: the tile's bytes as BF16
            xe = tl.load(base[None, :] + (kb0 // 2 + tl.arange(0, BLOCK_KB // 2))[:, None])
        elif EVEN:
            xe = tl.load(base[None, :] + kk[:, None])
        else:
            xe = tl.load(base[None, :] + kk[:, None], mask=(kk < 2 * KB)[:, None], other=0.0)
        if ROUND_T is not None:
            xe = xe.to(ROUND_T)
        xe = xe.to(tl.bfloat16)
        xo = xe
    else:
        k = kb0 + tl.arange(0, BLOCK_KB)
        m = (k < KB)[:, None]
        xe = tl.load(base[None, :] + 2 * k[:, None], mask=m, other=0.0)
        xo = tl.load(base[None, :] + 2 * k[:, None] + 1, mask=m, other=0.0)
        if ROUND_T is not None:
            xe, xo = xe.to(ROUND_T), xo.to(ROUND_T)
        xe, xo = xe.to(DOT_T), xo.to(DOT_T)
    return xe, xo


@triton.jit
def _mx3_up_kernel(x_ptr, q_ptr, s_ptr, ids_ptr, h_ptr, B, KB, KG, I, stride_xb,
                   TOP_K: tl.constexpr, B_PAD: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr,
                   BLOCK_I: tl.constexpr, BLOCK_KB: tl.constexpr, BPG: tl.constexpr, ACT: tl.constexpr,
                   DECODE: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr, BETA: tl.constexpr,
                   BETA_L: tl.constexpr, STAGES: tl.constexpr, EVEN: tl.constexpr):
    n = tl.program_id(0)
    e = tl.load(ids_ptr + n)
    if _first_use(ids_ptr, n, e, B * TOP_K, N_PAD):  # the first assignment of e serves every token that chose it
        chose, slot = _token_slots(ids_ptr, e, B, TOP_K, B_PAD, K_PAD)
        offs_b = tl.arange(0, B_PAD)
        offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        i_ok = offs_i < I
        g_rows = e.to(tl.int64) * 2 * I + offs_i.to(tl.int64)
        xb = x_ptr + tl.minimum(offs_b, B - 1) * stride_xb  # padding tokens read token B-1's row
        acc_g = tl.zeros([BLOCK_I, B_PAD], tl.float32)
        acc_u = tl.zeros([BLOCK_I, B_PAD], tl.float32)
        for kb0 in tl.range(0, KB, BLOCK_KB, num_stages=STAGES):
            xe, xo = _acts(xb, kb0, KB, None, DOT_T, DECODE, BLOCK_KB, EVEN)
            acc_g = _mma_step(acc_g, q_ptr, s_ptr, g_rows, i_ok, kb0, KB, KG, xe, xo,
                              BLOCK_I, BLOCK_KB, BPG, DECODE, DOT_T, PREC, EVEN)
            acc_u = _mma_step(acc_u, q_ptr, s_ptr, g_rows + I, i_ok, kb0, KB, KG, xe, xo,
                              BLOCK_I, BLOCK_KB, BPG, DECODE, DOT_T, PREC, EVEN)
        h = _act(acc_g, acc_u, ACT, BETA, BETA_L)
        tl.store(h_ptr + (offs_b[None, :] * TOP_K + slot[None, :]) * I + offs_i[:, None], h,
                 mask=chose[None, :] & i_ok[:, None])


@triton.jit
def _mx3_down_kernel(h_ptr, q_ptr, s_ptr, ids_ptr, part_ptr, B, D, KB, KG,
                     TOP_K: tl.constexpr, B_PAD: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_KB: tl.constexpr, BPG: tl.constexpr, DECODE: tl.constexpr,
                     DOT_T: tl.constexpr, PREC: tl.constexpr, ACT_T: tl.constexpr, STAGES: tl.constexpr,
                     EVEN: tl.constexpr):
    n = tl.program_id(0)
    e = tl.load(ids_ptr + n)
    if _first_use(ids_ptr, n, e, B * TOP_K, N_PAD):
        chose, slot = _token_slots(ids_ptr, e, B, TOP_K, B_PAD, K_PAD)
        offs_b = tl.arange(0, B_PAD)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        rows = e.to(tl.int64) * D + offs_d.to(tl.int64)
        row = offs_b * TOP_K + slot
        hb = h_ptr + (tl.minimum(offs_b, B - 1) * TOP_K + slot) * (2 * KB)  # padding tokens: token B-1's row
        acc = tl.zeros([BLOCK_D, B_PAD], tl.float32)
        for kb0 in tl.range(0, KB, BLOCK_KB, num_stages=STAGES):
            # h rounds to BF16 (ACT_T) as the standard path's activations do
            he, ho = _acts(hb, kb0, KB, ACT_T, DOT_T, DECODE, BLOCK_KB, EVEN)
            acc = _mma_step(acc, q_ptr, s_ptr, rows, d_ok, kb0, KB, KG, he, ho,
                            BLOCK_D, BLOCK_KB, BPG, DECODE, DOT_T, PREC, EVEN)
        tl.store(part_ptr + row[None, :] * D + offs_d[:, None], acc, mask=chose[None, :] & d_ok[:, None])


def _setup(B: int, k: int, x_dtype, config: dict | None, is_cuda: bool):
    c = {**DEFAULTS, **BY_BATCH.get(B, {}), **(config or {})}
    source, allowed = "config DECODE", DECODES
    if "DECODE" not in (config or {}):
        if not is_cuda:
            c["DECODE"] = "plain"  # the interpreter runs no inline PTX
        elif os.environ.get(DECODE_ENV):  # a probe's wrong values must never reach a model
            c["DECODE"], source, allowed = os.environ[DECODE_ENV], DECODE_ENV, REAL_DECODES
    decode = c["DECODE"]
    if decode not in allowed:
        raise ValueError(f"MXFP4 v3 {source}={decode!r}: expected one of {', '.join(allowed)}")
    dot = _dot_meta(torch.float32 if x_dtype == torch.float32 else torch.bfloat16)
    if decode != "plain":
        assert is_cuda, f"decode {decode!r} needs the GPU; the interpreter runs 'plain'"
        dot = dict(DOT_T=tl.bfloat16, PREC="tf32")
    meta = dict(TOP_K=k, B_PAD=max(MIN_DOT_ROWS, _pow2(B)), K_PAD=_pow2(k), N_PAD=_pow2(B * k), BPG=BPG,
                DECODE=decode, **dot)
    return c, meta


def _tiles(rows: int, kb: int, block_r: int, block_kb: int) -> tuple[int, int, bool]:
    """Tiles never wider than the matrix (tiny test shapes): whole scale groups, at least 16 rows and
    16 packed bytes (32 values) for the MMA; EVEN when they divide it (no masks)."""
    br = max(MIN_DOT_ROWS, min(block_r, _pow2(rows)))
    bkb = max(BPG, min(block_kb, _pow2(kb)))
    return br, bkb, rows % br == 0 and kb % bkb == 0


def launch_up(x, q13, s13, topk_ids, h, activation: str, config: dict | None = None) -> None:
    """h [B, k, I] = act(gate, up) FP32 of every (token, slot)'s expert."""
    B, Dz = x.shape
    I, k = q13.shape[1] // 2, topk_ids.shape[1]
    c, meta = _setup(B, k, x.dtype, config, x.is_cuda)
    bi, bkb, even = _tiles(I, Dz // 2, c["UP_BLOCK_I"], c["UP_BLOCK_KB"])
    _mx3_up_kernel[(B * k, triton.cdiv(I, bi))](
        x, q13, s13, topk_ids, h, B, Dz // 2, Dz // 2 // BPG, I, x.stride(0), BLOCK_I=bi, BLOCK_KB=bkb,
        ACT=ACTIVATIONS[activation], BETA=SITU_BETA, BETA_L=SITU_LINEAR_BETA, STAGES=c["UP_STAGES"],
        EVEN=even, num_warps=c["UP_WARPS"], **meta)


def launch_down(h, q2, s2, topk_ids, part, act_t, config: dict | None = None, x_dtype=torch.bfloat16) -> None:
    """part [B, k, Dz] FP32 = W2 of each (token, slot)'s expert times h rounded to act_t."""
    B, k, I = h.shape
    Dz = q2.shape[1]
    c, meta = _setup(B, k, x_dtype, config, h.is_cuda)
    bd, bkb, even = _tiles(Dz, I // 2, c["DOWN_BLOCK_D"], c["DOWN_BLOCK_KB"])
    _mx3_down_kernel[(B * k, triton.cdiv(Dz, bd))](
        h, q2, s2, topk_ids, part, B, Dz, I // 2, I // 2 // BPG, BLOCK_D=bd, BLOCK_KB=bkb, ACT_T=act_t,
        STAGES=c["DOWN_STAGES"], EVEN=even, num_warps=c["DOWN_WARPS"], **meta)


def launch(x, q13, s13, q2, s2, topk_ids, h, part, activation: str, act_t, config: dict | None = None) -> None:
    """Up then down kernels into h [B, k, I] and part [B, k, Dz] (FP32); shapes checked by the caller."""
    launch_up(x, q13, s13, topk_ids, h, activation, config)
    launch_down(h, q2, s2, topk_ids, part, act_t, config, x.dtype)
