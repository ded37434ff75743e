"""MLA absorbed decode over the paged latent cache (docs/models.md "MLA layer, absorbed decode").

Given the absorbed query q̂ [B, H, L] (L = kv_lora + rope) and one layer's latent cache,
    s[h,t] = <q̂[h], entry[t]> · sm_scale,  p = softmax_{t < len},  o[h] = Σ_t p[h,t] · entry[t][:kv_lora].
The W_UK absorption before is kernels/mla_prologue.py's. The W_UV projection after,
out[b, h·v + j] = Σ_c W_UV[h, j, c] · o[b, h, c], can ride in the combine (combine_uv, mla_decode's
w_uv=), which then writes the [B, H·v] input of o_proj directly: no o round trip, no bmm, no copy.

Flash-decoding: grid (B, num_splits, head_groups). A program owns BLOCK_H heads of one
sequence and one contiguous token range, so each cache entry is read once per
(sequence, head group). A combine kernel merges the splits by log-sum-exp; it loads every
split of a head at once ([splits, channels] tiles), so its latency does not grow with the
split count.

Why the first version reached only 10-44 % of copy bandwidth (H200, 2026-11-29): the split
count was cdiv(SMs, B·groups), e.g. 17 × 8 = 136 programs for 132 SMs, one program per SM
(its 3-stage tiles take most of the shared memory) — two waves, the second nearly empty;
and the combine walked the splits one dependent load at a time (132 at B = 1). Splits now
fill whole waves (`pick_num_splits`), the plan (`mla_plan.json`, from `python -m
peregrine.bench.kernels_mla --tune`) picks splits and tiles per (cache dtype, B, context
bucket), and an FP8 cache can use FP16 dot operands (one native cvt per 2 values instead
of three on sm_90).

CUDA-graph friendliness: the grid depends only on static shapes — B, H and the block-table
capacity (max_blocks · block_size, the bound on the context) — never on context_lens.
Each sequence divides its *actual* length over the fixed number of splits at run time;
splits past its length exit at once and the combine reads only the active ones, so one
captured graph serves every context length up to the table's capacity. No atomics but
combine_uv's arrival counters, whose last arrival sums in a fixed order: the result is
deterministic. A sequence of length 0 yields zeros (padded graph rows).

Why combine_uv splits the latent channels, not v: every out[b, h, :] needs all of o[b, h, :], so
programs that split v would each re-read all of (b, h)'s FP32 partials (S · 2 KB: 256 KB at B = 1,
8K context, 128 splits); a program per 32-channel slice reads its partials once and multiplies its
[v, 32] W_UV tile, and the head's last slice to arrive adds the 16 FP32 [v] sums (8 KB a row).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import available, batch_invariant, interpreting, invariant_max_len, read_plan_entries
from .gemm import arrival_counters
from .pdl import launch_kwargs, pdl_wait

LOG2E = 1.4426950408889634  # scores go through exp2: fold log2(e) into the scale once
MIN_DOT = 16                # smallest tl.dot dimension on the tensor cores
CPU_SMS = 8                 # pretend SM count off-GPU: keeps interpreter grids small
MAX_SPLITS = 256            # bounds the partial buffers and the combine tile
L_FLOOR = tl.constexpr(1e-30)  # softmax sums are >= 1 when any token exists; length 0 gives 0/floor = 0
FLT_BIG = tl.constexpr(3.0e38)  # finite stand-in for the max of an all-inactive split set
SC_FLOOR = tl.constexpr(1e-30)  # log2 of an FP8 scale: a zero scale (all-zero entry) stays finite
COMBINE_TILE = 4096         # [splits, channels] FP32 elements one combine program loads at once
COMBINE_MAX_C = 128         # widest channel slice per combine program
Q_FP16_SCALE = 1.0 / 16     # q̂ in FP16 operands is pre-scaled: range to ~1e6, subnormal floor < 1e-3
PLAN_PATH = Path(__file__).with_name("mla_plan.json")
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
    fp8_compute: str = "bf16"  # FP8 cache: dot operand dtype, "bf16" or "fp16" (native e4m3->f16 cvt)
    programs_per_sm: int = 1   # resident split programs per SM the split count is sized for


# Chosen from ptxas -v on sm_90a (no spills); the plan overrides them where measured.
DEFAULT_TILING = MlaTiling()
FP8_TILING = MlaTiling(block_n=32)  # the FP8→BF16 converts need registers: 64 tokens spill
FP32_TILING = MlaTiling(block_n=32, num_stages=2)  # tests only: FP32 tiles would overflow shared memory
# Verify steps with several query rows a program: M = rows x heads (FlashMLA's 64: two rows of Kimi-Linear's 32
# heads). The [64, 512] FP32 accumulator goes to wgmma; with 8 warps and 16-token tiles ptxas (sm_90a) still
# spills ~200 bytes a thread (4 warps or 16 warps spill far more), so it is opt-in until an H200 run decides.
VERIFY_M = 64
VERIFY_TILING = MlaTiling(block_n=16, num_warps=8, num_stages=2)
FP8_VERIFY_TILING = MlaTiling(block_n=16, num_warps=8, num_stages=2)
FP32_VERIFY_TILING = MlaTiling(block_h=16, block_n=16, num_stages=1)  # tests only


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SMS


def _device(device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def pick_num_splits(batch: int, num_heads: int, max_context: int, device, tiling: MlaTiling = DEFAULT_TILING) -> int:
    """Splits per sequence: as many as fill one wave of programs_per_sm programs on every SM
    (rounded down: one program more than a wave costs a whole second wave), but no split
    under tiling.min_split_tokens of the bound. Depends only on static sizes (graph-safe)."""
    groups = triton.cdiv(num_heads, _block_h(num_heads, tiling))
    wave = _num_sms(_device(device)) * max(1, tiling.programs_per_sm)
    want = max(1, wave // max(1, batch * groups))
    cap = triton.cdiv(max(1, max_context), tiling.min_split_tokens)
    return max(1, min(MAX_SPLITS, want, cap))


def _block_h(num_heads: int, tiling: MlaTiling) -> int:
    return max(MIN_DOT, min(tiling.block_h, triton.next_power_of_2(num_heads)))


# ---- plan: (cache dtype, B, context bucket) -> (tiling, splits) ----

def plan_key(cache: str, batch: int, context: int) -> str:
    return f"{cache},{batch},{context}"


@functools.lru_cache(maxsize=None)
def load_plan(path: str | None = None) -> dict:
    """{(cache, B, context): (MlaTiling, num_splits)}; a missing/corrupt file or a bad entry is skipped."""
    plan = {}
    for key, e in read_plan_entries(Path(path) if path else PLAN_PATH).items():
        try:
            cache, b, ctx = key.split(",")
            fields = {k: e[k] for k in MlaTiling.__dataclass_fields__ if k in e}
            t, s = MlaTiling(**fields), int(e["num_splits"])
            if not (cache in ("bf16", "fp8") and _valid(t) and 1 <= s <= MAX_SPLITS):
                continue
            plan[(cache, int(b), int(ctx))] = (t, s)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return plan


def _valid(t: MlaTiling) -> bool:
    pow2 = lambda x: isinstance(x, int) and x >= 1 and x & (x - 1) == 0  # noqa: E731
    return (pow2(t.block_h) and t.block_h >= MIN_DOT and pow2(t.block_n) and t.block_n >= MIN_DOT
            and pow2(t.num_warps) and isinstance(t.num_stages, int) and 1 <= t.num_stages <= 8
            and isinstance(t.min_split_tokens, int) and t.min_split_tokens >= 1
            and t.fp8_compute in ("bf16", "fp16") and isinstance(t.programs_per_sm, int) and t.programs_per_sm >= 1)


def lookup(cache: str, batch: int, max_context: int, path: str | None = None):
    """(tiling, num_splits) planned for the smallest planned batch >= B (else the largest) and
    the smallest planned context bucket >= max_context (else the largest); None if unplanned."""
    plan = load_plan(path)
    keys = [k for k in plan if k[0] == cache]
    if not keys:
        return None
    bs = sorted({k[1] for k in keys})
    b = next((x for x in bs if x >= batch), bs[-1])
    cs = sorted(k[2] for k in keys if k[1] == b)
    c = next((x for x in cs if x >= max_context), cs[-1])
    return plan[(cache, b, c)]


def tiling_dict(t: MlaTiling) -> dict:
    return asdict(t)


@triton.jit
def _split_bounds(n, num_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr):
    # Each split gets a BLOCK_N-aligned share of this sequence's real length, at least MIN_CHUNK.
    chunk = tl.cdiv(tl.maximum(tl.cdiv(n, num_splits), MIN_CHUNK), BLOCK_N) * BLOCK_N
    n_active = tl.cdiv(n, tl.maximum(chunk, 1))
    return chunk, n_active


@triton.jit
def _mla_split_kernel(
    q_ptr, lat_ptr, scale_ptr, bt_ptr, len_ptr, part_ptr, lse_ptr, out_ptr,
    qk_scale, q_mul, H, num_splits, T,
    s_qb, s_qh, s_lblk, s_ltok, s_sblk, s_stok, s_btb,
    s_pb, s_ph, s_ps, s_eb, s_eh, s_ob, s_oh,
    C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, PAGE: tl.constexpr,
    FP8: tl.constexpr, PV_LOG: tl.constexpr, DIRECT: tl.constexpr, PREC: tl.constexpr, CDT: tl.constexpr,
    QR: tl.constexpr = 0, BLOCK_M: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
):
    """QR = 0: a program is (sequence b, split, head group), BLOCK_M = BLOCK_H query rows. QR >= 1 (verify
    steps): the T query rows of a sequence are rows s·T .. s·T + T - 1 of q, its table and length (the last
    row's) are entry s, and a program takes QR of its rows x BLOCK_H heads (BLOCK_M = QR·BLOCK_H): each latent
    tile it loads serves all of them, row r seeing the tokens before n - (T - 1) + r."""
    pdl_wait(USE_PDL)  # no weights here: q̂, lengths, tables and this step's cache entry come from earlier work
    b = tl.program_id(0)
    sp = tl.program_id(1)
    g = tl.program_id(2)
    if QR > 0:
        nq = (T + QR - 1) // QR
        seq = b // nq
        r0 = (b % nq) * QR
    else:
        seq = b
    n = tl.load(len_ptr + seq)
    chunk, n_active = _split_bounds(n, num_splits, BLOCK_N, MIN_CHUNK)
    if DIRECT:
        n_active = tl.maximum(n_active, 1)  # a length-0 row still gets its zeros written
    if sp >= n_active:  # nothing of this sequence falls in this split
        return
    start = sp * chunk
    end = tl.minimum(start + chunk, n)

    if QR > 0:
        mm = tl.arange(0, BLOCK_M)
        qr = r0 + mm // BLOCK_H  # the query row within the sequence
        heads = g * BLOCK_H + mm % BLOCK_H
        hm = (heads < H) & (qr < T)
        qrow = seq.to(tl.int64) * T + qr  # its row of q, the partials and the output
        lim = n - (T - 1) + qr  # causal within the draft: row qr sees the tokens before lim
        q_row = q_ptr + qrow[:, None] * s_qb + heads[:, None] * s_qh
        neg = -FLT_BIG  # a row may have no token in a tile or a split: its running max stays finite
    else:
        heads = g * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = heads < H
        q_row = q_ptr + b.to(tl.int64) * s_qb + heads[:, None] * s_qh
        neg = float("-inf")
    oc = tl.arange(0, BLOCK_C)
    cm = oc < C
    orr = tl.arange(0, BLOCK_R)
    rm = orr < R
    q_c = (tl.load(q_row + oc[None, :], mask=hm[:, None] & cm[None, :], other=0.0).to(tl.float32) * q_mul).to(CDT)
    q_r = (tl.load(q_row + C + orr[None, :], mask=hm[:, None] & rm[None, :], other=0.0).to(tl.float32) * q_mul).to(CDT)

    m_i = tl.full([BLOCK_M], neg, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    mv_i = tl.full([BLOCK_M], neg, tl.float32)  # PV_LOG: running max of s + log2(scale)
    acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * s_btb
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tm = t < end  # masked loads never touch entries past the context
        blk = tl.load(bt_row + t // PAGE, mask=tm, other=0).to(tl.int64)
        off = t % PAGE
        row = lat_ptr + blk * s_lblk + off * s_ltok
        if FP8:
            # Each use gets its own load of the tile (the second is an L2 hit), with no register
            # transpose between the convert and the dot: that form is what lets the pipeliner
            # stream both through shared memory. One tile used twice, as for BF16, made the
            # FP8 load synchronous (the convert and transpose sat between it and the dots).
            kct = tl.load(row[None, :] + oc[:, None], mask=cm[:, None] & tm[None, :], other=0.0).to(CDT)
            krt = tl.load(row[None, :] + C + orr[:, None], mask=rm[:, None] & tm[None, :], other=0.0).to(CDT)
            s = tl.dot(q_c, kct, input_precision=PREC)
            s += tl.dot(q_r, krt, input_precision=PREC)
            kc = tl.load(row[:, None] + oc[None, :], mask=tm[:, None] & cm[None, :], other=0.0).to(CDT)
        else:
            kc = tl.load(row[:, None] + oc[None, :], mask=tm[:, None] & cm[None, :], other=0.0).to(CDT)
            kr = tl.load(row[:, None] + C + orr[None, :], mask=tm[:, None] & rm[None, :], other=0.0).to(CDT)
            s = tl.dot(q_c, tl.trans(kc), input_precision=PREC)
            s += tl.dot(q_r, tl.trans(kr), input_precision=PREC)
        if FP8:  # value = fp8 · scale: scale the score columns, not the tile
            sc = tl.load(scale_ptr + blk * s_sblk + off * s_stok, mask=tm, other=0.0)
            s = s * sc[None, :]
        if QR > 0:
            s = tl.where(tm[None, :] & (t[None, :] < lim[:, None]), s * qk_scale, float("-inf"))
        else:
            s = tl.where(tm[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if PV_LOG:
            # FP16 operands: p·scale can fall below FP16's normal range, so the PV weights get
            # their own running max over s + log2(scale) and stay in [0, 1].
            sv = s + tl.log2(tl.maximum(sc, SC_FLOOR))[None, :]
            mv_new = tl.maximum(mv_i, tl.max(sv, 1))
            pv = tl.exp2(sv - mv_new[:, None])
            acc = acc * tl.exp2(mv_i - mv_new)[:, None] + tl.dot(pv.to(CDT), kc, input_precision=PREC)
            mv_i = mv_new
        else:
            if FP8:
                p = p * sc[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(CDT), kc, input_precision=PREC)

    if PV_LOG:  # acc = 2^-mv Σ 2^s·scale·c, l = 2^-m Σ 2^s
        acc = acc * tl.where(l_i > 0, tl.exp2(mv_i - m_i), 0.0)[:, None]
    o = acc / tl.maximum(l_i, L_FLOOR)[:, None]
    om = hm[:, None] & cm[None, :]
    if QR > 0:
        ob, pb, eb = qrow[:, None] * s_ob, qrow[:, None] * s_pb, qrow * s_eb
    else:
        ob, pb, eb = b.to(tl.int64) * s_ob, b.to(tl.int64) * s_pb, b.to(tl.int64) * s_eb
    if DIRECT:  # one split: no combine, write the output itself
        out = out_ptr + ob + heads[:, None] * s_oh + oc[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=om)
    else:
        part = part_ptr + pb + heads[:, None] * s_ph + sp * s_ps + oc[None, :]
        tl.store(part, o, mask=om)
        tl.store(lse_ptr + eb + heads * s_eh + sp, m_i + tl.log2(l_i), mask=hm)


@triton.jit
def _mla_combine_kernel(
    part_ptr, lse_ptr, len_ptr, out_ptr, num_splits, T,
    s_pb, s_ph, s_ps, s_eb, s_eh, s_ob, s_oh,
    C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_CC: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """One (row, head, channel slice): all of its splits in one [BLOCK_S, BLOCK_CC] tile. T: rows per
    sequence (verify steps: the splits were sized by the sequence's length, len_ptr's entry b // T)."""
    pdl_wait(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    oc = tl.program_id(2) * BLOCK_CC + tl.arange(0, BLOCK_CC)
    cm = oc < C
    n = tl.load(len_ptr + b // T)
    chunk, n_active = _split_bounds(n, num_splits, BLOCK_N, MIN_CHUNK)
    sp = tl.arange(0, BLOCK_S)
    sm = sp < n_active  # inactive splits were never written: never read them
    lse = tl.load(lse_ptr + b.to(tl.int64) * s_eb + h * s_eh + sp, mask=sm, other=float("-inf"))
    w = tl.where(sm, tl.exp2(lse - tl.maximum(tl.max(lse, 0), -FLT_BIG)), 0.0)  # no -inf - -inf
    o = tl.load(part_ptr + b.to(tl.int64) * s_pb + h * s_ph + sp[:, None] * s_ps + oc[None, :],
                mask=sm[:, None] & cm[None, :], other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), L_FLOOR)
    tl.store(out_ptr + b.to(tl.int64) * s_ob + h * s_oh + oc, res.to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _combine_slice(part_ptr, lse_ptr, len_ptr, b, h, cc, cm, B, T, num_splits, s_pb, s_ph, s_ps, s_eb, s_eh,
                   BLOCK_S: tl.constexpr, BLOCK_SS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
                   MIN_CHUNK: tl.constexpr):
    """_mla_combine_kernel's result for (sequence b, head h, channels cc) in FP32, the splits read
    BLOCK_SS at a time (one tile, its exact expression, when BLOCK_SS == BLOCK_S). b >= B gives 0."""
    n = tl.load(len_ptr + b // T, mask=b < B, other=0)
    chunk, n_active = _split_bounds(n, num_splits, BLOCK_N, MIN_CHUNK)
    e_row = lse_ptr + b.to(tl.int64) * s_eb + h * s_eh
    p_row = part_ptr + b.to(tl.int64) * s_pb + h * s_ph
    sp = tl.arange(0, BLOCK_S)
    sm = sp < n_active  # inactive splits were never written: never read them
    lse = tl.load(e_row + sp, mask=sm, other=float("-inf"))
    top = tl.maximum(tl.max(lse, 0), -FLT_BIG)  # no -inf - -inf
    wt = tl.where(sm, tl.exp2(lse - top), 0.0)
    den = tl.maximum(tl.sum(wt, 0), L_FLOOR)
    if BLOCK_SS == BLOCK_S:
        o = tl.load(p_row + sp[:, None] * s_ps + cc[None, :], mask=sm[:, None] & cm[None, :], other=0.0)
        acc = tl.sum(o * wt[:, None], 0)
    else:
        acc = tl.zeros([BLOCK_C], tl.float32)
        for s0 in tl.static_range(0, BLOCK_S, BLOCK_SS):
            ss = s0 + tl.arange(0, BLOCK_SS)
            ssm = ss < n_active
            wt = tl.where(ssm, tl.exp2(tl.load(e_row + ss, mask=ssm, other=float("-inf")) - top), 0.0)
            o = tl.load(p_row + ss[:, None] * s_ps + cc[None, :], mask=ssm[:, None] & cm[None, :], other=0.0)
            acc += tl.sum(o * wt[:, None], 0)
    return acc / den


@triton.jit
def _mla_uv_kernel(
    part_ptr, lse_ptr, len_ptr, w_ptr, ws_ptr, count_ptr, out_ptr, B, H, V, NV, num_splits, T,
    s_pb, s_ph, s_ps, s_eb, s_eh, s_wh, s_wv, s_ob,
    C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_SS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_B: tl.constexpr, NC: tl.constexpr, BLOCK_NC: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_CHUNK: tl.constexpr, DIRECT: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """One (latent channel slice cj, head h and v-slice vj, row group): the combine of its channels for
    each row, rounded to the output dtype (where the chain's combine stores o), times its W_UV tile.
    NC > 1 slices: FP32 sums into the workspace; the last slice of (h, vj, rows) to arrive adds them
    in slice order (the same bits whichever arrives last) and writes out[b, h·V + v]."""
    cj = tl.program_id(0)
    hv = tl.program_id(1)
    bg = tl.program_id(2)
    h = hv // NV
    vv = (hv % NV) * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = vv < V
    cc = cj * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cc < C
    w = tl.load(w_ptr + h.to(tl.int64) * s_wh + vv[:, None] * s_wv + cc[None, :],
                mask=vm[:, None] & cm[None, :], other=0.0)  # a weight: ahead of the wait
    pdl_wait(USE_PDL)
    ty: tl.constexpr = out_ptr.dtype.element_ty
    for i in tl.static_range(BLOCK_B):
        b = bg * BLOCK_B + i
        if DIRECT:  # one split: o is the split kernel's output, already in the model dtype
            o = tl.load(part_ptr + b.to(tl.int64) * s_pb + h * s_ph + cc, mask=cm & (b < B), other=0.0)
        else:
            o = _combine_slice(part_ptr, lse_ptr, len_ptr, b, h, cc, cm, B, T, num_splits, s_pb, s_ph, s_ps,
                               s_eb, s_eh, BLOCK_S, BLOCK_SS, BLOCK_C, BLOCK_N, MIN_CHUNK).to(ty)
        y = tl.sum(w.to(tl.float32) * o.to(tl.float32)[None, :], 1)
        if NC == 1:
            tl.store(out_ptr + b.to(tl.int64) * s_ob + h * V + vv, y.to(ty), mask=vm & (b < B))
        else:
            tl.store(ws_ptr + ((b.to(tl.int64) * H + h) * NC + cj) * V + vv, y, mask=vm & (b < B))
    if NC > 1:
        tl.debug_barrier()  # every thread's sums are stored before the release below
        c_ptr = count_ptr + bg * tl.num_programs(1) + hv
        arrived = tl.atomic_add(c_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == NC - 1:
            tl.debug_barrier()
            j = tl.arange(0, BLOCK_NC)
            for i in tl.static_range(BLOCK_B):
                b = bg * BLOCK_B + i
                ok = (j < NC)[:, None] & vm[None, :] & (b < B)
                t = tl.load(ws_ptr + ((b.to(tl.int64) * H + h) * NC + j[:, None]) * V + vv[None, :], mask=ok,
                            other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + b.to(tl.int64) * s_ob + h * V + vv, tl.sum(t, 0).to(ty), mask=vm & (b < B))
            tl.atomic_xchg(c_ptr, 0)  # ready for the next launch (graph replays included)


def resolve(B, H, capacity, latent_dtype, q_dtype, device, tiling=None, num_splits=None):
    """(tiling, num_splits) mla_decode uses: the plan on a GPU with a BF16 model (unless a tiling
    is given), else the default tiling for the cache dtype and pick_num_splits."""
    fp8 = latent_dtype == torch.float8_e4m3fn
    planned = None
    if tiling is None and q_dtype == torch.bfloat16 and torch.device(device).type == "cuda":
        planned = lookup("fp8" if fp8 else "bf16", B, capacity)
    if planned is not None:
        t, S = planned
    else:
        t = tiling or (FP8_TILING if fp8 else FP32_TILING if latent_dtype == torch.float32 else DEFAULT_TILING)
        S = pick_num_splits(B, H, capacity, device, t)
    return t, min(num_splits or S, MAX_SPLITS)


class Partials(NamedTuple):
    """What the split kernel leaves for the combine: FP32 partials [B, H, S, C] and their log2-sum-exps
    [B, H, S] (None when S == 1: then `direct` holds the attention output o [B, H, C] itself)."""
    part: torch.Tensor | None
    lse: torch.Tensor | None
    direct: torch.Tensor | None
    context_lens: torch.Tensor
    num_splits: int
    tiling: MlaTiling
    tokens_per_seq: int = 1  # verify steps: T rows per sequence, context_lens one entry per sequence


def mla_decode(q, latent, scale, block_tables, context_lens, sm_scale, *, kv_lora_rank,
               num_splits=None, out=None, tiling: MlaTiling | None = None, w_uv=None, uv_tiling=None,
               tokens_per_seq: int = 1, query_rows: int = 0):
    """Attention of q [B, H, L] over the paged latent cache; returns o [B, H, kv_lora_rank] in q.dtype.

    latent [num_blocks, block_size, L] (model dtype or float8_e4m3fn), scale [num_blocks, block_size]
    FP32 when FP8 else None, block_tables [B, max_blocks] (int64/int32), context_lens [B] int32.
    Tiling and split count come from the plan for (cache dtype, B, max_blocks · block_size), else
    the defaults and pick_num_splits; `tiling` / `num_splits` override. All of it depends only on
    static sizes, so it is safe under CUDA-graph replay with changing lengths.

    w_uv [H, v, kv_lora_rank] (q.dtype, unit inner stride; see uv_why_not): the W_UV projection is
    fused into the split combine (combine_uv) and the result is [B, H·v] in q.dtype (`out` that shape).

    tokens_per_seq T > 1 (speculative verify): q's B rows are B / T sequences' T query positions each,
    block_tables and context_lens have one entry per sequence (its length counting all T), and row r of a
    sequence attends to the entries before length - (T - 1) + r. A program takes query_rows (default 1) of a
    sequence's rows with its head group, so the latent is read ceil(T / query_rows) times per sequence and
    head group; more than one row uses VERIFY_TILING (M = rows x heads, VERIFY_M at Kimi-Linear's 32 heads).
    """
    B, H, _ = q.shape
    if w_uv is not None:
        why = uv_why_not(q, w_uv, kv_lora_rank)
        assert why is None, why
        o_lat = None
    else:
        if out is None:
            out = torch.empty(B, H, kv_lora_rank, dtype=q.dtype, device=q.device)
        assert out.shape == (B, H, kv_lora_rank) and out.dtype == q.dtype and out.stride(2) == 1
        o_lat = out
    p = mla_partials(q, latent, scale, block_tables, context_lens, sm_scale, kv_lora_rank=kv_lora_rank,
                     num_splits=num_splits, tiling=tiling, direct_out=o_lat, tokens_per_seq=tokens_per_seq,
                     query_rows=query_rows)
    if w_uv is not None:
        return combine_uv(p, w_uv, out=out, uv_tiling=uv_tiling)
    if p.direct is None and B > 0:
        combine(p, out)
    return out


def verify_query_rows(T: int, query_rows: int = 0) -> int:
    """Query rows of one sequence a verify program takes: a power of two, at most T's; default 1."""
    return max(1, min(triton.next_power_of_2(max(query_rows, 1)), triton.next_power_of_2(T)))


def _verify_tiling(latent_dtype) -> MlaTiling:
    fp8 = latent_dtype == torch.float8_e4m3fn
    return FP32_VERIFY_TILING if latent_dtype == torch.float32 else FP8_VERIFY_TILING if fp8 else VERIFY_TILING


def invariant_splits(latent_dtype, max_len: int) -> tuple[MlaTiling, int]:
    """Batch-invariant mode's (tiling, splits): the dtype's default tiles, and splits of a fixed length from max_len
    alone (at least the tiling's minimum split), so a row's splits cover the same tokens whatever the batch (B, the
    other rows' lengths, the graph's context bucket)."""
    fp8 = latent_dtype == torch.float8_e4m3fn
    t = FP8_TILING if fp8 else FP32_TILING if latent_dtype == torch.float32 else DEFAULT_TILING
    splits = min(MAX_SPLITS, triton.cdiv(max(1, max_len), t.min_split_tokens))  # 128K tokens: 256 splits of 512
    chunk = triton.cdiv(triton.cdiv(max(1, max_len), splits), t.block_n) * t.block_n
    return replace(t, min_split_tokens=chunk), splits


def mla_partials(q, latent, scale, block_tables, context_lens, sm_scale, *, kv_lora_rank,
                 num_splits=None, tiling: MlaTiling | None = None, direct_out=None, tokens_per_seq: int = 1,
                 query_rows: int = 0) -> Partials:
    """The split kernel of mla_decode (same arguments): its Partials. With one split it writes o itself,
    into direct_out [B, H, C] when given."""
    B, H, L = q.shape
    C = kv_lora_rank
    R = L - C
    T = tokens_per_seq
    nblk, page, L2 = latent.shape
    assert L2 == L and R >= 1, f"latent dim {L2} vs q {L} (kv_lora {C})"
    assert latent.stride(2) == 1 and q.stride(2) == 1, "last dims must be contiguous"
    fp8 = latent.dtype == torch.float8_e4m3fn
    assert (scale is not None) == fp8, "scale is required exactly for an FP8 cache"
    assert B % T == 0 and block_tables.shape[0] == context_lens.shape[0] == B // T
    capacity = block_tables.shape[1] * page
    invariant = batch_invariant()
    qr = (1 if invariant else verify_query_rows(T, query_rows)) if T > 1 else 0  # invariant: a verify row as a decode's
    programs = B // T * triton.cdiv(T, qr) if T > 1 else B
    if invariant and tiling is None and num_splits is None:
        t, S = invariant_splits(latent.dtype, invariant_max_len() or capacity)
    elif qr > 1:  # verify with M = query rows x heads: its own tiling, splits sized for its programs
        t = tiling or _verify_tiling(latent.dtype)
        S = min(num_splits or pick_num_splits(max(programs, 1), H, capacity, q.device, t), MAX_SPLITS)
    else:  # decode, or verify a row a program (the decode's M, tiling and plan, as for B·T rows)
        t, S = resolve(max(programs, 1), H, capacity, latent.dtype, q.dtype, q.device, tiling, num_splits)
    direct = S == 1
    if direct:
        out = direct_out if direct_out is not None else torch.empty(B, H, C, dtype=q.dtype, device=q.device)
        part = lse = out  # unused placeholders
        ps = es = (0, 0, 0)
    else:
        out = q  # unused placeholder
        part = torch.empty(B, H, S, C, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
        ps, es = part.stride()[:3], lse.stride()[:2]
    res = Partials(None if direct else part, None if direct else lse, out if direct else None, context_lens, S, t, T)
    if B == 0:
        return res
    block_h = _block_h(H, t)
    block_c = max(MIN_DOT, triton.next_power_of_2(C))
    block_r = max(MIN_DOT, triton.next_power_of_2(R))
    sc = scale if fp8 else latent  # placeholder pointer when not FP8
    s_sblk, s_stok = (scale.stride(0), scale.stride(1)) if fp8 else (0, 0)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"  # FP32 tests need exact FP32 dots
    # Dot operands in the model dtype (FP16 for an FP8 cache if the tiling says so) with FP32
    # accumulation; FP32 under the interpreter, whose BF16 tl.dot is wrong in triton 3.6.
    fp16 = fp8 and t.fp8_compute == "fp16" and q.dtype != torch.float32
    cdt = (tl.float32 if interpreting() or q.dtype == torch.float32
           else tl.float16 if fp16 else _TL_DTYPE[q.dtype])
    q_mul = Q_FP16_SCALE if fp16 else 1.0
    grid = (programs, S, triton.cdiv(H, block_h))
    _mla_split_kernel[grid](
        q, latent, sc, block_tables, context_lens, part, lse, out,
        float(sm_scale) * LOG2E / q_mul, q_mul, H, S, T,
        q.stride(0), q.stride(1), latent.stride(0), latent.stride(1), s_sblk, s_stok, block_tables.stride(0),
        ps[0], ps[1], ps[2], es[0], es[1], out.stride(0), out.stride(1),
        C=C, R=R, BLOCK_C=block_c, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_N=t.block_n,
        MIN_CHUNK=t.min_split_tokens, PAGE=page, FP8=fp8, PV_LOG=fp16, DIRECT=direct, PREC=prec, CDT=cdt,
        QR=qr, BLOCK_M=max(qr, 1) * block_h, num_warps=t.num_warps, num_stages=t.num_stages,
        **launch_kwargs(q.device),
    )
    return res


def combine(p: Partials, out) -> torch.Tensor:
    """The splits of p merged into out [B, H, C] (the attention output, out's dtype)."""
    B, H, S, C = p.part.shape
    ps, es = p.part.stride()[:3], p.lse.stride()[:2]
    block_s = triton.next_power_of_2(S)
    cc = max(MIN_DOT, min(COMBINE_MAX_C, triton.next_power_of_2(C), COMBINE_TILE // block_s))
    _mla_combine_kernel[(B, H, triton.cdiv(C, cc))](
        p.part, p.lse, p.context_lens, out, S, p.tokens_per_seq,
        ps[0], ps[1], ps[2], es[0], es[1], out.stride(0), out.stride(1),
        C=C, BLOCK_S=block_s, BLOCK_CC=cc, BLOCK_N=p.tiling.block_n, MIN_CHUNK=p.tiling.min_split_tokens,
        num_warps=4, **launch_kwargs(out.device),
    )
    return out


# ---- the combine with W_UV fused in: o_lat never leaves the kernel ----

UV_MAX_ROWS = 16        # rows (B, or B·T in a verify step) combine_uv takes; more go to the bmm (cuBLAS streams well there)
UV_THREAD_ELEMS = 32    # W_UV tile elements per thread: [128, 32] at 4 warps takes 56 registers, [128, 64] 167 (sm_90 ptxas)
UV_ROW_SPLITS = 256     # rows x splits per program: the unrolled row loop keeps their partial loads in flight (<= 157 regs)
UV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class UvTiling:
    # a head's whole v (128) per program: no two programs of a row read the same partials
    block_v: int = 128
    # channels per program: 512 / 32 = 16 slices, 512 programs at H = 32 (about four per SM at B = 1)
    block_c: int = 32
    # most rows per program (also capped by UV_ROW_SPLITS): W_UV tiles are read once per row group
    block_b: int = 16
    num_warps: int = 4


DEFAULT_UV_TILING = UvTiling()


def uv_why_not(q, w_uv, kv_lora_rank: int) -> str | None:
    """None when combine_uv can serve mla_decode(q, ..., w_uv=w_uv), else why the bmm must."""
    if not available(q.device):
        return "kernels unavailable"
    if q.dtype not in UV_DTYPES or w_uv.dtype != q.dtype:
        return f"dtypes {q.dtype}/{w_uv.dtype}"
    if w_uv.dim() != 3 or w_uv.shape[0] != q.shape[1] or w_uv.shape[2] != kv_lora_rank:
        return f"W_UV shape {tuple(w_uv.shape)} vs q {tuple(q.shape)}, kv_lora {kv_lora_rank}"
    if w_uv.stride(2) != 1:
        return "W_UV needs a unit inner stride"
    if q.shape[0] > UV_MAX_ROWS:
        return f"{q.shape[0]} rows > {UV_MAX_ROWS}"
    return None


def _uv_valid(u: UvTiling) -> bool:
    pow2 = lambda x: isinstance(x, int) and x >= 1 and x & (x - 1) == 0  # noqa: E731
    return (pow2(u.block_v) and pow2(u.block_c) and u.block_c >= MIN_DOT and pow2(u.num_warps)
            and u.block_v * u.block_c <= UV_THREAD_ELEMS * 32 * u.num_warps and pow2(u.block_b) and u.block_b <= UV_MAX_ROWS)


def combine_uv(p: Partials, w_uv, *, out=None, uv_tiling: UvTiling | None = None) -> torch.Tensor:
    """out[b, h·v + j] = Σ_c W_UV[h, j, c] · o[b, h, c], o the combine of p rounded to w_uv's dtype (as the
    chain's combine output is before its bmm), FP32 sums; one launch, returns out [B, H·v] in w_uv.dtype."""
    src = p.direct if p.part is None else p.part
    B, H, C = src.shape[0], src.shape[1], src.shape[-1]
    V = w_uv.shape[1]
    assert w_uv.shape == (H, V, C) and w_uv.stride(2) == 1
    if out is None:
        out = torch.empty(B, H * V, dtype=w_uv.dtype, device=w_uv.device)
    assert out.shape == (B, H * V) and out.dtype == w_uv.dtype and out.stride(1) == 1
    if B == 0:
        return out
    u = uv_tiling or DEFAULT_UV_TILING
    assert _uv_valid(u), u
    block_v = min(u.block_v, triton.next_power_of_2(V))
    block_c = min(u.block_c, max(MIN_DOT, triton.next_power_of_2(C)))
    direct = p.part is None
    S = p.num_splits
    block_s = 1 if direct else triton.next_power_of_2(S)
    block_b = min(u.block_b, triton.next_power_of_2(B), max(1, UV_ROW_SPLITS // block_s))
    nv, nc, nb = triton.cdiv(V, block_v), triton.cdiv(C, block_c), triton.cdiv(B, block_b)
    block_ss = max(1, min(block_s, COMBINE_TILE // block_c))
    ps = src.stride()[:2] + ((0,) if direct else src.stride()[2:3])
    es = (0, 0) if direct else p.lse.stride()[:2]
    lse = src if direct else p.lse  # placeholder pointer when direct
    ws = torch.empty(B, H, nc, V, dtype=torch.float32, device=out.device) if nc > 1 else out
    count = arrival_counters(out.device, nb * H * nv) if nc > 1 else out
    _mla_uv_kernel[(nc, H * nv, nb)](
        src, lse, p.context_lens, w_uv, ws, count, out, B, H, V, nv, S, p.tokens_per_seq,
        ps[0], ps[1], ps[2], es[0], es[1], w_uv.stride(0), w_uv.stride(1), out.stride(0),
        C=C, BLOCK_S=block_s, BLOCK_SS=block_ss, BLOCK_V=block_v, BLOCK_C=block_c, BLOCK_B=block_b, NC=nc,
        BLOCK_NC=triton.next_power_of_2(nc), BLOCK_N=p.tiling.block_n, MIN_CHUNK=p.tiling.min_split_tokens,
        DIRECT=direct, num_warps=u.num_warps, **launch_kwargs(out.device),
    )
    return out


def mla_decode_uv_ref(q, latent, scale, block_tables, context_lens, sm_scale, w_uv, *, kv_lora_rank):
    """FP32 reference of mla_decode(..., w_uv=w_uv): the attention output times W_UV per head, [B, H·v]."""
    o = mla_decode_ref(q, latent, scale, block_tables, context_lens, sm_scale, kv_lora_rank=kv_lora_rank)
    return torch.einsum("bhc,hvc->bhv", o, w_uv.float()).reshape(o.shape[0], -1)


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
