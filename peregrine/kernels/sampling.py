"""Greedy and top-k / top-p sampling with no host synchronisation.

Everything stays on the device with static shapes, so both are CUDA-graph
capturable. Both reduce over the vocabulary in two stages: many programs per
row each find the best of one chunk, then one program per row picks the best
chunk, ties to the lowest index (torch.argmax's rule).

Sampling draws from the kept set with the exponential race: token =
argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d., which picks i with probability
p_i / Σ p. E_i comes from Philox keyed by (seed, offset, token id), so a
request's draw depends only on its own logits and (seed, offset), never on
the batch it shares or on the sort order of equal probabilities.
NaN logits are not supported.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_kwargs, pdl_wait

BLOCK_V = 4096  # vocab chunk per program: 163840 -> 40 programs per row even at B = 1
NO_INDEX = tl.constexpr(2**31 - 1)  # "no valid element" in a chunk; larger than any vocab index
U_SCALE = tl.constexpr(2.0**-23)  # uniforms from the top 23 random bits: (x + 0.5)·2^-23 is exact and inside (0, 1)
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
def _sample_stage1(p_ptr, tok_ptr, stride_p, stride_t, nkeep_ptr, seed_ptr, off_ptr, pmax_ptr, pidx_ptr,
                   BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Scores p / E over the sorted probabilities; positions >= n_keep are out of the set."""
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    pos = c * BLOCK + tl.arange(0, BLOCK)
    ok = pos < tl.load(nkeep_ptr + row)
    p = tl.load(p_ptr + row.to(tl.int64) * stride_p + pos, mask=ok, other=0.0)
    tok = tl.load(tok_ptr + row.to(tl.int64) * stride_t + pos, mask=ok, other=0)
    seed = tl.load(seed_ptr + row)
    off = tl.load(off_ptr + row)
    zero = tl.zeros((BLOCK,), dtype=tl.uint32)
    c1 = zero + (off & 0xFFFFFFFF).to(tl.uint32)
    c2 = zero + ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)
    r, _, _, _ = tl.philox(seed, tok.to(tl.uint32), c1, c2, zero)
    x = (r >> 9).to(tl.float32)
    u = (x + 0.5) * U_SCALE
    w = (8388607.5 - x) * U_SCALE  # 1 − u, exact
    e = tl.where(w < SMALL_W, w + 0.5 * w * w, -tl.log(u))  # Exp(1) draw, always > 0
    score = tl.where(ok, p / e, -1.0)
    _chunk_best(score, pos, ok, pmax_ptr, pidx_ptr, row * tl.num_programs(1) + c)


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


def kept_counts(probs_sorted: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """How many of the descending-sorted probabilities each row keeps: top-k first, then the
    nucleus of the renormalised top-k (a token stays while the mass before it is < top_p);
    always >= 1. top_k 0 and top_p >= 1 mean off. The kept set is a prefix of the sort."""
    B, V = probs_sorted.shape
    rank = torch.arange(V, device=probs_sorted.device)
    k_eff = torch.where(top_k > 0, top_k.clamp(max=V), V).long()[:, None]
    in_k = rank[None, :] < k_eff
    csum = (probs_sorted.double() * in_k).cumsum(-1)  # FP64: the tail must not saturate the sum
    mass_k = csum.gather(1, k_eff - 1)
    before = csum - probs_sorted.double()
    n_p = ((before < top_p.double()[:, None] * mass_k) & in_k).sum(-1)
    n = torch.where(top_p >= 1.0, k_eff[:, 0], n_p)
    return n.clamp(min=1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[B, V] logits -> [B] int64 tokens. temperature 0 = greedy for that row."""
    assert logits.dim() == 2
    B, V = logits.shape
    greedy = argmax(logits)
    t = torch.where(temperature > 0, temperature, 1.0).float()
    probs = torch.softmax(logits.float() / t[:, None], dim=-1)
    ps, order = probs.sort(dim=-1, descending=True, stable=True)  # stable: ties cut by index, batch-invariant
    n_keep = kept_counts(ps, top_k, top_p)
    args = (ps, order, ps.stride(0), order.stride(0), n_keep, seeds.long().contiguous(), offsets.long().contiguous())
    pos = _two_stage(_sample_stage1, args, B, V, logits.device)
    drawn = order.gather(1, pos[:, None])[:, 0]
    return torch.where(temperature > 0, drawn, greedy)


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().argmax(dim=-1)
