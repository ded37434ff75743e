"""MLA absorbed decode over the paged latent cache (MODELS.md "MLA layer, absorbed decode").

Given the absorbed query q̂ [B, H, L] (L = kv_lora + rope) and one layer's latent cache,
    s[h,t] = <q̂[h], entry[t]> · sm_scale,  p = softmax_{t < len},  o[h] = Σ_t p[h,t] · entry[t][:kv_lora].
The W_UK absorption before and the W_UV projection after are GEMMs outside this file.

Flash-decoding: grid (B, num_splits, head_groups). A program owns BLOCK_H heads of one
sequence and one contiguous token range, so each cache entry is read once per
(sequence, head group). A combine kernel merges the splits by log-sum-exp.

CUDA-graph friendliness: the grid depends only on static shapes — B, H and the block-table
capacity (max_blocks · block_size, the bound on the context) — never on context_lens.
Each sequence divides its *actual* length over the fixed number of splits at run time;
splits past its length exit at once and the combine reads only the active ones, so one
captured graph serves every context length up to the table's capacity. No atomics:
the result is deterministic. A sequence of length 0 yields zeros (padded graph rows).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import interpreting

LOG2E = 1.4426950408889634  # scores go through exp2: fold log2(e) into the scale once
MIN_DOT = 16                # smallest tl.dot dimension on the tensor cores
CPU_SMS = 8                 # pretend SM count off-GPU: keeps interpreter grids small
MAX_SPLITS = 256            # bounds the partial buffers and the combine loop
L_FLOOR = tl.constexpr(1e-30)  # softmax sums are >= 1 when any token exists; length 0 gives 0/floor = 0
COMBINE_BLOCK_C = 128       # latent channels per combine program: spreads the merge over many SMs
_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(frozen=True)
class MlaTiling:
    block_h: int = 32     # heads per program: all 32 of Kimi-Linear share one cache read
    block_n: int = 64     # tokens per inner step (a [64, 576] BF16 tile = 72 KB in flight)
    num_warps: int = 8    # 4 warps spill the [32, 512] FP32 accumulator (ptxas, sm_90)
    num_stages: int = 3   # cp.async pipelining of the gathered tiles
    # Fewest tokens per split: below this a split's FP32 partial (64 KB at H=32) costs more
    # than its share of the cache. Applied in the kernel too, so a long-capacity block table
    # (many splits) still gives a short sequence few, fuller splits.
    min_split_tokens: int = 128


# Chosen from ptxas -v on sm_90a (no spills); the benchmark sweeps alternatives on the GPU.
DEFAULT_TILING = MlaTiling()
FP8_TILING = MlaTiling(block_n=32)  # the FP8→BF16 converts need registers: 64 tokens spill
FP32_TILING = MlaTiling(block_n=32, num_stages=2)  # tests only: FP32 tiles would overflow shared memory


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SMS


def pick_num_splits(batch: int, num_heads: int, max_context: int, device, tiling: MlaTiling = DEFAULT_TILING) -> int:
    """Splits per sequence: enough programs to cover the SMs once, but no split under
    tiling.min_split_tokens of the bound. Depends only on static sizes (graph-safe)."""
    groups = triton.cdiv(num_heads, _block_h(num_heads, tiling))
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    want = triton.cdiv(_num_sms(dev), max(1, batch * groups))
    cap = triton.cdiv(max(1, max_context), tiling.min_split_tokens)
    return max(1, min(MAX_SPLITS, want, cap))


def _block_h(num_heads: int, tiling: MlaTiling) -> int:
    return max(MIN_DOT, min(tiling.block_h, triton.next_power_of_2(num_heads)))


@triton.jit
def _split_bounds(n, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr):
    # Each split gets a BLOCK_N-aligned share of this sequence's real length, at least MIN_CHUNK.
    chunk = tl.cdiv(tl.maximum(tl.cdiv(n, num_splits), MIN_CHUNK), BLOCK_N) * BLOCK_N
    n_active = tl.cdiv(n, tl.maximum(chunk, 1))
    return chunk, n_active


@triton.jit
def _mla_split_kernel(
    q_ptr, lat_ptr, scale_ptr, bt_ptr, len_ptr, part_ptr, lse_ptr, out_ptr,
    qk_scale, H, num_splits,
    s_qb, s_qh, s_lblk, s_ltok, s_sblk, s_stok, s_btb,
    s_pb, s_ps, s_ph, s_eb, s_es, s_ob, s_oh,
    C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, PAGE: tl.constexpr,
    FP8: tl.constexpr, DIRECT: tl.constexpr, PREC: tl.constexpr, CDT: tl.constexpr,
):
    b = tl.program_id(0)
    sp = tl.program_id(1)
    g = tl.program_id(2)
    n = tl.load(len_ptr + b)
    chunk, n_active = _split_bounds(n, num_splits, BLOCK_N, MIN_CHUNK)
    if DIRECT:
        n_active = tl.maximum(n_active, 1)  # a length-0 row still gets its zeros written
    if sp >= n_active:  # nothing of this sequence falls in this split
        return
    start = sp * chunk
    end = tl.minimum(start + chunk, n)

    heads = g * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = heads < H
    oc = tl.arange(0, BLOCK_C)
    cm = oc < C
    orr = tl.arange(0, BLOCK_R)
    rm = orr < R
    q_row = q_ptr + b.to(tl.int64) * s_qb + heads[:, None] * s_qh
    q_c = tl.load(q_row + oc[None, :], mask=hm[:, None] & cm[None, :], other=0.0).to(CDT)
    q_r = tl.load(q_row + C + orr[None, :], mask=hm[:, None] & rm[None, :], other=0.0).to(CDT)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * s_btb
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tm = t < end  # masked loads never touch entries past the context
        blk = tl.load(bt_row + t // PAGE, mask=tm, other=0).to(tl.int64)
        off = t % PAGE
        row = lat_ptr + blk * s_lblk + off * s_ltok
        kc = tl.load(row[:, None] + oc[None, :], mask=tm[:, None] & cm[None, :], other=0.0).to(CDT)
        kr = tl.load(row[:, None] + C + orr[None, :], mask=tm[:, None] & rm[None, :], other=0.0).to(CDT)
        s = tl.dot(q_c, tl.trans(kc), input_precision=PREC)
        s += tl.dot(q_r, tl.trans(kr), input_precision=PREC)
        if FP8:  # value = fp8 · scale: scale the score columns, not the tile
            sc = tl.load(scale_ptr + blk * s_sblk + off * s_stok, mask=tm, other=0.0)
            s = s * sc[None, :]
        s = tl.where(tm[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8:
            p = p * sc[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(CDT), kc, input_precision=PREC)
        m_i = m_new

    o = acc / tl.maximum(l_i, L_FLOOR)[:, None]
    om = hm[:, None] & cm[None, :]
    if DIRECT:  # one split: no combine, write the output itself
        out = out_ptr + b.to(tl.int64) * s_ob + heads[:, None] * s_oh + oc[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=om)
    else:
        part = part_ptr + b.to(tl.int64) * s_pb + sp * s_ps + heads[:, None] * s_ph + oc[None, :]
        tl.store(part, o, mask=om)
        tl.store(lse_ptr + b.to(tl.int64) * s_eb + sp * s_es + heads, m_i + tl.log2(l_i), mask=hm)


@triton.jit
def _mla_combine_kernel(
    part_ptr, lse_ptr, len_ptr, out_ptr, num_splits,
    s_pb, s_ps, s_ph, s_eb, s_es, s_ob, s_oh,
    C: tl.constexpr, BLOCK_CC: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    oc = tl.program_id(2) * BLOCK_CC + tl.arange(0, BLOCK_CC)
    cm = oc < C
    n = tl.load(len_ptr + b)
    chunk, n_active = _split_bounds(n, num_splits, BLOCK_N, MIN_CHUNK)
    m = float("-inf")
    l = 0.0
    acc = tl.zeros([BLOCK_CC], tl.float32)
    for sp in range(0, n_active):  # inactive splits were never written: never read them
        lse = tl.load(lse_ptr + b.to(tl.int64) * s_eb + sp * s_es + h)
        o = tl.load(part_ptr + b.to(tl.int64) * s_pb + sp * s_ps + h * s_ph + oc, mask=cm, other=0.0)
        m_new = tl.maximum(m, lse)
        a = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * a + o * w
        l = l * a + w
        m = m_new
    res = acc / tl.maximum(l, L_FLOOR)
    tl.store(out_ptr + b.to(tl.int64) * s_ob + h * s_oh + oc, res.to(out_ptr.dtype.element_ty), mask=cm)


def mla_decode(q, latent, scale, block_tables, context_lens, sm_scale, *, kv_lora_rank,
               num_splits=None, out=None, tiling: MlaTiling | None = None):
    """Attention of q [B, H, L] over the paged latent cache; returns o [B, H, kv_lora_rank] in q.dtype.

    latent [num_blocks, block_size, L] (model dtype or float8_e4m3fn), scale [num_blocks, block_size]
    FP32 when FP8 else None, block_tables [B, max_blocks] (int64/int32), context_lens [B] int32.
    num_splits=None picks pick_num_splits(B, H, max_blocks * block_size): fixed for a given
    (B, H, block-table capacity), so it is safe under CUDA-graph replay with changing lengths.
    """
    B, H, L = q.shape
    C = kv_lora_rank
    R = L - C
    nblk, page, L2 = latent.shape
    assert L2 == L and R >= 1, f"latent dim {L2} vs q {L} (kv_lora {C})"
    assert latent.stride(2) == 1 and q.stride(2) == 1, "last dims must be contiguous"
    fp8 = latent.dtype == torch.float8_e4m3fn
    t = tiling or (FP8_TILING if fp8 else FP32_TILING if latent.element_size() == 4 else DEFAULT_TILING)
    assert (scale is not None) == fp8, "scale is required exactly for an FP8 cache"
    assert block_tables.shape[0] == B and context_lens.shape[0] == B
    if out is None:
        out = torch.empty(B, H, C, dtype=q.dtype, device=q.device)
    assert out.shape == (B, H, C) and out.dtype == q.dtype and out.stride(2) == 1
    if B == 0:
        return out
    S = num_splits or pick_num_splits(B, H, block_tables.shape[1] * page, q.device, t)
    block_h = _block_h(H, t)
    block_c = max(MIN_DOT, triton.next_power_of_2(C))
    block_r = max(MIN_DOT, triton.next_power_of_2(R))
    direct = S == 1
    if direct:
        part = lse = out  # unused placeholders
        ps = es = (0, 0, 0)
    else:
        part = torch.empty(B, S, H, C, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, S, H, dtype=torch.float32, device=q.device)
        ps, es = part.stride()[:3], lse.stride()[:2]
    sc = scale if fp8 else latent  # placeholder pointer when not FP8
    s_sblk, s_stok = (scale.stride(0), scale.stride(1)) if fp8 else (0, 0)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"  # FP32 tests need exact FP32 dots
    # Dot operands in the model dtype with FP32 accumulation; FP32 under the interpreter,
    # whose BF16 tl.dot is wrong in triton 3.6 (returns garbage ~1e10).
    cdt = tl.float32 if interpreting() or q.dtype == torch.float32 else _TL_DTYPE[q.dtype]
    grid = (B, S, triton.cdiv(H, block_h))
    _mla_split_kernel[grid](
        q, latent, sc, block_tables, context_lens, part, lse, out,
        float(sm_scale) * LOG2E, H, S,
        q.stride(0), q.stride(1), latent.stride(0), latent.stride(1), s_sblk, s_stok, block_tables.stride(0),
        ps[0], ps[1], ps[2], es[0], es[1], out.stride(0), out.stride(1),
        C=C, R=R, BLOCK_C=block_c, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_N=t.block_n,
        MIN_CHUNK=t.min_split_tokens, PAGE=page, FP8=fp8, DIRECT=direct, PREC=prec, CDT=cdt,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    if not direct:
        cc = min(COMBINE_BLOCK_C, triton.next_power_of_2(C))
        _mla_combine_kernel[(B, H, triton.cdiv(C, cc))](
            part, lse, context_lens, out, S,
            ps[0], ps[1], ps[2], es[0], es[1], out.stride(0), out.stride(1),
            C=C, BLOCK_CC=cc, BLOCK_N=t.block_n, MIN_CHUNK=t.min_split_tokens, num_warps=1,
        )
    return out


def mla_decode_ref(q, latent, scale, block_tables, context_lens, sm_scale, *, kv_lora_rank):
    """FP32 reference: gather each sequence's entries, dequantise, softmax. Returns FP32 [B, H, C]."""
    B, H, L = q.shape
    page = latent.shape[1]
    out = torch.zeros(B, H, kv_lora_rank, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(context_lens[b])
        if n == 0:
            continue
        blocks = block_tables[b, : (n + page - 1) // page].long()
        ent = latent[blocks].reshape(-1, L)[:n].float()
        if scale is not None:
            ent = ent * scale[blocks].reshape(-1)[:n, None].float()
        p = torch.softmax(q[b].float() @ ent.T * sm_scale, dim=-1)
        out[b] = p @ ent[:, :kv_lora_rank]
    return out
