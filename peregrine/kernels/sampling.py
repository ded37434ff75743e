"""Greedy and sampled tokens on the device: no host synchronisation, no sort.

Everything stays on the device with static shapes, so both are CUDA-graph
capturable. argmax reduces over the vocabulary in two stages: many programs per
row each find the best of one chunk, then one program per row picks the best
chunk, ties to the lowest index (torch.argmax's rule).

sample: temperature, min-p, top-k, top-p (vLLM's order). The kept set is every
token whose logit/T reaches a per-row threshold, found without sorting by
bisection over the float's 2^32 ordered keys (the largest key whose count, or
probability mass, above it still reaches top-k, or top-p of the mass left). At a
real vocabulary the search first runs over the candidates within CUT of the row's
max, collected in one pass over many programs (_chunk_max, _collect, _select:
exact whenever they hold the answer, which _select can tell), and only the rows
they cannot settle (flat rows: high temperature, a wide nucleus) take the descent
over the whole row (_descend: a launch a level, the row's chunks in parallel, each
level testing RADIX_NB pivots, so 8 levels settle the 32 bits). _threshold, the
same search in one program a row (32 passes a bit), serves small vocabularies.
Then one draw with the exponential race (Gumbel-max): token = argmax over kept i
of x_i - log E_i, E_i ~ Exp(1) from Philox keyed by (seed, token id,
position), which picks i with probability p_i / sum of the kept p. A request's
token depends only on its logits, parameters, seed and position, never on the
batch it shares, a graph replay or a step launched ahead.
Ties at a threshold stay (all of them); NaN logits are not supported.
sample_ref is the same sampler in PyTorch with sorting, and the same random bits.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import interpreting
from .pdl import launch_kwargs, pdl_wait

BLOCK_V = 4096  # vocab chunk per program: 163840 -> 40 programs per row even at B = 1
SMALL_VOCAB = 4096  # up to this vocabulary a program takes several rows (tests, tiny models)
THRESHOLD_TILE = 4096  # elements of one [rows, chunk] tile of the threshold search
NO_INDEX = tl.constexpr(2**31 - 1)  # "no valid element" in a chunk; larger than any vocab index
U_SCALE = tl.constexpr(2.0**-23)  # uniforms from the top 23 random bits: (x + 0.5)·2^-23 is exact and inside (0, 1)
CUT = tl.constexpr(12.0)  # candidates: logit/T within this of the row's max (p > 6e-6 of the top token's)
CAND_CAP = 128  # candidates one vocab chunk may hold (40 chunks at 163 840: 5 120 per row); past it, the full search
SEARCH_ENV = "PEREGRINE_SAMPLE_SEARCH"  # "candidates" (default), "radix" or "bisect": the threshold search, for A/B runs
SEARCHES = ("candidates", "radix", "bisect")
RADIX_NB = 16  # pivots a level: 8 levels of [256, 16] steps; 64 (6 of [64, 64]) took 4x as long at B = 8 (H100)
RADIX_ACC = 4096  # a level's [tile, nb] register accumulator (32 a thread at 4 warps): tile = RADIX_ACC // nb
RADIX_TILE = RADIX_ACC // RADIX_NB  # elements a step of a level takes at the default pivots
RADIX_TILE_INTERPRET = 1024  # the interpreter pays per step, not per element
DESCENT_MIN_BLOCK = 1024  # smallest row slice a descent program weighs: B = 1 gets 160 programs at 163 840
DESCENT_PROGRAMS = 256  # descent programs a level aims for (about two per SM) before slices grow
DESCENT_BLOCK_ENV = "PEREGRINE_SAMPLE_DESCENT_BLOCK"  # a fixed slice for every B, for A/B runs
SMALL_W = tl.constexpr(2.0**-10)  # below this 1 − u, -log(u) is taken from its series (log(≈1) loses digits)


@triton.jit
def _chunk_best(score, pos, ok, pmax_ptr, pidx_ptr, out_at):
    best = tl.max(score, axis=0)
    at = tl.min(tl.where(ok & (score == best), pos, NO_INDEX), axis=0)
    tl.store(pmax_ptr + out_at, best)
    tl.store(pidx_ptr + out_at, at)


@triton.jit
def _argmax_stage1(x_ptr, stride_x, V, pmax_ptr, pidx_ptr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # no weights: everything read comes from earlier kernels
    row = tl.program_id(0)
    c = tl.program_id(1)
    pos = c * BLOCK + tl.arange(0, BLOCK)
    ok = pos < V
    v = tl.load(x_ptr + row.to(tl.int64) * stride_x + pos, mask=ok, other=float("-inf")).to(tl.float32)
    _chunk_best(v, pos, ok, pmax_ptr, pidx_ptr, row * tl.num_programs(1) + c)


@triton.jit
def _stage2(pmax_ptr, pidx_ptr, out_ptr, n_chunks, CBLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    r = tl.arange(0, CBLOCK)
    ok = r < n_chunks
    m = tl.load(pmax_ptr + row * n_chunks + r, mask=ok, other=float("-inf"))
    i = tl.load(pidx_ptr + row * n_chunks + r, mask=ok, other=NO_INDEX)
    best = tl.max(m, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(ok & (m == best), i, NO_INDEX), axis=0).to(tl.int64))


def _two_stage(stage1, args, B: int, V: int, device) -> torch.Tensor:
    n_chunks = triton.cdiv(V, BLOCK_V)
    pmax = torch.empty((B, n_chunks), dtype=torch.float32, device=device)
    pidx = torch.empty((B, n_chunks), dtype=torch.int32, device=device)
    out = torch.empty((B,), dtype=torch.int64, device=device)
    if B == 0:
        return out
    pdl = launch_kwargs(device)
    stage1[(B, n_chunks)](*args, pmax, pidx, BLOCK=BLOCK_V, num_warps=8, **pdl)
    _stage2[(B,)](pmax, pidx, out, n_chunks, CBLOCK=max(triton.next_power_of_2(n_chunks), 16), num_warps=1, **pdl)
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64, lowest index on ties."""
    assert logits.dim() == 2 and logits.stride(1) == 1
    B, V = logits.shape
    return _two_stage(_argmax_stage1, (logits, logits.stride(0), V), B, V, logits.device)


@triton.jit
def _key(x):
    """float32 -> int32 with the same order (signed compare): thresholds are searched over these."""
    b = x.to(tl.float32).to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _scaled(x_ptr, stride_x, rows, rok, t, c, V, BLOCK: tl.constexpr):
    """One chunk of R rows' logits / temperature ([R, BLOCK] FP32, -inf outside), and its in-range mask."""
    pos = c + tl.arange(0, BLOCK)
    ok = rok[:, None] & (pos < V)[None, :]
    ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + pos[None, :]
    x = tl.load(ptrs, mask=ok, other=float("-inf")).to(tl.float32) / t[:, None]
    return x, ok, pos


@triton.jit
def _threshold(x_ptr, stride_x, B, V, temp_ptr, topk_ptr, topp_ptr, minp_ptr, key_ptr,
               R: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Per row, the smallest key of logits/temperature that stays in the kept set: min-p, then top-k,
    then top-p of what is left (vLLM's order), each a threshold found without sorting: the largest
    key whose count (top-k) or probability mass (top-p) above it still reaches the target, by
    bisection over the 2^32 keys (32 passes over the row each). A program whose rows need no top-k
    (or top-p) skips those passes; one of greedy rows only reads nothing."""
    pdl_wait(USE_PDL)
    rows = tl.program_id(0) * R + tl.arange(0, R)
    rok = rows < B
    t = tl.load(temp_ptr + rows, mask=rok, other=0.0)
    live = rok & (t > 0)  # greedy rows need no threshold: a program of only those reads nothing
    t = tl.where(t > 0, t, 1.0)
    m = tl.full((R,), float("-inf"), tl.float32)
    for c in range(0, tl.max(live.to(tl.int32), axis=0) * V, BLOCK):
        x, ok, _pos = _scaled(x_ptr, stride_x, rows, rok, t, c, V, BLOCK)
        m = tl.maximum(m, tl.max(x, axis=1))
    m = tl.where(rok, m, 0.0)
    min_p = tl.load(minp_ptr + rows, mask=rok, other=0.0)
    lo = tl.where(min_p > 0, _key(m + tl.log(tl.maximum(min_p, 1e-38))), -2147483648).to(tl.int64)
    top = _key(m).to(tl.int64) + 1  # nothing is >= this key
    k = tl.load(topk_ptr + rows, mask=rok, other=0).to(tl.int64)
    k = tl.where((k > 0) & (k < V), k, V + 1)  # off: no key reaches V + 1 tokens, lo stays
    hi = top
    for _it in range(32 * tl.max((live & (k <= V)).to(tl.int32), axis=0)):  # top-k: count(key >= lo) >= k > count(key >= hi)
        mid = lo + (hi - lo) // 2
        cnt = tl.zeros((R,), tl.int64)
        for c in range(0, V, BLOCK):
            x, ok, _pos = _scaled(x_ptr, stride_x, rows, rok, t, c, V, BLOCK)
            cnt += tl.sum((ok & (_key(x).to(tl.int64) >= mid[:, None])).to(tl.int64), axis=1)
        take = cnt >= k
        lo, hi = tl.where(take, mid, lo), tl.where(take, hi, mid)
    top_p = tl.load(topp_ptr + rows, mask=rok, other=1.0)
    need_p = tl.max((live & (top_p < 1.0)).to(tl.int32), axis=0)  # 0: no row of this program cuts a nucleus
    mass = tl.zeros((R,), tl.float32)
    for c in range(0, need_p * V, BLOCK):
        x, ok, _pos = _scaled(x_ptr, stride_x, rows, rok, t, c, V, BLOCK)
        mass += tl.sum(tl.where(ok & (_key(x).to(tl.int64) >= lo[:, None]), tl.exp(x - m[:, None]), 0.0), axis=1)
    target = tl.where(top_p < 1.0, top_p * mass, float("inf"))  # off: no mass reaches it, lo stays
    hi = top
    for _it2 in range(32 * need_p):  # top-p: mass(key >= lo) >= target > mass(key >= hi)
        mid = lo + (hi - lo) // 2
        acc = tl.zeros((R,), tl.float32)
        for c in range(0, V, BLOCK):
            x, ok, _pos = _scaled(x_ptr, stride_x, rows, rok, t, c, V, BLOCK)
            acc += tl.sum(tl.where(ok & (_key(x).to(tl.int64) >= mid[:, None]), tl.exp(x - m[:, None]), 0.0), axis=1)
        take = acc >= target
        lo, hi = tl.where(take, mid, lo), tl.where(take, hi, mid)
    tl.store(key_ptr + rows, lo.to(tl.int32), mask=rok)


@triton.jit
def _chunk_max(x_ptr, stride_x, V, temp_ptr, cmax_ptr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Candidate search, pass 1: the max of logits/T over one chunk of one row."""
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    rows = row + tl.arange(0, 1)
    t = tl.load(temp_ptr + rows)
    x, ok, _pos = _scaled(x_ptr, stride_x, rows, rows >= 0, tl.where(t > 0, t, 1.0), c * BLOCK, V, BLOCK)
    tl.store(cmax_ptr + row * tl.num_programs(1) + c + tl.arange(0, 1), tl.max(x, axis=1))


@triton.jit
def _collect(x_ptr, stride_x, V, temp_ptr, cmax_ptr, cmass_ptr, ccnt_ptr, cx_ptr, BLOCK: tl.constexpr,
             CB: tl.constexpr, CAP: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Pass 2: over one chunk, the mass exp(x - max) and the candidates x >= max - CUT, written in order to the
    chunk's own CAP slots (no atomics: every sum later runs in a fixed order, so the result is deterministic)."""
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    nc = tl.num_programs(1)
    r = tl.arange(0, CB)
    m = tl.max(tl.load(cmax_ptr + row * nc + r, mask=r < nc, other=float("-inf")), axis=0)
    rows = row + tl.arange(0, 1)
    t = tl.load(temp_ptr + rows)
    x, ok, _pos = _scaled(x_ptr, stride_x, rows, rows >= 0, tl.where(t > 0, t, 1.0), c * BLOCK, V, BLOCK)
    cand = ok & (x >= m - CUT)
    slot = tl.cumsum(cand.to(tl.int32), axis=1) - 1
    at = (row * nc + c) * CAP
    tl.store(cx_ptr + at + slot, x, mask=cand & (slot < CAP))
    out = row * nc + c + tl.arange(0, 1)
    tl.store(cmass_ptr + out, tl.sum(tl.where(ok, tl.exp(x - m), 0.0), axis=1))
    tl.store(ccnt_ptr + out, tl.sum(cand.to(tl.int32), axis=1))


@triton.jit
def _select(V, n_chunks, temp_ptr, topk_ptr, topp_ptr, minp_ptr, cmax_ptr, cmass_ptr, ccnt_ptr, cx_ptr, key_ptr,
            need_ptr, CB: tl.constexpr, CAP: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Pass 3, one program per row: _threshold's searches over the row's candidates in registers. They settle
    the row exactly when every token at or above the answer is a candidate: no chunk overflowed its CAP, top-k's
    k-th token (or min-p's bound) is at or above the cut, and the candidates hold top-p's mass; else need = 1
    and _threshold searches the whole row."""
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    r = tl.arange(0, CB)
    rok = r < n_chunks
    m = tl.max(tl.load(cmax_ptr + row * n_chunks + r, mask=rok, other=float("-inf")), axis=0)
    cnt = tl.load(ccnt_ptr + row * n_chunks + r, mask=rok, other=0)
    mass_all = tl.sum(tl.load(cmass_ptr + row * n_chunks + r, mask=rok, other=0.0), axis=0)
    j = tl.arange(0, CAP)
    valid = rok[:, None] & (j[None, :] < cnt[:, None])
    x = tl.load(cx_ptr + (row * n_chunks + r)[:, None] * CAP + j[None, :], mask=valid, other=float("-inf"))
    e = tl.where(valid, tl.exp(x - m), 0.0)
    cut = _key(m - CUT).to(tl.int64)
    min_p = tl.load(minp_ptr + row)
    lo = tl.where(min_p > 0, _key(m + tl.log(tl.maximum(min_p, 1e-38))), -2147483648).to(tl.int64)
    lo0 = lo
    top = _key(m).to(tl.int64) + 1
    k = tl.load(topk_ptr + row).to(tl.int64)
    k_on = (k > 0) & (k < V)
    kk = tl.where(k_on, k, V + 1)
    hi = top
    # a chunk past its CAP: the candidates cannot settle the row (the descent will), so neither search runs
    # (flat rows, as dummy weights give, overflow every chunk; the candidate passes cost them 30 / 37 us at
    # B = 1 / 8 beyond the descent alone on an H100, these searches' 64 passes the bulk of their work)
    overflow = tl.max(cnt, axis=0) > CAP
    for _it in range(32 * (k_on & ~overflow).to(tl.int32)):
        mid = lo + (hi - lo) // 2
        take = tl.sum(tl.sum((valid & (_key(x).to(tl.int64) >= mid)).to(tl.int64), axis=1), axis=0) >= kk
        lo, hi = tl.where(take, mid, lo), tl.where(take, hi, mid)
    n_lo0 = tl.sum(tl.sum((valid & (_key(x).to(tl.int64) >= lo0)).to(tl.int64), axis=1), axis=0)
    ok_k = (~k_on) | (n_lo0 >= k) | (lo0 >= cut)  # the k-th is a candidate, or min-p binds above the cut
    cand_mass = tl.sum(tl.sum(tl.where(_key(x).to(tl.int64) >= lo, e, 0.0), axis=1), axis=0)
    known = (lo >= cut) | (lo == -2147483648)  # the mass above lo: the candidates', or the whole row's
    mass = tl.where(lo >= cut, cand_mass, mass_all)
    top_p = tl.load(topp_ptr + row)
    p_on = top_p < 1.0
    target = tl.where(p_on, top_p * mass, float("inf"))
    ok_p = (~p_on) | (known & (cand_mass >= target))
    hi = top
    for _it2 in range(32 * (p_on & ~overflow).to(tl.int32)):
        mid = lo + (hi - lo) // 2
        take = tl.sum(tl.sum(tl.where(_key(x).to(tl.int64) >= mid, e, 0.0), axis=1), axis=0) >= target
        lo, hi = tl.where(take, mid, lo), tl.where(take, hi, mid)
    settled = (~k_on & ~p_on) | (~overflow & ok_k & ok_p)
    tl.store(key_ptr + row, lo.to(tl.int32))
    tl.store(need_ptr + row, (~settled).to(tl.int32))


@triton.jit
def _pick(part_ptr, row, nc, lo, hi, target, NB: tl.constexpr, CB: tl.constexpr):
    """One level of the descent, decided: of [lo, hi)'s NB pivots lo + j·w, the largest whose S (count or
    mass of keys >= it, the row's chunks summed in a fixed order) reaches target, and the sub-bracket it opens
    (j = 0 when none does: the bound already holds at lo, as top-k's when min-p leaves fewer than k)."""
    w = (hi - lo + NB - 1) // NB
    j = tl.arange(0, NB)
    r = tl.arange(0, CB)
    rd = (r < nc) & (hi - lo > 1)  # a bracket of one key was not weighed: nothing to read
    s = tl.sum(tl.load(part_ptr + (row * nc + r)[:, None] * NB + j[None, :], mask=rd[:, None], other=0.0), axis=0)
    ok = (lo + j.to(tl.int64) * w < hi) & (s >= target)
    nlo = lo + tl.max(tl.where(ok, j, 0), axis=0).to(tl.int64) * w
    return nlo, tl.minimum(nlo + w, hi)


@triton.jit
def _descend(x_ptr, stride_x, V, nc, nd, temp_ptr, topk_ptr, topp_ptr, minp_ptr, cmax_ptr, need_ptr, prev_part_ptr,
             prev_brk_ptr, p0_part_ptr, part_ptr, brk_ptr, key_ptr, MASS: tl.constexpr, START: tl.constexpr,
             FIRST: tl.constexpr, FINAL: tl.constexpr, HAS_NEED: tl.constexpr, BLOCK: tl.constexpr,
             NB: tl.constexpr, TILE: tl.constexpr, CB: tl.constexpr, CBD: tl.constexpr, USE_PDL: tl.constexpr = False):
    """The whole-row threshold search spread over the row's nd chunks of BLOCK: a level per launch, each narrowing
    the row's key bracket [lo, hi) NB-fold (_pick, from the last level's per-chunk counts or masses), then counting
    (top-k: MASS = 0) or weighing (top-p: MASS = 1) this chunk's keys at the new bracket's NB pivots. top-k's
    levels come first, from min-p's bound, then top-p's from top-k's answer (vLLM's order); a row with either
    off gets the bracket [lo, lo + 1) there, so its levels read nothing. START: the first launch (no level
    before it: the bracket comes from min-p; top-p's levels start there when no row of the batch uses top-k).
    FIRST: a phase's first level. FINAL: the last pick, the key. nc: cmax's chunks (the row's max)."""
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    live = t > 0
    if HAS_NEED:  # after the candidate search: only the rows it could not settle
        live = live & (tl.load(need_ptr + row) != 0)
    if live:
        r = tl.arange(0, CB)
        m = tl.max(tl.load(cmax_ptr + row * nc + r, mask=r < nc, other=float("-inf")), axis=0)
        top = _key(m).to(tl.int64) + 1  # nothing is >= this key
        top_p = tl.load(topp_ptr + row)
        if START:
            min_p = tl.load(minp_ptr + row)
            lo = tl.where(min_p > 0, _key(m + tl.log(tl.maximum(min_p, 1e-38))), -2147483648).to(tl.int64)
            if MASS:
                hi = tl.where(top_p < 1.0, top, lo + 1)
            else:
                k = tl.load(topk_ptr + row)
                hi = tl.where((k > 0) & (k < V), top, lo + 1)
        else:
            lo = tl.load(prev_brk_ptr + row * 2)
            hi = tl.load(prev_brk_ptr + row * 2 + 1)
            rd = tl.arange(0, CBD)
            if (FINAL or MASS) and not FIRST:  # top-p's target: top_p of the mass at its first level's lo
                target = top_p * tl.sum(tl.load(p0_part_ptr + (row * nd + rd) * NB, mask=rd < nd, other=0.0), axis=0)
            else:
                target = tl.load(topk_ptr + row).to(tl.float32)  # counts to 2^24 are exact in FP32
            lo, hi = _pick(prev_part_ptr, row, nd, lo, hi, target, NB, CBD)
            if FIRST:
                hi = tl.where(top_p < 1.0, top, lo + 1)
        if FINAL:
            tl.store(key_ptr + row, lo.to(tl.int32))
        else:
            if c == 0:
                tl.store(brk_ptr + row * 2, lo)
                tl.store(brk_ptr + row * 2 + 1, hi)
            if hi - lo > 1:
                w = (hi - lo + NB - 1) // NB
                piv = tl.minimum(lo + tl.arange(0, NB).to(tl.int64) * w, 2147483647).to(tl.int32)  # past hi: unused
                tt = tl.where(t > 0, t, 1.0)
                # a [TILE, NB] register accumulator, reduced once after the loop: a reduction across the
                # tile's rows every step (shuffles and shared memory) would sit in the loop's critical path
                acc = tl.zeros((TILE, NB), tl.float32)
                for s in range(0, BLOCK, TILE):
                    pos = c * BLOCK + s + tl.arange(0, TILE)
                    ok = pos < V
                    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + pos, mask=ok, other=float("-inf"))
                    x = x.to(tl.float32) / tt
                    ge = ok[:, None] & (_key(x)[:, None] >= piv[None, :])
                    if MASS:
                        acc += tl.where(ge, tl.exp(x - m)[:, None], 0.0)
                    else:
                        acc += ge.to(tl.float32)
                tl.store(part_ptr + (row * nd + c) * NB + tl.arange(0, NB), tl.sum(acc, axis=0))


def descent_levels(nb: int) -> int:
    """Levels that narrow the 2^32 keys to one, nb-fold each."""
    w, n = 2**32, 0
    while w > 1:
        w, n = -(-w // nb), n + 1
    return n


def descent_block(B: int, V: int) -> int:
    """Elements of a row one descent program weighs: the smallest power of two from DESCENT_MIN_BLOCK that still
    gives B x chunks >= DESCENT_PROGRAMS (a level is a loop of dependent loads: small B needs many short programs
    to fill the GPU, large B fewer, longer ones, as each level's pick reads every chunk's NB partials);
    PEREGRINE_SAMPLE_DESCENT_BLOCK overrides, for A/B runs."""
    env = os.environ.get(DESCENT_BLOCK_ENV)
    if env:
        return max(RADIX_TILE, triton.next_power_of_2(int(env)))
    block = DESCENT_MIN_BLOCK
    while block < BLOCK_V and B * triton.cdiv(V, 2 * block) >= DESCENT_PROGRAMS:
        block *= 2
    return block


def _descent(logits, temp, top_k, top_p, min_p, cmax, keys, need, nb: int = 0, top_k_any: bool = True,
             block: int = 0):
    """Launch _descend's levels (top-k's unless no row uses top-k, top-p's, the final pick) for every live row
    (need None) or the rows need marks; keys: [B] int32, written for those rows. top_k_any False: the caller
    vouches that every row's top_k is 0 (off) or >= V, so top-k's levels are not launched at all."""
    B, V = logits.shape
    nb = nb or RADIX_NB
    nc = cmax.shape[1]
    L = descent_levels(nb)
    block = block or descent_block(B, V)
    nd = triton.cdiv(V, block)
    dev = logits.device
    phases = (0, 1) if top_k_any else (1,)  # MASS of each phase's L levels
    n = len(phases) * L
    part = torch.empty((n, B, nd, nb), dtype=torch.float32, device=dev)
    brk = torch.empty((n, B, 2), dtype=torch.int64, device=dev)
    tile = min(block, RADIX_TILE_INTERPRET if interpreting() else max(16, RADIX_ACC // nb))
    common = dict(HAS_NEED=need is not None, BLOCK=block, NB=nb, TILE=tile, CB=max(triton.next_power_of_2(nc), 16),
                  CBD=max(triton.next_power_of_2(nd), 16), num_warps=4, **launch_kwargs(dev))
    args = (logits, logits.stride(0), V, nc, nd, temp, top_k, top_p, min_p, cmax, need if need is not None else keys)
    p0 = n - L  # top-p's first level
    for i in range(n + 1):
        prev, cur = max(i - 1, 0), min(i, n - 1)
        _descend[(B, 1 if i == n else nd)](
            *args, part[prev], brk[prev], part[p0], part[cur], brk[cur], keys,
            MASS=i < n and phases[i // L] == 1, START=i == 0, FIRST=i % L == 0 and i < n, FINAL=i == n, **common)


@triton.jit
def _race_stage1(x_ptr, stride_x, B, V, temp_ptr, key_ptr, seed_ptr, pos_ptr, pmax_ptr, pidx_ptr,
                 R: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Gumbel race over one chunk of R rows: kept token i scores x_i - log(E_i), E_i ~ Exp(1) from
    Philox keyed by (seed, token id, position), so the best score is token i with probability p_i / sum
    of the kept p. Greedy rows (temperature 0) score the raw logits, no noise: their argmax."""
    pdl_wait(USE_PDL)
    rows = tl.program_id(0) * R + tl.arange(0, R)
    rok = rows < B
    c = tl.program_id(1)
    t0 = tl.load(temp_ptr + rows, mask=rok, other=0.0)
    greedy = t0 <= 0
    x, ok, pos = _scaled(x_ptr, stride_x, rows, rok, tl.where(greedy, 1.0, t0), c * BLOCK, V, BLOCK)
    keep = ok & ((_key(x) >= tl.load(key_ptr + rows, mask=rok, other=0)[:, None]) | greedy[:, None])
    seed = tl.load(seed_ptr + rows, mask=rok, other=0)
    p = tl.load(pos_ptr + rows, mask=rok, other=0)
    zero = tl.zeros((R, BLOCK), dtype=tl.uint32)
    c1 = zero + (p & 0xFFFFFFFF).to(tl.uint32)[:, None]
    c2 = zero + ((p >> 32) & 0xFFFFFFFF).to(tl.uint32)[:, None]
    r, _, _, _ = tl.philox(seed[:, None] + tl.zeros((R, BLOCK), dtype=tl.int64), zero + pos.to(tl.uint32)[None, :],
                           c1, c2, zero)
    u = (r >> 9).to(tl.float32)
    w = (8388607.5 - u) * U_SCALE  # 1 - u', exact
    e = tl.where(w < SMALL_W, w + 0.5 * w * w, -tl.log((u + 0.5) * U_SCALE))  # Exp(1) draw, always > 0
    score = tl.where(keep, tl.where(greedy[:, None], x, x - tl.log(e)), float("-inf"))
    best = tl.max(score, axis=1)
    at = tl.min(tl.where(keep & (score == best[:, None]), pos[None, :], NO_INDEX), axis=1)
    out = rows * tl.num_programs(1) + c
    tl.store(pmax_ptr + out, best, mask=rok)
    tl.store(pidx_ptr + out, at, mask=rok)


@triton.jit
def _race_stage2(pmax_ptr, pidx_ptr, out_ptr, B, n_chunks, R: tl.constexpr, CBLOCK: tl.constexpr,
                 USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    rows = tl.program_id(0) * R + tl.arange(0, R)
    rok = rows < B
    r = tl.arange(0, CBLOCK)
    ok = rok[:, None] & (r < n_chunks)[None, :]
    at = rows[:, None] * n_chunks + r[None, :]
    m = tl.load(pmax_ptr + at, mask=ok, other=float("-inf"))
    i = tl.load(pidx_ptr + at, mask=ok, other=NO_INDEX)
    best = tl.max(m, axis=1)
    tl.store(out_ptr + rows, tl.min(tl.where(ok & (m == best[:, None]), i, NO_INDEX), axis=1).to(tl.int64), mask=rok)


def _rows_per_program(B: int, V: int) -> int:
    """Rows one program takes: 1 for a real vocabulary (a row's chunks spread over the GPU); a small
    vocabulary packs rows into one [rows, vocab] tile, so the interpreter runs few programs for many draws."""
    if V > SMALL_VOCAB:
        return 1
    return max(1, min(triton.next_power_of_2(max(B, 1)), THRESHOLD_TILE // triton.next_power_of_2(V)))


def search_mode() -> str:
    import os
    v = os.environ.get(SEARCH_ENV, "candidates")
    if v not in SEARCHES:
        raise ValueError(f"{SEARCH_ENV} must be one of {', '.join(SEARCHES)}, got {v!r}")
    return v


def thresholds(logits, temp, top_k, top_p, min_p, R: int, search: str | None = None, nb: int = 0,
               top_k_any: bool = True):
    """Each row's threshold key ([B] int32; greedy rows: unused) and, with the candidate search, which rows needed
    the whole-row one ([B] int32, else None). R: rows per program (the candidate and radix searches take R = 1
    only). search: "candidates" (then the descent for the rows they cannot settle), "radix" (the descent for
    every row), "bisect" (_threshold, one program a row). nb: the descent's pivots a level (default RADIX_NB)."""
    B, V = logits.shape
    dev = logits.device
    keys = torch.empty((B,), dtype=torch.int32, device=dev)
    pdl = launch_kwargs(dev)
    tb = min(triton.next_power_of_2(V), max(16, THRESHOLD_TILE // R))
    search = search or search_mode()
    if R == 1 and search != "bisect":
        nc = triton.cdiv(V, BLOCK_V)
        cmax = torch.empty((B, nc), dtype=torch.float32, device=dev)
        _chunk_max[(B, nc)](logits, logits.stride(0), V, temp, cmax, BLOCK=BLOCK_V, num_warps=8, **pdl)
        need = None
        if search == "candidates":
            cb = max(triton.next_power_of_2(nc), 16)
            cmass, ccnt = torch.empty_like(cmax), torch.empty((B, nc), dtype=torch.int32, device=dev)
            cx = torch.empty((B, nc, CAND_CAP), dtype=torch.float32, device=dev)
            need = torch.empty((B,), dtype=torch.int32, device=dev)
            _collect[(B, nc)](logits, logits.stride(0), V, temp, cmax, cmass, ccnt, cx, BLOCK=BLOCK_V, CB=cb,
                              CAP=CAND_CAP, num_warps=8, **pdl)
            _select[(B,)](V, nc, temp, top_k, top_p, min_p, cmax, cmass, ccnt, cx, keys, need, CB=cb, CAP=CAND_CAP,
                          num_warps=8, **pdl)
        _descent(logits, temp, top_k, top_p, min_p, cmax, keys, need, nb, top_k_any)
        return keys, need
    _threshold[(triton.cdiv(B, R),)](logits, logits.stride(0), B, V, temp, top_k, top_p, min_p, keys, R=R, BLOCK=tb, num_warps=8 if R == 1 else 4, **pdl)
    return keys, None


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor, min_p: torch.Tensor | None = None,
           out: torch.Tensor | None = None, search: str | None = None, nb: int = 0,
           top_k_any: bool = True) -> torch.Tensor:
    """[B, V] logits -> [B] int64 tokens, on the device with no host sync and static shapes (CUDA-graph
    capturable). Per row: temperature (0 = greedy: the argmax), min_p, top_k (0 = off), top_p (1 = off),
    then one draw keyed by (seed, position): a row's token depends on its logits, parameters, seed and
    position only, never on the batch. No sort: the kept set is {logits/T >= a threshold} (thresholds()).
    out: a [B] int64 buffer to write (a graph's static output), else a new one. search: the threshold search
    (thresholds(); default PEREGRINE_SAMPLE_SEARCH or candidates); nb: the descent's pivots a level.
    top_k_any: False only when no row's top_k is in (0, V): top-k's descent levels are then not launched."""
    assert logits.dim() == 2 and logits.stride(1) == 1
    B, V = logits.shape
    dev = logits.device
    if out is None:
        out = torch.empty((B,), dtype=torch.int64, device=dev)
    assert out.shape == (B,) and out.dtype == torch.int64 and out.is_contiguous()
    if B == 0:
        return out
    R = _rows_per_program(B, V)
    f32 = lambda t: t.to(device=dev, dtype=torch.float32).contiguous()  # noqa: E731
    i64 = lambda t: t.to(device=dev, dtype=torch.int64).contiguous()  # noqa: E731
    temp = f32(temperature)
    mp = f32(min_p) if min_p is not None else torch.zeros(B, dtype=torch.float32, device=dev)
    keys, _ = thresholds(logits, temp, i64(top_k), f32(top_p), mp, R, search, nb, top_k_any)
    pdl = launch_kwargs(dev)
    grid_r = triton.cdiv(B, R)
    block = BLOCK_V if R == 1 else min(triton.next_power_of_2(V), max(16, THRESHOLD_TILE // R))
    n_chunks = triton.cdiv(V, block)
    pmax = torch.empty((B, n_chunks), dtype=torch.float32, device=dev)
    pidx = torch.empty((B, n_chunks), dtype=torch.int32, device=dev)
    _race_stage1[(grid_r, n_chunks)](logits, logits.stride(0), B, V, temp, keys, i64(seeds), i64(positions), pmax,
                                     pidx, R=R, BLOCK=block, num_warps=8 if R == 1 else 4, **pdl)
    _race_stage2[(grid_r,)](pmax, pidx, out, B, n_chunks, R=R, CBLOCK=max(triton.next_power_of_2(n_chunks), 16),
                            num_warps=1, **pdl)
    return out


def filtered_probs_ref(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                       min_p: float = 0.0) -> torch.Tensor:
    """FP64 reference of one row's sampling distribution, by sorting: temperature, min-p (against the
    most likely token), top-k, then the nucleus of what is left (a token stays while the mass ranked
    before it is < top_p of the kept mass)."""
    q = torch.softmax(logits.double() / temperature, -1)
    if min_p > 0:
        q = torch.where(q >= min_p * q.max(), q, 0.0)
    qs, order = torch.sort(q, descending=True, stable=True)
    kk = top_k if 0 < top_k < q.numel() else q.numel()
    qs, order = qs[:kk], order[:kk]
    keep = (torch.cumsum(qs, 0) - qs) < top_p * qs.sum() if top_p < 1 else qs > 0
    keep[0] = True
    out = torch.zeros_like(q)
    out[order[keep]] = qs[keep]
    return out / out.sum()


M32 = 0xFFFFFFFF
PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)  # Philox4x32-10's multipliers and key increments, as tl.philox uses them
PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)


def _mul32(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * b for a, b < 2^32 in int64, without int64 overflow (16-bit halves)."""
    p, q = (a & 0xFFFF) * b, (a >> 16) * b  # each < 2^48
    s = p + ((q & 0xFFFF) << 16)
    return ((q >> 16) + (s >> 32)) & M32, s & M32


def philox_ref(seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor) -> torch.Tensor:
    """First output word of Philox4x32-10 keyed by seed (64-bit) at counter (c0, c1, c2, 0), as int64:
    the same bits as tl.philox(seed, c0, c1, c2, 0)[0]. Broadcasts its arguments."""
    k0, k1 = seed & M32, (seed >> 32) & M32
    c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi0, lo0 = _mul32(c2, PHILOX_ROUND[1])
        hi1, lo1 = _mul32(c0, PHILOX_ROUND[0])
        c0, c1, c2, c3 = hi0 ^ c1 ^ k0, lo0, hi1 ^ c3 ^ k1, lo1
        k0, k1 = (k0 + PHILOX_KEY[0]) & M32, (k1 + PHILOX_KEY[1]) & M32
    return c0


def exp_draws_ref(seeds: torch.Tensor, positions: torch.Tensor, V: int) -> torch.Tensor:
    """[B, V] FP32 Exp(1) draws, the race kernel's E_i: Philox keyed by (seed, token id, position)."""
    dev = seeds.device
    tok = torch.arange(V, dtype=torch.int64, device=dev)[None, :]
    pos = positions.long()[:, None]
    r = philox_ref(seeds.long()[:, None], tok, pos & M32, (pos >> 32) & M32)
    u = (r >> 9).float()
    w = (8388607.5 - u) * 2.0**-23
    return torch.where(w < 2.0**-10, w + 0.5 * w * w, -torch.log((u + 0.5) * 2.0**-23))


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               seeds: torch.Tensor, positions: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The sampler in plain PyTorch with sorting (the kernel's reference, and the CPU engine's sampler):
    the kept set from filtered_probs_ref, then the same keyed race: argmax over kept i of
    logits_i / T - log E_i. Greedy rows (temperature 0): the argmax."""
    B, V = logits.shape
    x = logits.float()
    out = x.argmax(dim=-1)
    rows = [i for i in range(B) if float(temperature[i]) > 0]
    if not rows:
        return out
    r = torch.tensor(rows, device=logits.device)
    e = exp_draws_ref(seeds[r], positions[r], V)
    for j, i in enumerate(rows):
        t = temperature[i].float()
        keep = filtered_probs_ref(x[i], float(t), int(top_k[i]), float(top_p[i]),
                                  float(min_p[i]) if min_p is not None else 0.0) > 0
        score = torch.where(keep, x[i] / t - torch.log(e[j]), float("-inf"))
        out[i] = score.argmax()
    return out


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().argmax(dim=-1)
