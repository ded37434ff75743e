"""MXFP4 routed experts, "v4": decoded weights stored to shared memory with 16-byte writes and wgmma reading both
operands from shared memory (Gluon, Hopper), over the load-time repack of kernels/mxfp4_repack.py.

Why (results/2026-12-04-session21): v3 feeds its decoded weights to wgmma from registers and reaches 24-28 % of
copy bandwidth; its probe that fed the same bytes from shared memory reached 73-98 %. Triton's compiler routes a
computed left operand through registers, and stored a computed right operand with 2-byte writes (asm_t, 10-14 %),
so v4 is written in Gluon (Triton's lower-level dialect: explicit layouts, shared memory, cp.async, wgmma), where
the decode's register layout and the shared-memory tile are chosen, not inferred.

Per program (one expert's tile of weight rows; kernels/moe.py's schedule: the first assignment of an expert
serves every token that chose it, so each expert streams once per step for the union of the rows routed to it):
- a ring of STAGES cp.async copies runs ahead: codes [M, BK/2 bytes] (16 bytes a copy), the repack's group-major
  scales [BK/32, M] (contiguous, 16 bytes a copy) and the activations [T, BK] BF16;
- each K step reads its stage's codes from shared memory, one 32-bit word (8 values) a thread, decodes it with
  the repack's shift and masks (DECODE_ASM: four BF16x2 registers, no byte permutes) and writes the 8 values as one
  16-byte store into a 128-byte-swizzled tile, double-buffered so the next decode overlaps the running MMA;
- wgmma: acc [M rows, T tokens] += W [M, BK] · X^T [BK, T] (swap-AB: the tokens are the MMA's N, 8..64), both
  operands from shared memory, one MMA kept in flight.
Up stacks a tile's gate rows over its up rows (M = 2·BLOCK_I, one MMA a step) and writes act(gate, up) as BF16
h [B, k, I] (the standard path rounds the activations to BF16 too); down writes FP32 partials [B, k, Dz] and
kernels/moe.py's moe_combine sums them in a fixed order. The interpreter runs the portable form (_portable_kernel
below: the same layout and decode arithmetic in plain Triton, FP32 tl.dot); BF16 activations on Hopper run Gluon.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                               warpgroup_mma_wait)

from . import mxfp4_format
from .moe import ACTIVATIONS, SITU_BETA, SITU_LINEAR_BETA, _pow2, act_ref, moe_combine

GROUP = mxfp4_format.GROUP        # values per E8M0 scale
E8M0_NAN = mxfp4_format.E8M0_NAN  # the scale code that means NaN
WORD_VALUES = 8                   # E2M1 codes per 32-bit word
MIN_TOKENS = 8                    # wgmma's N is a multiple of 8
MAX_TOKENS = 64                   # verify steps up to 64 rows an expert; more take v3
# BK: values per K step (>= 64: 128 bytes of BF16 a row, the 128-byte swizzle); BLOCK_I / BLOCK_D weight rows a
# program (up stacks gate and up: M = 2·BLOCK_I); STAGES: cp.async ring depth; WARPS: 4 (one warpgroup) or 8.
# Not yet measured: up to 8 tokens BK = 128 (SMALL_B) because its sm_90a loop issues fewer instructions a weight
# byte (up, folded scales: 0.22 warp-instructions against 0.28 at BK = 64; the SM issues 4 a cycle and HBM brings
# it ~18 bytes, so above ~0.22 the issue rate, not the bandwidth, is the limit); from 16 tokens BK = 64, where
# BK = 128 makes ptxas serialize the wgmmas (C7515) at some shapes. bench kernels_moe_mxfp4 --v4 sweeps the rest.
DEFAULTS = {"BLOCK_I": 64, "BLOCK_D": 128, "BK": 64, "STAGES": 6, "WARPS": 4}
# the fastest of bench kernels_moe_mxfp4 --v4's sweep on k3-slice (H100, results/2026-12-05-session27): one token
# two warpgroups on 128 / 256-row tiles, 2..8 tokens BK 64 with 4 stages
ONE_TOKEN = {"BLOCK_I": 128, "BLOCK_D": 256, "BK": 64, "STAGES": 4, "WARPS": 8}
SMALL_B = {"BK": 64, "STAGES": 4}  # at most 8 tokens (one wgmma N of 8)
MIN_BLOCK_I = 64  # one warpgroup's gate / up split in registers needs two rows a thread
KEYS = tuple(DEFAULTS)

# One repacked word (register $4) and its group's scale as BF16x2 ($5) -> four BF16x2 registers $0..$3, register
# j = elements (2j, 2j+1), whose codes sit at bits 4j..4j+3 of each 16-bit half. A nibble n (s e1 e0 m) at bits
# 3..0 times 0x1040 is n << 6 | n << 12 (disjoint), masked by 0x81C0 it keeps s at bit 15 and e1 e0 m at bits 8..6:
# the BF16 bits of the code's value times 2^-126 (E2M1's e = 0 lands on BF16 subnormals, which is what it means);
# a nibble at bits 7..4 takes 0x0104 (n << 2 | n << 8) to the same place, so pairs 0 and 1 are read in place and
# pairs 2 and 3 after one shift of the word by 8. A BF16x2 multiply by 2^126 makes the pair exact, one by the scale
# applies it (NaN for E8M0 255): 5 instructions a pair, 4 with FOLD, plus one shift a word.
BF16X2_2_126 = 0x7E807E80
_PAIR = "and.b32 t, {src}, {mask};\nmul.lo.u32 t, t, {mul};\nand.b32 t, t, 0x81C081C0;\n{bias}mul.rn.bf16x2 ${j}, t, $5;\n"


def _decode_asm(fold: bool) -> str:
    bias = "" if fold else "mul.rn.bf16x2 t, t, bias;\n"
    pairs = [_PAIR.format(j=j, src="$4" if j < 2 else "u", mask="0x00F000F0" if j % 2 else "0x000F000F",
                          mul="0x0104" if j % 2 else "0x1040", bias=bias) for j in range(4)]
    head = "{\n.reg .b32 t, u" + ("" if fold else ", bias") + ";\n" + ("" if fold else f"mov.b32 bias, {BF16X2_2_126:#x};\n")
    return head + pairs[0] + pairs[1] + "shr.b32 u, $4, 8;\n" + pairs[2] + pairs[3] + "}"


DECODE_ASM = _decode_asm(False)
# FOLD: $5 is 2^126 times the scale, 2^(s-1), one multiply a pair fewer. BF16 holds it for s <= 128 (a scale of at
# most 2, |w| <= 12: every real checkpoint); fold_scales() checks a weight set once, at load.
FOLD_MAX_SCALE = 128
DECODE_ASM_FOLDED = _decode_asm(True)
# PROBE (the benchmark's, wrong values, never a default): the decode replaced by 4 moves, so the rest of the kernel
# (ring, stores, barriers, wgmma) is timed alone: what the decode costs is the difference
PROBE_ASM = "mov.b32 $0, $4;\nmov.b32 $1, $5;\nmov.b32 $2, $4;\nmov.b32 $3, $5;"


# the constants above as the Gluon kernels read them
G_C, WV_C, NAN_C = gl.constexpr(GROUP), gl.constexpr(WORD_VALUES), gl.constexpr(E8M0_NAN)
ASM_C, ASM_FOLDED_C, PROBE_C = gl.constexpr(DECODE_ASM), gl.constexpr(DECODE_ASM_FOLDED), gl.constexpr(PROBE_ASM)


@gluon.jit
def _routing(ids_ptr, n, B, NK, TOP_K: gl.constexpr, T_PAD: gl.constexpr, K_PAD: gl.constexpr,
             N_PAD: gl.constexpr, L2: gl.constexpr):
    """(first use of assignment n's expert, the expert, per padded token: chose it / its slot) in L2's row slice."""
    e = gl.load(ids_ptr + n)
    offs_n = gl.arange(0, N_PAD, layout=gl.SliceLayout(0, L2))
    all_ids = gl.load(ids_ptr + offs_n, mask=offs_n < NK, other=-1)
    first = gl.sum(((all_ids == e) & (offs_n < n)).to(gl.int32), axis=0) == 0
    offs_t = gl.arange(0, T_PAD, layout=gl.SliceLayout(1, L2))
    offs_s = gl.arange(0, K_PAD, layout=gl.SliceLayout(0, L2))
    match = gl.load(ids_ptr + offs_t[:, None] * TOP_K + offs_s[None, :],
                    mask=(offs_t[:, None] < B) & (offs_s[None, :] < TOP_K), other=-1) == e
    chose = gl.sum(match.to(gl.int32), axis=1) > 0
    slot = gl.sum(gl.where(match, offs_s[None, :], 0), axis=1)
    return first, e, chose, slot


@gluon.jit
def _rows(r0, m, R, HM: gl.constexpr, HALVES: gl.constexpr):
    """Tile row m -> (the expert's local row, valid): m < HM is row r0 + m of the first block, up's second block
    (HALVES = 2) the same row of the up half, R / 2 rows further."""
    local = r0 + m % HM
    return local + (m // HM) * (R // 2), local < R // HALVES


@gluon.jit
def _issue(qe, se, r0, R, KG, k0, k_ok, q_slot, s_slot, x_slot, x_ptrs, x_ok, HM: gl.constexpr, HALVES: gl.constexpr,
           BK: gl.constexpr, LQ: gl.constexpr, LS: gl.constexpr):
    """cp.async one ring slot, the K step at value k0, as one commit group: codes [M, BK/32, 8] int16 of the
    tile's rows (both blocks of up's stacked tile), scales [BK/32, M] uint8, activations [T, BK]. A step past the
    end (k_ok false) copies nothing (its zero fill lands in a free slot): masks, not branches, because a branch
    around the copies makes ptxas serialize every wgmma (C7515, checked by the sm_90a compile test)."""
    NG: gl.constexpr = BK // G_C
    I16: gl.constexpr = G_C // 4  # int16 halves of a group's 4 words
    M: gl.constexpr = HM * HALVES
    r, ok = _rows(r0, gl.arange(0, M, layout=gl.SliceLayout(1, gl.SliceLayout(2, LQ))), R, HM, HALVES)
    g = gl.arange(0, NG, layout=gl.SliceLayout(0, gl.SliceLayout(2, LQ)))
    h = gl.arange(0, I16, layout=gl.SliceLayout(0, gl.SliceLayout(1, LQ)))
    qp = qe.to(gl.pointer_type(gl.int16)) + r[:, None, None].to(gl.int64) * (KG * I16) \
        + (k0 // G_C + g)[None, :, None] * I16 + h[None, None, :]
    async_copy.async_copy_global_to_shared(q_slot, qp, mask=(ok & k_ok)[:, None, None])
    rs, oks = _rows(r0, gl.arange(0, M, layout=gl.SliceLayout(0, LS)), R, HM, HALVES)
    gs = k0 // G_C + gl.arange(0, NG, layout=gl.SliceLayout(1, LS))
    async_copy.async_copy_global_to_shared(s_slot, se + gs[:, None] * R + rs[None, :], mask=(oks & k_ok)[None, :])
    async_copy.async_copy_global_to_shared(x_slot, x_ptrs + k0, mask=x_ok & k_ok)
    async_copy.commit_group()


@gluon.jit
def _decode(q_src, s_src, a_dst, HM: gl.constexpr, BK: gl.constexpr, L3: gl.constexpr, FOLD: gl.constexpr,
            PROBE: gl.constexpr):
    """Codes [HM, BK/32, 8] int16 + scales [BK/32, HM] in shared memory -> BF16 [HM, BK] into a_dst (NVMMA)."""
    NG: gl.constexpr = BK // G_C
    half = q_src.load(L3)                                            # [HM, NG, 8]: 4 words a group, 2 halves each
    s = s_src.permute((1, 0)).load(gl.SliceLayout(2, L3)).to(gl.int32)  # [HM, NG]
    if FOLD:  # 2^(s-1) = 2^126 · 2^(s-127) as BF16 bits (s <= 128); s = 0 reads as 0
        bits = gl.where(s == NAN_C, 0x7FC0, gl.where(s == 0, 0, (s + 126) << 7))
    else:     # 2^(s-127) as BF16 bits; s = 0 reads as 0
        bits = gl.where(s == NAN_C, 0x7FC0, s << 7)
    sc = gl.broadcast(bits.to(gl.int16)[:, :, None], half)[0]         # both halves of the BF16x2 register
    o0, o1, o2, o3 = gl.inline_asm_elementwise(PROBE_C if PROBE else (ASM_FOLDED_C if FOLD else ASM_C), "=r,=r,=r,=r,r,r",
                                               [half, sc.to(gl.bfloat16, bitcast=True)],
                                               dtype=(gl.bfloat16,) * 4, is_pure=True, pack=2)
    # o_j[r, g, 2u + l] = element 32g + 8u + 2j + l, j = 2hi + lo: order (g, u, hi, lo, l) along K
    v = gl.join(gl.join(o0, o1), gl.join(o2, o3))                    # [HM, NG, 8, 2(lo), 2(hi)]
    v = gl.reshape(v, [HM, NG, 4, 2, 2, 2])                          # [r, g, u, l, lo, hi]
    v = gl.permute(v, (0, 1, 2, 5, 4, 3))
    a_dst.store(gl.reshape(v, [HM, BK]))


@gluon.jit
def _mx4_kernel(x_ptr, q_ptr, s_ptr, ids_ptr, out_ptr, B, R, KG, N_OUT, x_row_stride,
                TOP_K: gl.constexpr, T_PAD: gl.constexpr, K_PAD: gl.constexpr, N_PAD: gl.constexpr,
                HM: gl.constexpr, HALVES: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, UP: gl.constexpr,
                FOLD: gl.constexpr, PROBE: gl.constexpr,
                ACT: gl.constexpr, BETA: gl.constexpr, BETA_L: gl.constexpr, num_warps: gl.constexpr):
    """One expert's weight tile times the tokens routed to it. UP: rows [i0, i0+HM) and [I+i0, ..) of w13 (I =
    R/2, HALVES = 2), x [B, Dz] -> h [B, k, I] BF16 = act(gate, up); else rows [d0, d0+HM) of w2, x = h [B, k, I]
    -> out [B, k, Dz] FP32. q_ptr / s_ptr: the whole stack [E, R, K/2] int8 codes / [E, K/32, R] scales."""
    M: gl.constexpr = HM * HALVES
    NG: gl.constexpr = BK // G_C
    L2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [num_warps, 1], [1, 0])
    n = gl.program_id(0)
    first, e, chose, slot = _routing(ids_ptr, n, B, B * TOP_K, TOP_K, T_PAD, K_PAD, N_PAD, L2)
    if first:
        K = KG * G_C
        qe = q_ptr + e.to(gl.int64) * R * (K // 2)
        se = s_ptr + e.to(gl.int64) * R * KG
        r0 = gl.program_id(1) * HM
        # layouts: cp.async of codes (16-byte copies), scales and activations; the decode's (a word a thread)
        LQ: gl.constexpr = gl.BlockedLayout([1, 1, 8], [32 // NG, NG, 1], [num_warps, 1, 1], [2, 1, 0])
        LS: gl.constexpr = gl.BlockedLayout([1, 16], [NG, 32 // NG], [1, num_warps], [1, 0])
        LX: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BK // 8), BK // 8], [num_warps, 1], [1, 0])
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [32 // NG, NG, 1], [num_warps, 1, 1], [2, 1, 0])  # a group a thread
        RING: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        RING_S: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        A_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * BK if 2 * BK <= 128 else 128,
                                                 element_bitwidth=16, rank=2)
        X_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * BK if 2 * BK <= 128 else 128,
                                                 element_bitwidth=16, rank=2)
        ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, T_PAD, 16])
        q_ring = gl.allocate_shared_memory(gl.int16, [STAGES, M, NG, 8], RING)
        s_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, NG, M], RING_S)
        x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, T_PAD, BK], X_L)
        a_buf = gl.allocate_shared_memory(gl.bfloat16, [2, M, BK], A_L)

        # the activation rows of the padded tokens (a token that did not choose e reads a valid row, never stored)
        t = gl.arange(0, T_PAD, layout=gl.SliceLayout(1, LX))
        t_chose = gl.convert_layout(chose, gl.SliceLayout(1, LX))
        t_slot = gl.convert_layout(slot, gl.SliceLayout(1, LX))
        t_safe = gl.minimum(t, B - 1)
        if UP:
            x_rows = x_ptr + t_safe.to(gl.int64) * x_row_stride
        else:
            x_rows = x_ptr + (t_safe * TOP_K + gl.where(t_chose, t_slot, 0)).to(gl.int64) * x_row_stride
        x_ptrs = x_rows[:, None] + gl.arange(0, BK, layout=gl.SliceLayout(0, LX))[None, :]
        x_ok = (t < B)[:, None]  # padding tokens: zero-filled, no traffic (their columns are never stored)

        n_k = KG // NG
        for s in gl.static_range(STAGES - 1):
            _issue(qe, se, r0, R, KG, s * BK, s < n_k, q_ring.index(s), s_ring.index(s), x_ring.index(s), x_ptrs,
                   x_ok, HM, HALVES, BK, LQ, LS)
        acc = gl.zeros([M, T_PAD], gl.float32, ACC_L)
        for it in range(n_k):
            slot_k = it % STAGES
            async_copy.wait_group(STAGES - 2)
            gl.thread_barrier()
            a = a_buf.index(it % 2)
            _decode(q_ring.index(slot_k), s_ring.index(slot_k), a, M, BK, L3, FOLD, PROBE)  # both row blocks at once
            fence_async_shared()
            gl.thread_barrier()
            acc = warpgroup_mma(a, x_ring.index(slot_k).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            nxt = it + STAGES - 1
            ns = nxt % STAGES
            _issue(qe, se, r0, R, KG, nxt * BK, nxt < n_k, q_ring.index(ns), s_ring.index(ns), x_ring.index(ns), x_ptrs,
                   x_ok, HM, HALVES, BK, LQ, LS)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        # epilogue through registers in a row-fastest layout (coalesced along the weight rows)
        LE: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [num_warps, 1], [0, 1])
        te = gl.arange(0, T_PAD, layout=gl.SliceLayout(0, LE))
        e_chose = gl.convert_layout(chose, gl.SliceLayout(0, LE))
        e_slot = gl.convert_layout(slot, gl.SliceLayout(0, LE))
        re = r0 + gl.arange(0, HM, layout=gl.SliceLayout(1, LE))
        dst = (te * TOP_K + e_slot).to(gl.int64)[None, :] * N_OUT + re[:, None]
        ok = e_chose[None, :] & (re < N_OUT)[:, None]
        if UP:  # gate rows over up rows
            if num_warps == 4:  # one warpgroup: the two row blocks are a register dimension, split in place
                g, u = gl.split(gl.permute(gl.reshape(acc, [2, HM, T_PAD]), (1, 2, 0)))
                g = gl.convert_layout(g, LE)
                u = gl.convert_layout(u, LE)
            else:  # two warpgroups hold one block each: through shared memory
                c_smem = gl.allocate_shared_memory(gl.float32, [M, T_PAD], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
                c_smem.store(acc)
                gl.thread_barrier()
                g = c_smem.slice(0, HM).load(LE)
                u = c_smem.slice(HM, HM).load(LE)
            if ACT == 0:
                hv = g / (1.0 + gl.exp(-g)) * u
            else:
                eg = gl.exp(-2.0 * gl.abs(g) / BETA)
                eu = gl.exp(-2.0 * gl.abs(u) / BETA_L)
                tg = gl.where(g < 0, -1.0, 1.0) * (1.0 - eg) / (1.0 + eg)
                tu = gl.where(u < 0, -1.0, 1.0) * (1.0 - eu) / (1.0 + eu)
                hv = BETA * tg / (1.0 + gl.exp(-g)) * (BETA_L * tu)
            gl.store(out_ptr + dst, hv.to(gl.bfloat16), mask=ok)
        else:
            gl.store(out_ptr + dst, gl.convert_layout(acc, LE), mask=ok)


def _config(config: dict | None, B: int) -> dict:
    c = {**DEFAULTS, **(ONE_TOKEN if B == 1 else SMALL_B if B <= MIN_TOKENS else {}), **(config or {})}
    assert c["BK"] in (32, 64, 128) and c["WARPS"] in (4, 8), c
    if c["WARPS"] == 4 and c["BLOCK_I"] < MIN_BLOCK_I:
        raise ValueError(f"BLOCK_I={c['BLOCK_I']} with one warpgroup: the gate / up split needs at least "
                         f"{MIN_BLOCK_I} rows (two values a thread)")
    return c


def _meta(B: int, k: int) -> dict:
    return dict(TOP_K=k, T_PAD=max(MIN_TOKENS, _pow2(B)), K_PAD=_pow2(k), N_PAD=_pow2(B * k))


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    """Asked once per device: the gate runs in every decode step."""
    return torch.cuda.get_device_capability(index)[0] == 9


def on_hopper(device: torch.device) -> bool:
    """Whether `device` is a Hopper GPU, the one these kernels are written for."""
    return device.type == "cuda" and _hopper(device.index if device.index is not None else torch.cuda.current_device())


def supports(x: torch.Tensor, Dz: int, I: int, B: int, config: dict | None = None) -> bool:
    """The Gluon kernels' gate: a Hopper GPU, BF16 activations, widths in whole K steps, at most 64 tokens."""
    c = _config(config, B)
    return (x.dtype == torch.bfloat16 and on_hopper(x.device)
            and Dz % c["BK"] == 0 and I % c["BK"] == 0 and I % 16 == 0 and Dz % 16 == 0 and B <= MAX_TOKENS)


def launch_up(x, q13, s13t, topk_ids, h, activation: str, config: dict | None = None, fold: bool = False) -> None:
    """h [B, k, I] BF16 = act(gate, up) of every (token, slot)'s expert; q13 [E, 2I, Dz/2] repacked codes,
    s13t [E, Dz/32, 2I] the repack's group-major scales."""
    B, Dz = x.shape
    two_i, k = q13.shape[1], topk_ids.shape[1]
    c = _config(config, B)
    _mx4_kernel[(B * k, triton.cdiv(two_i // 2, c["BLOCK_I"]))](
        x, q13, s13t, topk_ids, h, B, two_i, Dz // GROUP, two_i // 2, x.stride(0), HM=c["BLOCK_I"], HALVES=2,
        UP=True, ACT=ACTIVATIONS[activation], **_common(c, B, k, fold))


def launch_down(h, q2, s2t, topk_ids, part, config: dict | None = None, fold: bool = False) -> None:
    """part [B, k, Dz] FP32 = W2 of each (token, slot)'s expert times h [B, k, I] BF16."""
    B, k, I = h.shape
    Dz = q2.shape[1]
    c = _config(config, B)
    _mx4_kernel[(B * k, triton.cdiv(Dz, c["BLOCK_D"]))](
        h, q2, s2t, topk_ids, part, B, Dz, I // GROUP, Dz, I, HM=c["BLOCK_D"], HALVES=1, UP=False, ACT=0,
        **_common(c, B, k, fold))


def _common(c: dict, B: int, k: int, fold: bool = False) -> dict:
    return dict(BK=c["BK"], STAGES=c["STAGES"], BETA=SITU_BETA, BETA_L=SITU_LINEAR_BETA, num_warps=c["WARPS"],
                FOLD=fold, PROBE=int(c.get("PROBE", 0)), **_meta(B, k))


def fold_scales(*scales: torch.Tensor) -> bool:
    """Whether the decode may fold 2^126 into the scales (DECODE_ASM_FOLDED): every finite E8M0 scale <= 128.
    One host sync: call it once per weight set (at load), never in a step."""
    return all(bool(((s <= FOLD_MAX_SCALE) | (s == E8M0_NAN)).all()) for s in scales)


def moe_mxfp4_experts_v4(x, q13, s13t, q2, s2t, topk_ids, topk_w, *, activation: str = "swiglu",
                         out: torch.Tensor | None = None, config: dict | None = None, fold: bool = False) -> torch.Tensor:
    """kernels/moe_mxfp4.py's moe_mxfp4_experts over the repacked layout (Gluon on Hopper, else the portable form).
    fold: the weights passed fold_scales (the faster decode; the portable form ignores it)."""
    B, Dz = x.shape
    I, k = q13.shape[1] // 2, topk_ids.shape[1]
    out = torch.empty(B, Dz, dtype=x.dtype, device=x.device) if out is None else out
    part = torch.empty(B, k, Dz, dtype=torch.float32, device=x.device)
    if supports(x, Dz, I, B, config):
        h = torch.empty(B, k, I, dtype=torch.bfloat16, device=x.device)
        launch_up(x, q13, s13t, topk_ids, h, activation, config, fold)
        launch_down(h, q2, s2t, topk_ids, part, config, fold)
    else:
        portable(x, q13, s13t, q2, s2t, topk_ids, part, activation)
    return moe_combine(part.view(1, B * k, Dz), topk_w.float().contiguous(), out=out)


# ---- the portable form (the interpreter's, and FP32 activations): the same repacked layout and decode arithmetic
# in plain Triton, one matrix a launch, whole scale groups a step. Slot p of a word (element 2j + hi) sits at bit
# 4j + 16·hi; a code placed into FP16 bits as s<<15 | e<<10 | m<<9 is its value times 2^-14 (the FP16 analogue of
# DECODE_ASM's BF16 placement: FP32 cannot hold its 2^126 as a scale factor), the 2^14 folded into the scale.
FP16_CODE_SCALE = tl.constexpr(2.0 ** 14)
PORTABLE_BLOCK_R = 32  # weight rows a program (the interpreter's cost grows with programs, not rows)


@triton.jit
def _portable_kernel(x_ptr, q_ptr, s_ptr, ids_ptr, out_ptr, B, R, KG, N_OUT, row_off, x_row_stride,
                     TOP_K: tl.constexpr, T_PAD: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr,
                     BLOCK_R: tl.constexpr, GATHER_SLOT: tl.constexpr):
    """out[(t, slot), r] = sum_K W_e[row_off + r, K] x_t[K] in FP32 for every token t that chose e (out rows of
    N_OUT). GATHER_SLOT: x rows are h's (t, slot) rows (down), else the tokens' rows."""
    n = tl.program_id(0)
    e = tl.load(ids_ptr + n)
    offs_n = tl.arange(0, N_PAD)
    all_ids = tl.load(ids_ptr + offs_n, mask=offs_n < B * TOP_K, other=-1)
    if tl.sum(((all_ids == e) & (offs_n < n)).to(tl.int32), axis=0) == 0:
        offs_t = tl.arange(0, T_PAD)
        offs_s = tl.arange(0, K_PAD)
        match = tl.load(ids_ptr + offs_t[:, None] * TOP_K + offs_s[None, :],
                        mask=(offs_t[:, None] < B) & (offs_s[None, :] < TOP_K), other=-1) == e
        chose = tl.sum(match.to(tl.int32), axis=1) > 0
        slot = tl.sum(tl.where(match, offs_s[None, :], 0), axis=1)
        t_safe = tl.minimum(offs_t, B - 1)
        if GATHER_SLOT:
            xb = x_ptr + (t_safe * TOP_K + slot) * x_row_stride
        else:
            xb = x_ptr + t_safe * x_row_stride
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < N_OUT
        rows = e.to(tl.int64) * R + row_off + r
        offs_u = tl.arange(0, 4)                       # words of a group
        p = tl.arange(0, 8)                            # element 2j + hi of a word
        shift = 4 * (p // 2) + 16 * (p % 2)
        k_in_group = (8 * offs_u[:, None] + p[None, :]).reshape(32)
        acc = tl.zeros([BLOCK_R, T_PAD], tl.float32)
        for g in range(0, KG):
            s = tl.load(s_ptr + (e.to(tl.int64) * KG + g) * R + row_off + r, mask=r_ok, other=127).to(tl.int32)
            sc = tl.where(s == 255, float("nan"), (s << 23).to(tl.float32, bitcast=True) * FP16_CODE_SCALE)
            w = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (KG * 4) + g * 4 + offs_u[None, :],
                        mask=r_ok[:, None], other=0)
            nib = (w[:, :, None] >> shift[None, None, :]) & 0xF
            bits = ((nib & 0x7) << 9) | ((nib & 0x8) << 12)
            v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32).reshape(BLOCK_R, 32) * sc[:, None]
            xk = tl.load(xb[None, :] + (g * 32 + k_in_group)[:, None]).to(tl.float32)
            acc = tl.dot(v, xk, acc, input_precision="ieee")
        tl.store(out_ptr + (offs_t[None, :] * TOP_K + slot[None, :]).to(tl.int64) * N_OUT + r[:, None], acc,
                 mask=chose[None, :] & r_ok[:, None])


def portable(x, q13, s13t, q2, s2t, topk_ids, part, activation: str) -> None:
    """launch's portable form: gate and up (two launches), act rounded to x's dtype, down; part FP32 [B, k, Dz]."""
    B, Dz = x.shape
    I, k = q13.shape[1] // 2, topk_ids.shape[1]
    meta = dict(TOP_K=k, T_PAD=max(16, _pow2(B)), K_PAD=_pow2(k), N_PAD=_pow2(B * k), BLOCK_R=PORTABLE_BLOCK_R)
    gu = torch.empty(2, B, k, I, dtype=torch.float32, device=x.device)
    for half in range(2):
        _portable_kernel[(B * k, triton.cdiv(I, PORTABLE_BLOCK_R))](
            x, q13, s13t, topk_ids, gu[half], B, 2 * I, Dz // GROUP, I, half * I, x.stride(0), GATHER_SLOT=False,
            **meta)
    h = act_ref(gu[0], gu[1], activation).to(x.dtype).contiguous()
    _portable_kernel[(B * k, triton.cdiv(Dz, PORTABLE_BLOCK_R))](
        h, q2, s2t, topk_ids, part, B, Dz, I // GROUP, Dz, 0, I, GATHER_SLOT=True, **meta)
