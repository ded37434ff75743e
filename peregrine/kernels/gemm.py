"""Skinny GEMM for decode: y = x @ w.T with x [M, K] (M = 1..16; verify steps up to 64), w [N, K].

At M <= 16 the GEMM is a weight-streaming problem: every program owns a tile
of N, reads its rows of w exactly once and produces all M rows from that one
load. Two variants share one kernel body:
  plain   grid (N tiles, 1, M tiles), writes y directly;
  splitk  grid (N tiles, SPLIT_K, M tiles), writes FP32 partials to a
          workspace, then a second kernel sums them in a fixed order
          (bitwise reproducible run to run); with "reduce": "inline" the
          last program of a tile to arrive (an arrival counter, reset by it
          for the next launch) sums them in the same order: one launch less.
With "prefetch" each program keeps two weight tiles in flight (the next step's load is issued
before this step's math), not one: Triton does not pipeline these loads itself.
grouped_gemm runs G independent products side by side (block-diagonal w) in
the same launch: each N tile reads its group's K columns of x.
Inner product either on tensor cores (tl.dot, rows padded to 16; 17..64 rows in one tile of 32 or 64,
so a verify step's weights stream once, not once per 16 rows) or as FMAs into a [BM, BN, BK]
accumulator reduced once at the end (cheap for M <= 4).
gemm_plan.json maps "M,N,K" -> config, measured on the GPU by
peregrine.bench.kernels_gemm --tune; other shapes use `heuristic`.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from peregrine.kernels import batch_invariant, interpreting
from peregrine.kernels.pdl import launch_kwargs, pdl_wait

PLAN_PATH = Path(__file__).with_name("gemm_plan.json")
NUM_SMS = 132  # H200; the heuristic aims for >= 2 waves of programs
DOT_MIN_ROWS = 16  # tl.dot needs >= 16 rows; smaller M is zero-padded
WIDE_MAX_ROWS = 64  # verify steps (B x T rows): up to 64 rows in one M tile, so each weight tile streams once
FMA_MAX_ROWS = 4  # above this the FMA path does too much ALU work per weight byte
FMA_ACC_REGS = 64  # FP32 accumulator registers per thread for the FMA path (no spills at 64)
MAX_SPLIT_K = 16  # more partials cost more workspace traffic than they save
SUPPORTED = (torch.bfloat16, torch.float32)


@triton.jit
def _tile(ptrs, row_ok, kk, K, EVEN_K: tl.constexpr):
    """One [rows, BLOCK_K] tile at columns kk (zero past K or past the valid rows)."""
    if EVEN_K:
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    return tl.load(ptrs, mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def _tile_if(ptrs, row_ok, kk, K, live, EVEN_K: tl.constexpr):
    """_tile, or zeros with nothing read when `live` is false (the prefetch past a split's last step)."""
    if EVEN_K:
        return tl.load(ptrs, mask=row_ok[:, None] & live, other=0.0)
    return tl.load(ptrs, mask=row_ok[:, None] & (kk < K)[None, :] & live, other=0.0)


@triton.jit
def _mac(acc, xk, wk, USE_DOT: tl.constexpr, IEEE: tl.constexpr):
    if USE_DOT:
        if IEEE:  # FP32 operands: exact FP32 products, not TF32 (see _use_ieee)
            acc = tl.dot(xk.to(tl.float32), tl.trans(wk.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(xk.to(tl.bfloat16), tl.trans(wk.to(tl.bfloat16)), acc)
    else:
        acc += xk.to(tl.float32)[:, None, :] * wk.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_ys, k_per_split,
                 out_ptr, stride_om, count_ptr, group_n,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_DOT: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, INLINE_REDUCE: tl.constexpr = False,
                 PREFETCH: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k0 = pid_s * k_per_split
    m_ok = rm < M
    n_ok = rn < N
    # grouped_gemm: the tile's group (BLOCK_N divides group_n) reads its own K columns of x; 0: ungrouped.
    # Arithmetic, not a branch between pointers (that once cost the loads their pipelining)
    x_col = tl.where(group_n > 0, (pid_n * BLOCK_N) // tl.maximum(group_n, 1) * K, 0)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (x_col + k0 + rk)[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :]
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = 0
    if USE_PDL:  # first step peeled: its weight tile (and the next, prefetching) streams in before the wait
        wk = _tile(w_ptrs, n_ok, k0 + rk, K, EVEN_K)
        if PREFETCH:
            wn = _tile_if(w_ptrs + BLOCK_K, n_ok, k0 + BLOCK_K + rk, K, BLOCK_K < k_per_split, EVEN_K)
        pdl_wait(USE_PDL)
        acc = _mac(acc, _tile(x_ptrs, m_ok, k0 + rk, K, EVEN_K), wk, USE_DOT, IEEE)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        k_start = BLOCK_K
    elif PREFETCH:
        wn = _tile(w_ptrs, n_ok, k0 + rk, K, EVEN_K)
    if PREFETCH:  # register double buffer: two weight tiles in flight per program, not one
        for k in range(k_start, k_per_split, BLOCK_K):
            wk = wn
            wn = _tile_if(w_ptrs + BLOCK_K, n_ok, k0 + k + BLOCK_K + rk, K, k + BLOCK_K < k_per_split, EVEN_K)
            acc = _mac(acc, _tile(x_ptrs, m_ok, k0 + k + rk, K, EVEN_K), wk, USE_DOT, IEEE)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    else:
        for k in range(k_start, k_per_split, BLOCK_K):
            xk = _tile(x_ptrs, m_ok, k0 + k + rk, K, EVEN_K)
            wk = _tile(w_ptrs, n_ok, k0 + k + rk, K, EVEN_K)
            acc = _mac(acc, xk, wk, USE_DOT, IEEE)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if not USE_DOT:
        acc = tl.sum(acc, axis=2)
    y_ptrs = y_ptr + pid_s.to(tl.int64) * stride_ys + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)
    if INLINE_REDUCE:  # y is the FP32 workspace; the tile's last program to arrive writes out
        tl.debug_barrier()  # every thread's partial is stored before the release below
        c_ptr = count_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(c_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:
            tl.debug_barrier()
            ws_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
            tot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(tl.num_programs(1)):  # fixed order: the same bits as the reduce kernel
                tot += tl.load(ws_ptrs + s * stride_ys, mask=ok, other=0.0, cache_modifier=".cg")
            o_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
            tl.store(o_ptrs, tot.to(out_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(c_ptr, 0)  # ready for the next launch (graph replays included)


@triton.jit
def _splitk_reduce_kernel(ws_ptr, y_ptr, N, stride_ws_s, stride_ws_m, stride_ym,
                          SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # every input is the GEMM's workspace
    m = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(ws_ptr + s * stride_ws_s + m * stride_ws_m + rn, mask=ok, other=0.0)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=ok)


REDUCE_BLOCK = 1024  # the reduction is tiny (SPLIT_K * M * N floats); one wide tile per program
COUNTERS = 1 << 20  # arrival counters per device (4 MB); launches take consecutive ranges, wrapping
_counters: dict = {}


def arrival_counters(device, tiles: int) -> torch.Tensor:
    """`tiles` zeroed int32 counters no launch still in flight uses: the next range of a per-device
    ring (each launch's last arrivals reset theirs). A step's launches, a side stream's among them,
    take ranges far apart; a CUDA graph keeps the ranges it captured, and replays run one at a time."""
    assert tiles <= COUNTERS // 64, f"{tiles} output tiles: too many for the inline split-K reduce"
    key = str(device)
    if key not in _counters:
        _counters[key] = [torch.zeros(COUNTERS, dtype=torch.int32, device=device), 0]
    buf, at = _counters[key]
    if at + tiles > COUNTERS:
        at = 0
    _counters[key][1] = at + tiles
    return buf[at:at + tiles]


def skinny_gemm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """FP32 reference: x @ w.T."""
    return x.float() @ w.float().t()


def heuristic(M: int, N: int, K: int) -> dict:
    """A config for shapes not in the plan. Triton does not software-pipeline these loads
    (no cp.async in the PTX), so the bytes in flight per program are one BN x BK tile:
    make it ~16 KB, and have enough programs to fill the GPU twice."""
    dot = M > FMA_MAX_ROWS
    warps = 4
    block_n = next((b for b in (64, 32) if triton.cdiv(N, b) >= 2 * NUM_SMS), 16)
    if dot:
        block_k = 256 if block_n <= 32 else 128
    else:  # FMA accumulator BM x BN x BK fp32 within ~64 registers per thread
        bm = min(triton.next_power_of_2(M), FMA_MAX_ROWS)
        block_n = 16
        warps = 4 if bm == 1 else 8
        block_k = min(512, FMA_ACC_REGS * 32 * warps // (bm * block_n))
    block_k = min(block_k, max(DOT_MIN_ROWS, triton.next_power_of_2(K)))  # no all-masked tail
    tiles = triton.cdiv(N, block_n)
    split = 1
    while tiles * split < 2 * NUM_SMS and K >= split * 2 * 2 * block_k and split < MAX_SPLIT_K:
        split *= 2
    return {"kernel": "splitk" if split > 1 else "plain", "BLOCK_N": block_n, "BLOCK_K": block_k,
            "SPLIT_K": split, "num_warps": warps, "num_stages": 2, "dot": dot, "reduce": "kernel", "prefetch": False}


PLAN_ENV = "PEREGRINE_GEMM_PLAN"  # another plan file, for A/B runs of a freshly tuned plan


@functools.cache
def load_plan(path: str | None = None) -> dict:
    p = Path(path or os.environ.get(PLAN_ENV) or PLAN_PATH)
    if not p.exists():
        return {}
    return json.loads(p.read_text()).get("entries", {})


def plan_key(M: int, N: int, K: int) -> str:
    return f"{M},{N},{K}"


@functools.cache
def invariant_config(N: int, K: int) -> dict:
    """Batch-invariant mode's config for every M: tl.dot on 16-row tiles (one MMA shape), the tiles and split-K of
    (N, K) alone, no cuBLAS: each row's reduction over K is the same whatever the rows beside it."""
    return {**heuristic(FMA_MAX_ROWS + 1, N, K), "dot": True, "BLOCK_M": DOT_MIN_ROWS}


PREFILL_INVARIANT_TILE = (64, 128, 64)  # (BLOCK_M, BLOCK_N, BLOCK_K) of the standard path's GEMMs in batch-invariant
#   mode: one wgmma-sized tile for every row count, no split-K, so a token's row sums over K in one order in any step


@functools.cache
def prefill_invariant_config(N: int, K: int) -> dict:
    """Batch-invariant mode's config for the standard path (prefill steps, any M): one tile, no split-K, never
    cuBLAS (whose kernel depends on M). Its rows differ in bits from the decode config's (invariant_config):
    a token is computed by one of the two, and each is invariant on its own."""
    bm, bn, bk = PREFILL_INVARIANT_TILE
    return {"kernel": "plain", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1, "num_warps": 4,
            "num_stages": 3, "dot": True, "reduce": "kernel", "prefetch": False}


def lookup(M: int, N: int, K: int) -> dict:
    return invariant_config(N, K) if batch_invariant() else _lookup(M, N, K)


@functools.lru_cache(maxsize=4096)
def _lookup(M: int, N: int, K: int) -> dict:
    """The plan's config for (M, N, K); for an M the plan was not tuned at (verify steps: B·T rows, e.g. 3, 5-7),
    that of the smallest tuned M' > M of the same (N, K): its tiles hold M's rows too (the rest masked) and the
    kernel streams the same weights. The heuristic only where no M' >= M was tuned: at M = 3 it had taken
    0.44 ms for the 48B's lm_head where M = 4's plan entry takes 0.18, and verify steps at T = 3 cost more
    than at T = 4 (H200, results/2026-12-05-session29)."""
    plan = load_plan()
    entry = plan.get(plan_key(M, N, K))
    if entry is None:
        tuned = [m for m in _tuned_rows(N, K) if m > M]
        entry = plan[plan_key(min(tuned), N, K)] if tuned else None
    cfg = heuristic(M, N, K)
    if entry is not None:
        cfg.update({k: v for k, v in entry.items() if k in cfg})
    return cfg


@functools.cache
def _tuned_rows(N: int, K: int) -> tuple[int, ...]:
    """The Ms the plan has an entry for at this (N, K)."""
    out = []
    for key in load_plan():
        m, n, k = map(int, key.split(","))
        if (n, k) == (N, K):
            out.append(m)
    return tuple(sorted(out))


def _check_2d(t: torch.Tensor, name: str) -> None:
    assert t.dim() == 2 and t.stride(1) == 1, f"{name} must be 2-D with unit inner stride"
    assert t.dtype in SUPPORTED, f"{name}: dtype {t.dtype} not supported"


def _output(out, M: int, N: int, x: torch.Tensor) -> torch.Tensor:
    """`out` checked as a [M, N] unit-stride destination, or a new one in x's dtype."""
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    assert y.shape == (M, N), f"out shape {tuple(y.shape)} != {(M, N)}"
    _check_2d(y, "out")
    return y


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                config: dict | None = None) -> torch.Tensor:
    """y = x @ w.T, FP32 accumulation, y in x.dtype (or written into `out`, which may be
    a row-strided view such as a column slice of a wider buffer). `config` overrides the plan."""
    lead = x.shape[:-1]
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    M, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K, f"K mismatch: x {tuple(x.shape)}, w {tuple(w.shape)}"
    _check_2d(x, "x")
    _check_2d(w, "w")
    y = _output(out, M, N, x)
    if M == 0:
        return y
    cfg = config or lookup(M, N, K)
    launch(x, w, y, cfg)
    return y.reshape(*lead, N) if out is None and len(lead) != 1 else y


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, groups: int, out: torch.Tensor | None = None,
                 config: dict | None = None) -> torch.Tensor:
    """G = `groups` skinny GEMMs in one launch: x [M, G·K] (G inputs side by side), w [G·N, K]
    (their weights stacked) -> y [M, G·N], y[:, gN:(g+1)N] = x[:, gK:(g+1)K] @ w[gN:(g+1)N].T.
    The single problem's config (plan entry of (M, N, K)), so the bits equal G skinny_gemm calls."""
    M, GK = x.shape
    GN, K = w.shape
    N = GN // groups
    assert GK == groups * K and GN == groups * N, f"x {tuple(x.shape)}, w {tuple(w.shape)}: not {groups} groups"
    _check_2d(x, "x")
    _check_2d(w, "w")
    assert w.is_contiguous(), "w must be contiguous"
    y = _output(out, M, GN, x)
    if M == 0:
        return y
    cfg = config or lookup(M, N, K)
    if cfg["kernel"] == "torch":  # cuBLAS has no such layout: one call per group, as the separate path
        for g in range(groups):
            launch(x[:, g * K:(g + 1) * K], w[g * N:(g + 1) * N], y[:, g * N:(g + 1) * N], cfg)
        return y
    assert N % cfg["BLOCK_N"] == 0, f"BLOCK_N {cfg['BLOCK_N']} must divide N {N}: a tile would straddle two groups"
    launch(x, w, y, cfg, group_n=N)
    return y


def groupable(M: int, N: int, K: int) -> bool:
    """Whether grouped_gemm can take groups of (N, K) at M rows with the plan's config."""
    cfg = lookup(M, N, K)
    return cfg["kernel"] == "torch" or N % cfg["BLOCK_N"] == 0


def _use_ieee(x, w) -> bool:
    # FP32 operands need an IEEE dot (Triton's default is TF32). The Triton 3.6 interpreter
    # returns garbage for BF16 tl.dot, so there BF16 operands are widened to FP32 (exact).
    return (x.dtype == torch.float32 and w.dtype == torch.float32) or interpreting()


def tiling(M: int, N: int, K: int, cfg: dict) -> tuple[tuple[int, int, int], int, dict]:
    """(grid, K per split, the kernel's tile meta) of a Triton config (not "torch")."""
    assert cfg["kernel"] in ("plain", "splitk"), f"no split-K tiling for kernel {cfg['kernel']!r}"
    bn, bk, split = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"] if cfg["kernel"] == "splitk" else 1
    dot = cfg.get("dot", M > FMA_MAX_ROWS)
    bm = min(max(DOT_MIN_ROWS, triton.next_power_of_2(M)), WIDE_MAX_ROWS) if dot else min(triton.next_power_of_2(M),
                                                                                            FMA_MAX_ROWS)
    bm = cfg.get("BLOCK_M", bm)  # batch-invariant mode: one tile height for every M
    k_per = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_per)  # drop splits that would start past K
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, USE_DOT=dot, EVEN_K=k_per * split == K,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return (triton.cdiv(N, bn), split, triton.cdiv(M, bm)), k_per, meta


def launch(x, w, y, cfg: dict, group_n: int = 0) -> None:
    """y = x @ w.T by `cfg`; group_n > 0: block-diagonal, N tiles of group g read x's g-th K columns."""
    M, K = x.shape[0], w.shape[1]
    N = w.shape[0]
    if cfg["kernel"] == "torch":  # the plan picked cuBLAS: it measured faster for this shape
        assert group_n == 0, "grouped_gemm runs cuBLAS configs one group at a time"
        if y.is_contiguous():
            torch.matmul(x, w.t(), out=y)
        else:
            y.copy_(torch.matmul(x, w.t()))
        return
    grid, k_per, tile = tiling(M, N, K, cfg)
    split = grid[1]
    meta = dict(tile, IEEE=_use_ieee(x, w), PREFETCH=bool(cfg.get("prefetch", False)), **launch_kwargs(x.device))
    if split == 1:
        _gemm_kernel[grid](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), 0, k_per, y, 0, y, group_n, **meta)
        return
    ws = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    if cfg.get("reduce") == "inline":
        count = arrival_counters(x.device, grid[0] * grid[2])
        _gemm_kernel[grid](x, w, ws, M, N, K, x.stride(0), w.stride(0), N, M * N, k_per, y, y.stride(0), count,
                           group_n, INLINE_REDUCE=True, **meta)
        return
    _gemm_kernel[grid](x, w, ws, M, N, K, x.stride(0), w.stride(0), N, M * N, k_per, y, 0, ws, group_n, **meta)
    rgrid = (triton.cdiv(N, REDUCE_BLOCK), M)
    _splitk_reduce_kernel[rgrid](ws, y, N, M * N, N, y.stride(0), SPLIT_K=split, BLOCK=REDUCE_BLOCK, num_warps=4,
                                 **launch_kwargs(x.device))
