"""MLA prefill attention, non-absorbed (docs/models.md "MLA layer"; NoPE, causal).

T new queries at absolute positions start … start+T-1 attend over L keys at 0 … L-1 (the
cached prefix plus the new tokens; start = L - T unless given):
    s[h,t,j] = (q_n[t,h]·k_n[j,h] + q_r[t,h]·k_r[j]) · sm_scale,  visible iff j <= start + t,
    o[t,h]   = softmax_j(s[h,t,:]) @ v[:,h].
k_r is one [L, Dr] tensor shared by all heads (never expanded). k_n and v may be strided
views of one [L, H, Dn+Dv] tensor and k_r of the [L, 576] latent: only the last dims must
be contiguous. Keys past start + T - 1 are never read.

Flash attention: grid (query blocks, H, sequences × splits), a program owns BLOCK_M queries
of one head and walks the keys in BLOCK_N steps with an online softmax (exp2, log2 e folded
into the scale, FP32 statistics and accumulator); the T×L scores never exist. Key blocks
every query of the program sees run unmasked; the few on the causal diagonal run masked;
blocks past the diagonal are never visited (half the work at start = 0). Query blocks are
launched latest first, so the longest causal rows start early and the short ones fill the tail.

Few queries over a long prefix (a turn-2 prefix hit) leave most SMs idle with one program per
(query block, head), so `pick_splits` then splits the keys of each program over several
(flash-decoding); each writes an FP32 partial and its log-sum-exp, and a small combine kernel
merges them. `mla_prefill_varlen` runs several sequences (packed rows, prefix sums) in one launch.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import available, interpreting, why_unavailable

LOG2E = 1.4426950408889634    # scores go through exp2: fold log2(e) into the scale once
MIN_DOT = 16                  # smallest tl.dot dimension on the tensor cores
REF_CHUNK_BYTES = 256 << 20   # reference: FP32 scores held per query chunk
L_FLOOR = tl.constexpr(1e-30) # a split that saw no key of a row has l = 0: its partial is 0 / floor = 0
MIN_SPLIT_KEYS = 1024         # fewest keys per KV split: below it the q load and FP32 partial outweigh the gain
MAX_SPLITS = 16               # bounds the partial buffers and the combine tile
CPU_SMS = 8                   # pretend SM count off-GPU: keeps interpreter grids small
COMBINE_WARPS = 4             # the combine moves [splits, Dv] FP32 per (query, head): a few KB
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 128   # queries per program: two 64-row wgmma warpgroups at 8 warps
    block_n: int = 64    # keys per step: [128, 64] FP32 scores = 32 registers per thread at 8 warps
    num_warps: int = 8   # [128, 128] FP32 accumulator = 64 registers per thread; 4 warps would double it
    num_stages: int = 2  # K/V tiles in flight: 2 × 40 KB of shared memory beside the 48 KB q tile
    num_splits: int = 0  # KV splits per query block (+ a combine); 0: pick_splits fills one wave of SMs


# Per (Dn, Dr, Dv) defaults for BF16/FP16; `python -m peregrine.bench.kernels_mla_prefill` times the
# candidates in CONFIG_CANDIDATES and reports the best per shape (write winners back here).
# H200 (results/2026-12-01-prefill/…-kernels-mla_prefill.json): 3 stages beat 2 at every T >= 2048
# (8192 tokens: 1.50 vs 1.86 ms; 32768: 22.0 vs 26.1 ms)
CONFIGS = {(128, 64, 128): PrefillConfig(128, 64, 8, 3)}
FP32_CONFIG = PrefillConfig(64, 16, 8, 2)     # GPU tests, interpreter: FP32 FMA dots; 32 keys spill at 192 + 128 dims
SMALL_T = 64                                  # at most this many queries: one 64-row block per head
SMALL_T_CONFIG = PrefillConfig(64, 64, 4, 3)  # no 128-row block mostly padding; one warpgroup
CONFIG_CANDIDATES = (
    PrefillConfig(),
    PrefillConfig(128, 64, 8, 3),
    PrefillConfig(128, 128, 8, 2),
    PrefillConfig(128, 32, 8, 3),
    PrefillConfig(64, 64, 4, 3),
    PrefillConfig(64, 64, 4, 2),
    PrefillConfig(64, 32, 4, 4),
)


def pick_config(dn: int, dr: int, dv: int, dtype: torch.dtype, T: int) -> PrefillConfig:
    if dtype == torch.float32:
        return FP32_CONFIG
    if T <= SMALL_T:
        return SMALL_T_CONFIG
    return CONFIGS.get((dn, dr, dv), PrefillConfig())


def invariant_config(dn: int, dr: int, dv: int, dtype: torch.dtype) -> PrefillConfig:
    """Batch-invariant mode's config for every query count: the long-prompt tiles and no KV split (a split and its
    combine sum a row's keys in another order). A key block past a query's position adds exactly nothing to it, so
    its bits do not depend on the query block, the step's other queries or where the step starts."""
    return replace(pick_config(dn, dr, dv, dtype, SMALL_T + 1), num_splits=1)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SMS


def pick_splits(T: int, L: int, H: int, cfg: PrefillConfig, device) -> int:
    """KV splits: 1 when the (query block, head) grid already fills the SMs; else as many as fill
    one wave (rounded down), but none under MIN_SPLIT_KEYS keys. Few queries over a long prefix
    (a turn-2 prefix hit: T = 64, 32 heads = 32 programs on 132 SMs) is the case it is for."""
    return _splits(triton.cdiv(T, cfg.block_m) * H, L, cfg, device)


def _splits(programs: int, L: int, cfg: PrefillConfig, device) -> int:
    if cfg.num_splits:
        return min(cfg.num_splits, MAX_SPLITS)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return max(1, min(MAX_SPLITS, _num_sms(dev) // max(1, programs), L // MIN_SPLIT_KEYS))


def _pad(d: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(d))


@triton.jit
def _tile(ptr, rows, cols, row_stride, row_ok, col_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """[rows, cols] tile at ptr; masks only where a constexpr says rows / padded columns can be out of range."""
    p = ptr + rows[:, None] * row_stride + cols[None, :]
    if CHECK_ROWS:
        if CHECK_COLS:
            x = tl.load(p, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        else:
            x = tl.load(p, mask=row_ok[:, None], other=0.0)
    else:
        if CHECK_COLS:
            x = tl.load(p, mask=col_ok[None, :], other=0.0)
        else:
            x = tl.load(p)
    return x


@triton.jit
def _attend(acc, m_i, l_i, qn, qr, kn_base, kr_ptr, v_base, j0, hi, qpos, s_knl, s_krl, s_vl, qk_scale,
            DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr,
            BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr,
            MASKED: tl.constexpr, SAFE: tl.constexpr):
    """One key block [j0, j0 + BLOCK_N): MASKED for blocks that cross the causal diagonal or hi;
    SAFE where a row may have seen no key yet (a KV split past its diagonal)."""
    keys = tl.arange(0, BLOCK_N)
    dn = tl.arange(0, BLOCK_DN)
    dr = tl.arange(0, BLOCK_DR)
    dv = tl.arange(0, BLOCK_DV)
    j = j0 + keys
    j_ok = j < hi  # masked loads never read keys no query sees (they may hold anything)
    off = tl.cast(j0, tl.int64)  # L · row stride can pass 2^31 (128K keys × 96 heads × 256)
    kn = _tile(kn_base + off * s_knl, keys, dn, s_knl, j_ok, dn < DN, MASKED, BLOCK_DN != DN).to(CDT)
    kr = _tile(kr_ptr + off * s_krl, keys, dr, s_krl, j_ok, dr < DR, MASKED, BLOCK_DR != DR).to(CDT)
    s = tl.dot(qn, tl.trans(kn), input_precision=PREC)
    s = tl.dot(qr, tl.trans(kr), s, input_precision=PREC)  # same accumulator: Dn + Dr = one K loop
    if MASKED:
        s = tl.where((j[None, :] <= qpos[:, None]) & j_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if SAFE:  # a row with no visible key so far keeps m = -inf, l = 0, acc = 0 (no -inf - -inf)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:     # unsplit, every row has key 0 in its first block: m is finite after it
        m_sub = m_new
    p = tl.exp2(s * qk_scale - m_sub[:, None])
    alpha = tl.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _tile(v_base + off * s_vl, keys, dv, s_vl, j_ok, dv < DV, MASKED, BLOCK_DV != DV).to(CDT)
    acc = tl.dot(p.to(CDT), v, acc * alpha[:, None], input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _mla_prefill_kernel(
    q_ptr, kn_ptr, kr_ptr, v_ptr, o_ptr, part_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, st_ptr, qk_scale, T, H, start, NS,
    s_qt, s_qh, s_knl, s_knh, s_krl, s_vl, s_vh, s_ot, s_oh,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr,
    SPLIT: tl.constexpr, VARLEN: tl.constexpr, HAS_START: tl.constexpr,
):
    """Grid (query blocks, H, sequences × NS splits). T: query rows in q (all sequences'); the single
    form's one sequence has T queries from position `start`, VARLEN's come from cu_q / cu_k / st."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # latest queries (most keys) first
    h = tl.program_id(1)
    m0 = pid_m * BLOCK_M
    b = tl.program_id(2) // NS
    if VARLEN:  # sequence b: offsets of its rows in the packed q / out and keys
        tok0 = tl.load(cu_q_ptr + b)
        Tq = tl.load(cu_q_ptr + b + 1) - tok0
        key0 = tl.load(cu_k_ptr + b)
        if HAS_START:
            start = tl.load(st_ptr + b)
        else:
            start = tl.load(cu_k_ptr + b + 1) - key0 - Tq
        if m0 >= Tq:  # the grid is sized for the longest sequence
            return
        q_ptr += tok0.to(tl.int64) * s_qt
        o_ptr += tok0.to(tl.int64) * s_ot
        kn_ptr += key0.to(tl.int64) * s_knl
        kr_ptr += key0.to(tl.int64) * s_krl
        v_ptr += key0.to(tl.int64) * s_vl
    else:
        tok0 = 0
        Tq = T
    rows = tl.arange(0, BLOCK_M)
    t_ok = m0 + rows < Tq
    dn = tl.arange(0, BLOCK_DN)
    dr = tl.arange(0, BLOCK_DR)
    dv = tl.arange(0, BLOCK_DV)
    q_base = q_ptr + m0.to(tl.int64) * s_qt + h * s_qh
    qn = _tile(q_base, rows, dn, s_qt, t_ok, dn < DN, True, BLOCK_DN != DN).to(CDT)
    qr = _tile(q_base + DN, rows, dr, s_qt, t_ok, dr < DR, True, BLOCK_DR != DR).to(CDT)
    kn_base = kn_ptr + h * s_knh
    v_base = v_ptr + h * s_vh
    qpos = start + m0 + rows
    # Keys below `full` are visible to every query here (full <= start + m0 + 1); keys at or past
    # `hi` to none of them (hi <= start + Tq <= L: keys no query sees are never read).
    full = (start + m0 + 1) // BLOCK_N * BLOCK_N
    hi = start + tl.minimum(Tq, m0 + BLOCK_M)
    if SPLIT:  # this program's share of [0, hi): BLOCK_N-aligned, so no block straddles two splits
        sp = tl.program_id(2) % NS
        chunk = tl.cdiv(tl.cdiv(hi, NS), BLOCK_N) * BLOCK_N
        lo = sp * chunk
        end = tl.minimum(hi, lo + chunk)
    else:
        lo = 0
        end = hi

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for j0 in range(lo, tl.minimum(full, end), BLOCK_N):
        acc, m_i, l_i = _attend(acc, m_i, l_i, qn, qr, kn_base, kr_ptr, v_base, j0, hi, qpos, s_knl, s_krl, s_vl,
                                qk_scale, DN, DR, DV, BLOCK_DN, BLOCK_DR, BLOCK_DV, BLOCK_N, CDT, PREC, False, False)
    for j0 in range(tl.maximum(full, lo), end, BLOCK_N):
        acc, m_i, l_i = _attend(acc, m_i, l_i, qn, qr, kn_base, kr_ptr, v_base, j0, hi, qpos, s_knl, s_krl, s_vl,
                                qk_scale, DN, DR, DV, BLOCK_DN, BLOCK_DR, BLOCK_DV, BLOCK_N, CDT, PREC, True, SPLIT)
    om = t_ok[:, None] & (dv < DV)[None, :]
    if SPLIT:  # FP32 partial [split, T, H, Dv] normalised by its own sum, and its log2-sum-exp
        prow = (sp * T + tok0 + m0 + rows).to(tl.int64) * H + h
        tl.store(part_ptr + prow[:, None] * DV + dv[None, :], acc / tl.maximum(l_i, L_FLOOR)[:, None], mask=om)
        # l = 0 only where m = -inf (the split saw no key of the row): lse -inf, weight 0 in the combine
        tl.store(lse_ptr + prow, m_i + tl.log2(tl.maximum(l_i, L_FLOOR)), mask=t_ok)
    else:
        o_ptrs = o_ptr + m0.to(tl.int64) * s_ot + h * s_oh + rows[:, None] * s_ot + dv[None, :]
        tl.store(o_ptrs, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=om)


@triton.jit
def _combine_kernel(part_ptr, lse_ptr, o_ptr, T, H, S, s_ot, s_oh,
                    DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One (query, head): merge its S split partials by their log-sum-exp weights."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    sm = sp < S
    prow = (sp * T + t).to(tl.int64) * H + h
    lse = tl.load(lse_ptr + prow, mask=sm, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 holds key 0, visible to every query: the max is finite
    part = tl.load(part_ptr + prow[:, None] * DV + dv[None, :], mask=sm[:, None] & (dv < DV)[None, :], other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o_ptr + t.to(tl.int64) * s_ot + h * s_oh + dv, o.to(o_ptr.dtype.element_ty), mask=dv < DV)


def _check(q, k_nope, k_rope, v, sm_scale):
    """(T, H, Dn, Dr, Dv, L) after validating shapes, dtypes, devices, strides and the scale."""
    for name, x, nd in (("q", q, 3), ("k_nope", k_nope, 3), ("k_rope", k_rope, 2), ("v", v, 3)):
        if not isinstance(x, torch.Tensor) or x.dim() != nd:
            raise ValueError(f"{name} must be a {nd}-d tensor, got {getattr(x, 'shape', type(x))}")
        if x.dtype != q.dtype or x.dtype not in _DTYPES:
            raise ValueError(f"{name} dtype {x.dtype}: all inputs must share one of {_DTYPES}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
        if x.numel() and x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride {x.stride(-1)})")
    T, H, D = q.shape
    L, Hk, Dn = k_nope.shape
    Dr, Dv = D - Dn, v.shape[2]
    if Hk != H or v.shape[:2] != (L, H):
        raise ValueError(f"k_nope {tuple(k_nope.shape)} / v {tuple(v.shape)} must be [L, H={H}, ·]")
    if tuple(k_rope.shape) != (L, Dr) or Dr < 1:
        raise ValueError(f"k_rope {tuple(k_rope.shape)} must be [L={L}, q dim {D} - Dn {Dn}]")
    if min(Dn, Dv) < 1:
        raise ValueError(f"head dims must be positive (Dn {Dn}, Dv {Dv})")
    if not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be positive and finite, got {sm_scale}")
    return T, H, Dn, Dr, Dv, L


def _check_start(T: int, L: int, start) -> int:
    start = L - T if start is None else int(start)
    if start < 0 or start + T > L:
        raise ValueError(f"need 0 <= start and start + T <= L (start {start}, T {T}, L {L})")
    return start


def _check_out(out, T, H, Dv, q):
    if out is None:
        return torch.empty(T, H, Dv, dtype=q.dtype, device=q.device)
    if out.shape != (T, H, Dv) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be [{T}, {H}, {Dv}] {q.dtype} on {q.device}, got {tuple(out.shape)} {out.dtype}")
    if out.numel() and out.stride(2) != 1:
        raise ValueError("out must be contiguous in its last dim")
    return out


def _launch(q, k_nope, k_rope, v, out, sm_scale, cfg, S, blocks_m, B, start=0, cu=None):
    """One kernel launch (+ the combine when S > 1); cu = (cu_q, cu_k, starts or None) for VARLEN."""
    T, H, D = q.shape
    Dn, Dv = k_nope.shape[2], v.shape[2]
    if not available(q.device):
        raise RuntimeError(f"mla_prefill: Triton kernels unavailable on {q.device}: {why_unavailable(q.device)}")
    fp32 = q.dtype == torch.float32
    # Dot operands in the input dtype; FP32 under the interpreter, whose BF16 tl.dot is wrong in triton 3.6.
    cdt = tl.float32 if fp32 or interpreting() else (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16)
    part = lse = out  # placeholders when unsplit
    if S > 1:
        part = torch.empty(S, T, H, Dv, dtype=torch.float32, device=q.device)
        lse = torch.empty(S, T, H, dtype=torch.float32, device=q.device)
    cu_q, cu_k, st = cu or (out, out, None)
    _mla_prefill_kernel[(blocks_m, H, B * S)](
        q, k_nope, k_rope, v, out, part, lse, cu_q, cu_k, cu_q if st is None else st,
        float(sm_scale) * LOG2E, T, H, start, S,
        q.stride(0), q.stride(1), k_nope.stride(0), k_nope.stride(1), k_rope.stride(0),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        DN=Dn, DR=D - Dn, DV=Dv, BLOCK_DN=_pad(Dn), BLOCK_DR=_pad(D - Dn), BLOCK_DV=_pad(Dv),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CDT=cdt, PREC="ieee" if fp32 else "tf32", SPLIT=S > 1,
        VARLEN=cu is not None, HAS_START=st is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if S > 1:
        _combine_kernel[(T, H)](part, lse, out, T, H, S, out.stride(0), out.stride(1),
                                DV=Dv, BLOCK_S=triton.next_power_of_2(S), BLOCK_DV=_pad(Dv), num_warps=COMBINE_WARPS)
    return out


def mla_prefill(q, k_nope, k_rope, v, sm_scale: float, start: int | None = None, out=None,
                config: PrefillConfig | None = None) -> torch.Tensor:
    """Causal MLA prefill attention. q [T, H, Dn+Dr], k_nope [L, H, Dn], k_rope [L, Dr] (shared by
    the heads), v [L, H, Dv], all one dtype; start (default L - T) is the position of query 0.
    Returns out [T, H, Dv] in q.dtype (written into `out` when given). FP32 accumulation."""
    T, H, Dn, Dr, Dv, L = _check(q, k_nope, k_rope, v, sm_scale)
    start = _check_start(T, L, start)
    out = _check_out(out, T, H, Dv, q)
    if T == 0 or H == 0:
        return out
    cfg = config or pick_config(Dn, Dr, Dv, q.dtype, T)
    S = pick_splits(T, start + T, H, cfg, q.device)
    return _launch(q, k_nope, k_rope, v, out, sm_scale, cfg, S, triton.cdiv(T, cfg.block_m), 1, start=start)


def _varlen_lists(cu_seqlens_q, cu_seqlens_k, starts, T, L):
    """Host copies of the per-sequence bounds (one device sync), validated: (cu_q, cu_k, starts) lists."""
    cq, ck = ([int(x) for x in c.tolist()] if isinstance(c, torch.Tensor) else [int(x) for x in c]
              for c in (cu_seqlens_q, cu_seqlens_k))
    if len(cq) != len(ck) or len(cq) < 2 or cq[0] != 0 or ck[0] != 0 or cq[-1] != T or ck[-1] != L:
        raise ValueError(f"cu_seqlens_q / _k must be [B + 1] prefix sums from 0 to T={T} / L={L}: {cq} / {ck}")
    tq = [b - a for a, b in zip(cq, cq[1:])]
    lk = [b - a for a, b in zip(ck, ck[1:])]
    if min(tq) < 0 or min(lk) < 0:
        raise ValueError(f"cu_seqlens must not decrease: {cq} / {ck}")
    st = [None] * len(tq) if starts is None else [int(x) for x in (starts.tolist() if isinstance(starts, torch.Tensor)
                                                                   else starts)]
    if len(st) != len(tq):
        raise ValueError(f"starts has {len(st)} entries for {len(tq)} sequences")
    return cq, ck, [_check_start(t, n, s) for t, n, s in zip(tq, lk, st)]


def mla_prefill_varlen(q, k_nope, k_rope, v, cu_seqlens_q, cu_seqlens_k, sm_scale: float, starts=None, out=None,
                       config: PrefillConfig | None = None) -> torch.Tensor:
    """Several sequences in one launch. Sequence b owns q / out rows cu_seqlens_q[b] : cu_seqlens_q[b+1]
    and key rows cu_seqlens_k[b] : cu_seqlens_k[b+1] (int prefix sums, [B + 1], tensors or lists);
    its first query sits at position starts[b] (default L_b - T_b). Same math and layout rules as
    mla_prefill per sequence; the bounds are read on the host once (a device sync) to validate
    them and size the grid for the longest sequence."""
    T, H, Dn, Dr, Dv, L = _check(q, k_nope, k_rope, v, sm_scale)
    cq, ck, st = _varlen_lists(cu_seqlens_q, cu_seqlens_k, starts, T, L)
    out = _check_out(out, T, H, Dv, q)
    tq = [b - a for a, b in zip(cq, cq[1:])]
    if T == 0 or H == 0:
        return out
    cfg = config or pick_config(Dn, Dr, Dv, q.dtype, max(tq))
    blocks = sum(triton.cdiv(t, cfg.block_m) for t in tq)
    S = _splits(blocks * H, max(s + t for s, t in zip(st, tq)), cfg, q.device)
    dev = lambda x: torch.tensor(x, dtype=torch.int32, device=q.device)  # noqa: E731
    cu = (dev(cq), dev(ck), None if starts is None else dev(st))
    return _launch(q, k_nope, k_rope, v, out, sm_scale, cfg, S, triton.cdiv(max(tq), cfg.block_m), len(tq), cu=cu)


def mla_prefill_reference(q, k_nope, k_rope, v, sm_scale: float, start: int | None = None, out=None) -> torch.Tensor:
    """FP32 PyTorch twin of mla_prefill: explicit scores per query chunk, causal mask, softmax.
    Returns FP32 [T, H, Dv], or writes into `out` (cast to its dtype) and returns it."""
    T, H, Dn, Dr, Dv, L = _check(q, k_nope, k_rope, v, sm_scale)
    start = _check_start(T, L, start)
    res = torch.empty(T, H, Dv, dtype=torch.float32, device=q.device)
    kn, kr, vf = k_nope.float(), k_rope.float(), v.float()
    keys = torch.arange(L, device=q.device)
    chunk = max(1, REF_CHUNK_BYTES // max(1, 4 * H * L))
    for t0 in range(0, T, chunk):
        qc = q[t0:t0 + chunk].float()
        s = torch.einsum("thd,lhd->htl", qc[..., :Dn], kn) + torch.einsum("thd,ld->htl", qc[..., Dn:], kr)
        pos = start + torch.arange(t0, t0 + qc.shape[0], device=q.device)
        s = (s * sm_scale).masked_fill(keys[None, None, :] > pos[None, :, None], float("-inf"))
        res[t0:t0 + qc.shape[0]] = torch.einsum("htl,lhd->thd", torch.softmax(s, dim=-1), vf)
    return res if out is None else _check_out(out, T, H, Dv, q).copy_(res)


def mla_prefill_varlen_reference(q, k_nope, k_rope, v, cu_seqlens_q, cu_seqlens_k, sm_scale: float, starts=None,
                                 out=None) -> torch.Tensor:
    """FP32 twin of mla_prefill_varlen: the single-sequence reference on each sequence's rows."""
    T, H, Dn, Dr, Dv, L = _check(q, k_nope, k_rope, v, sm_scale)
    cq, ck, st = _varlen_lists(cu_seqlens_q, cu_seqlens_k, starts, T, L)
    res = torch.empty(T, H, Dv, dtype=torch.float32, device=q.device)
    for b, s in enumerate(st):
        (a, e), (ka, ke) = cq[b:b + 2], ck[b:b + 2]
        res[a:e] = mla_prefill_reference(q[a:e], k_nope[ka:ke], k_rope[ka:ke], v[ka:ke], sm_scale, start=s)
    return res if out is None else _check_out(out, T, H, Dv, q).copy_(res)
