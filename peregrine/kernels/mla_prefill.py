"""MLA prefill attention, non-absorbed (MODELS.md "MLA layer"; NoPE, causal, one sequence).

T new queries at absolute positions start … start+T-1 attend over L keys at 0 … L-1 (the
cached prefix plus the new tokens; start = L - T unless given):
    s[h,t,j] = (q_n[t,h]·k_n[j,h] + q_r[t,h]·k_r[j]) · sm_scale,  visible iff j <= start + t,
    o[t,h]   = softmax_j(s[h,t,:]) @ v[:,h].
k_r is one [L, Dr] tensor shared by all heads (never expanded). k_n and v may be strided
views of one [L, H, Dn+Dv] tensor and k_r of the [L, 576] latent: only the last dims must
be contiguous.

Flash attention: grid (query blocks, H), a program owns BLOCK_M queries of one head and
walks the keys in BLOCK_N steps with an online softmax (exp2, log2 e folded into the scale,
FP32 statistics and accumulator); the T×L scores never exist. Key blocks every query of the
program sees run unmasked; the few on the causal diagonal run masked; blocks past the
diagonal are never visited (half the work at start = 0). Query blocks are launched latest
first, so the longest causal rows start early and the short ones fill the tail.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

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
CONFIGS = {(128, 64, 128): PrefillConfig()}
FP32_CONFIG = PrefillConfig(64, 32, 4, 2)     # FP32 tiles are twice the bytes (GPU tests, interpreter)
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


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SMS


def pick_splits(T: int, L: int, H: int, cfg: PrefillConfig, device) -> int:
    """KV splits: 1 when the (query block, head) grid already fills the SMs; else as many as fill
    one wave (rounded down), but none under MIN_SPLIT_KEYS keys. Few queries over a long prefix
    (a turn-2 prefix hit: T = 64, 32 heads = 32 programs on 132 SMs) is the case it is for."""
    if cfg.num_splits:
        return min(cfg.num_splits, MAX_SPLITS)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    programs = triton.cdiv(T, cfg.block_m) * H
    return max(1, min(MAX_SPLITS, _num_sms(dev) // programs, L // MIN_SPLIT_KEYS))


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
    q_ptr, kn_ptr, kr_ptr, v_ptr, o_ptr, part_ptr, lse_ptr, qk_scale, T, H, start,
    s_qt, s_qh, s_knl, s_knh, s_krl, s_vl, s_vh, s_ot, s_oh,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr,
    SPLIT: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # latest queries (most keys) first
    h = tl.program_id(1)
    m0 = pid_m * BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    t_ok = m0 + rows < T
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
    # `hi` to none of them (hi <= start + T <= L: keys no query sees are never read).
    full = (start + m0 + 1) // BLOCK_N * BLOCK_N
    hi = start + tl.minimum(T, m0 + BLOCK_M)
    if SPLIT:  # this program's share of [0, hi): BLOCK_N-aligned, so no block straddles two splits
        sp = tl.program_id(2)
        chunk = tl.cdiv(tl.cdiv(hi, tl.num_programs(2)), BLOCK_N) * BLOCK_N
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
        prow = (sp * T + m0 + rows).to(tl.int64) * H + h
        tl.store(part_ptr + prow[:, None] * DV + dv[None, :], acc / tl.maximum(l_i, L_FLOOR)[:, None], mask=om)
        tl.store(lse_ptr + prow, m_i + tl.log2(tl.maximum(l_i, L_FLOOR)), mask=t_ok)  # l = 0 only with m = -inf: lse -inf
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


def _check(q, k_nope, k_rope, v, sm_scale, start):
    """(T, H, Dn, Dr, Dv, L, start) after validating shapes, dtypes, devices and strides."""
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
    start = L - T if start is None else int(start)
    if start < 0 or start + T > L:
        raise ValueError(f"need 0 <= start and start + T <= L (start {start}, T {T}, L {L})")
    if not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be positive and finite, got {sm_scale}")
    return T, H, Dn, Dr, Dv, L, start


def _check_out(out, T, H, Dv, q):
    if out.shape != (T, H, Dv) or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be [{T}, {H}, {Dv}] {q.dtype} on {q.device}, got {tuple(out.shape)} {out.dtype}")
    if out.numel() and out.stride(2) != 1:
        raise ValueError("out must be contiguous in its last dim")


def mla_prefill(q, k_nope, k_rope, v, sm_scale: float, start: int | None = None, out=None,
                config: PrefillConfig | None = None) -> torch.Tensor:
    """Causal MLA prefill attention. q [T, H, Dn+Dr], k_nope [L, H, Dn], k_rope [L, Dr] (shared by
    the heads), v [L, H, Dv], all one dtype; start (default L - T) is the position of query 0.
    Returns out [T, H, Dv] in q.dtype (written into `out` when given). FP32 accumulation."""
    T, H, Dn, Dr, Dv, L, start = _check(q, k_nope, k_rope, v, sm_scale, start)
    if out is None:
        out = torch.empty(T, H, Dv, dtype=q.dtype, device=q.device)
    _check_out(out, T, H, Dv, q)
    if T == 0 or H == 0:
        return out
    if not available(q.device):
        raise RuntimeError(f"mla_prefill: Triton kernels unavailable on {q.device}: {why_unavailable(q.device)}")
    cfg = config or pick_config(Dn, Dr, Dv, q.dtype, T)
    fp32 = q.dtype == torch.float32
    # Dot operands in the input dtype; FP32 under the interpreter, whose BF16 tl.dot is wrong in triton 3.6.
    cdt = tl.float32 if fp32 or interpreting() else (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16)
    S = pick_splits(T, start + T, H, cfg, q.device)
    part = lse = out  # placeholders when unsplit
    if S > 1:
        part = torch.empty(S, T, H, Dv, dtype=torch.float32, device=q.device)
        lse = torch.empty(S, T, H, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(T, cfg.block_m), H, S)
    _mla_prefill_kernel[grid](
        q, k_nope, k_rope, v, out, part, lse, float(sm_scale) * LOG2E, T, H, start,
        q.stride(0), q.stride(1), k_nope.stride(0), k_nope.stride(1), k_rope.stride(0),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        DN=Dn, DR=Dr, DV=Dv, BLOCK_DN=_pad(Dn), BLOCK_DR=_pad(Dr), BLOCK_DV=_pad(Dv),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CDT=cdt, PREC="ieee" if fp32 else "tf32", SPLIT=S > 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if S > 1:
        _combine_kernel[(T, H)](part, lse, out, T, H, S, out.stride(0), out.stride(1),
                                DV=Dv, BLOCK_S=triton.next_power_of_2(S), BLOCK_DV=_pad(Dv), num_warps=COMBINE_WARPS)
    return out


def mla_prefill_reference(q, k_nope, k_rope, v, sm_scale: float, start: int | None = None, out=None) -> torch.Tensor:
    """FP32 PyTorch twin of mla_prefill: explicit scores per query chunk, causal mask, softmax.
    Returns FP32 [T, H, Dv], or writes into `out` (cast to its dtype) and returns it."""
    T, H, Dn, Dr, Dv, L, start = _check(q, k_nope, k_rope, v, sm_scale, start)
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
    if out is None:
        return res
    _check_out(out, T, H, Dv, q)
    return out.copy_(res)
