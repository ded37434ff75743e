"""The DFlash / DSpark drafter's block attention over its paged context (speculative/dflash.py), split-K.

A drafter block's Bk query tokens attend to every fed position of their sequence (the keys and values the target's
forwards wrote at each token's cache slot: TapWriter.kv [layers, 2, slots, kv heads, hd]) and to their own block.
Gathered into a dense copy first, the context costs a copy of the keys and values per layer and step (5.4 GB at
B = 8 and 32K for a 5-layer, 8 x 128 kv-head drafter) and one graph per context bucket. Here one program per
(sequence, kv head, split) reads its share of the context straight from the slots, with the g query heads of that
kv head and the Bk tokens as the rows of one tile (g · Bk rows: 64 for 4 x 16), and leaves an unnormalised partial
(acc, running max, sum); block_attention merges the splits with the own block's partial (small, in torch). The
splits cover whatever length each sequence has at run time, so one CUDA graph serves every length.

Reference: block_attention_ref, the same attention in FP64 over a gathered context.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import interpreting

LOG2E = 1.4426950408889634
BLOCK_N = 32        # context positions a loop step: 32 x 128 BF16 keys + values = 16 KB a step
TARGET_PROGRAMS = 264  # ~2 per SM on H100 / H200: the split count fills the GPU at B x kv heads programs
MAX_SPLITS = 64     # more partials cost the merge more than they add in parallel reads
INTERPRETER_SPLITS = 2  # the CPU interpreter pays per program, not per byte: few splits there
EMPTY = tl.constexpr(-1.0e30)  # a split with no positions: its max, finite so the merge's exp2 gives exactly 0


@triton.jit
def _ctx_attn_kernel(q_ptr, kv_ptr, tab_ptr, len_ptr, acc_ptr, m_ptr, l_ptr,
                     s_qb, s_qt, s_qk, s_qg, s_kvs, s_kvh, kv_off, v_off, s_tb, scale_log2, R, G, S,
                     BS: tl.constexpr, HD: tl.constexpr, RP: tl.constexpr, BLOCK: tl.constexpr,
                     DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    n = tl.load(len_ptr + b)
    per = tl.cdiv(tl.cdiv(n, S), BLOCK) * BLOCK  # this split's share, whole loop steps
    lo = sp * per
    hi = tl.minimum(lo + per, n)
    r = tl.arange(0, RP)
    d = tl.arange(0, HD)
    rok = r < R
    t, j = r // G, r % G  # row r: block token t, query head j of this kv head
    q = tl.load(q_ptr + b * s_qb + t[:, None] * s_qt + h * s_qk + j[:, None] * s_qg + d[None, :],
                mask=rok[:, None], other=0.0)
    kbase = kv_ptr + kv_off + h * s_kvh
    m_i = tl.full([RP], EMPTY, tl.float32)
    l_i = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, HD], tl.float32)
    for start in range(lo, hi, BLOCK):
        pos = start + tl.arange(0, BLOCK)
        pok = pos < hi
        blk = tl.load(tab_ptr + b * s_tb + pos // BS, mask=pok, other=0)
        slot = (blk * BS + pos % BS).to(tl.int64)
        k = tl.load(kbase + slot[:, None] * s_kvs + d[None, :], mask=pok[:, None], other=0.0)
        v = tl.load(kbase + v_off + slot[:, None] * s_kvs + d[None, :], mask=pok[:, None], other=0.0)
        if DOT_F32:  # the interpreter's BF16 dot is wrong (numpy has no BF16): widen there
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q.to(k.dtype), tl.trans(k)) * scale_log2  # [RP, BLOCK], log2 units
        s = tl.where(pok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = ((b * tl.num_programs(1) + h) * S + sp) * RP
    tl.store(acc_ptr + (o + r)[:, None] * HD + d[None, :], acc)
    tl.store(m_ptr + o + r, m_i)
    tl.store(l_ptr + o + r, l_i)


def splits_for(B: int, kv_heads: int) -> int:
    """Context splits a (sequence, kv head): enough programs to fill the GPU, at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // (B * kv_heads))))


def supported(head_dim: int, kv_dtype: torch.dtype) -> str | None:
    """Why this kernel cannot take a drafter of this head size and context dtype (None: it can)."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 16"
    if kv_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"kv dtype {kv_dtype}"
    return None


def block_attention(q, k_own, v_own, kv, layer: int, tables, lens, block_size: int, splits: int | None = None):
    """q [B, Bk, kv heads, g, hd] (FP32, RoPE'd); the block's own k_own, v_own [B, Bk, kv heads, hd]; the paged
    context kv [layers, 2, slots, kv heads, hd] read at `layer` through tables [B, blocks] for lens [B] positions
    -> o [B, Bk, kv heads, g, hd] FP32: softmax(q·K / sqrt(hd)) V over the context and the whole own block."""
    B, Bk, KVH, G, HD = q.shape
    S = splits or (min(INTERPRETER_SPLITS, splits_for(B, KVH)) if interpreting() else splits_for(B, KVH))
    R = Bk * G
    RP = max(16, triton.next_power_of_2(R))
    scale_log2 = LOG2E / math.sqrt(HD)
    q = q.contiguous()
    acc = torch.empty(B, KVH, S, RP, HD, dtype=torch.float32, device=q.device)
    m = torch.empty(B, KVH, S, RP, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    _ctx_attn_kernel[(B, KVH, S)](
        q, kv, tables, lens, acc, m, l, q.stride(0), q.stride(1), q.stride(2), q.stride(3),
        kv.stride(2), kv.stride(3), layer * kv.stride(0), kv.stride(1), tables.stride(0), scale_log2, R, G, S,
        BS=block_size, HD=HD, RP=RP, BLOCK=BLOCK_N, DOT_F32=interpreting() or kv.dtype == torch.float32, num_warps=4)
    # the own block's partial, rows in the kernel's order (token t, head j -> t·g + j)
    so = torch.einsum("bqkgd,blkd->bkqgl", q, k_own.float()).reshape(B, KVH, R, Bk) * scale_log2
    m_own = so.amax(-1)
    p_own = torch.exp2(so - m_own[..., None])
    acc_own = torch.einsum("bkrl,blkd->bkrd", p_own, v_own.float())
    m, l, acc = m[..., :R], l[..., :R], acc[..., :R, :]
    M = torch.maximum(m.amax(2), m_own)  # [B, KVH, R]
    w = torch.exp2(m - M[:, :, None])
    w_own = torch.exp2(m_own - M)
    num = (w[..., None] * acc).sum(2) + w_own[..., None] * acc_own
    den = (w * l).sum(2) + w_own * p_own.sum(-1)
    o = num / den[..., None]  # [B, KVH, R, HD]
    return o.view(B, KVH, Bk, G, HD).permute(0, 2, 1, 3, 4)


def block_attention_ref(q, k_own, v_own, kv, layer: int, tables, lens, block_size: int):
    """block_attention in FP64 over each sequence's gathered context, one sequence at a time."""
    B, Bk, KVH, G, HD = q.shape
    out = torch.empty(B, Bk, KVH, G, HD, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        pos = torch.arange(n)
        slots = tables[b].cpu()[pos // block_size] * block_size + pos % block_size
        K = torch.cat([kv[layer, 0, slots.to(kv.device)].double().cpu(), k_own[b].double().cpu()])  # [n + Bk, KVH, HD]
        V = torch.cat([kv[layer, 1, slots.to(kv.device)].double().cpu(), v_own[b].double().cpu()])
        s = torch.einsum("qkgd,lkd->qkgl", q[b].double().cpu(), K) / math.sqrt(HD)
        out[b] = torch.einsum("qkgl,lkd->qkgd", s.softmax(-1), V)
    return out


def compile_check() -> list[dict]:
    """The kernel compiled ahead of time for sm_90a (no GPU needed): ptxas's registers and spills, at the 48B
    drafter's heads (4 x 16 rows, hd 128) and the tiny drafter's (2 x 8, hd 64), BF16 keys and values."""
    from ..bench.kernels_moe import compile_sm90
    p, n, c, f = (lambda t: (t, 0)), (lambda v: ("i32", v)), (lambda v: ("constexpr", v)), (lambda v: ("fp32", v))
    out = []
    for G, Bk, HD in ((4, 16, 128), (2, 8, 64)):
        RP = max(16, triton.next_power_of_2(G * Bk))
        args = dict(q_ptr=p("*fp32"), kv_ptr=p("*bf16"), tab_ptr=p("*i64"), len_ptr=p("*i64"), acc_ptr=p("*fp32"),
                    m_ptr=p("*fp32"), l_ptr=p("*fp32"), s_qb=n(Bk * 8 * G * HD), s_qt=n(8 * G * HD), s_qk=n(G * HD),
                    s_qg=n(HD), s_kvs=n(8 * HD), s_kvh=n(HD), kv_off=n(0), v_off=n(1 << 20), s_tb=n(64),
                    scale_log2=f(0.1), R=n(G * Bk), G=n(G), S=n(8), BS=c(16), HD=c(HD), RP=c(RP), BLOCK=c(BLOCK_N),
                    DOT_F32=c(False))
        out.append({"kernel": f"ctx_attn g={G} Bk={Bk} hd={HD}"} | compile_sm90(_ctx_attn_kernel, args, 4, 2))
    return out
