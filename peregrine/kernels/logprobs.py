"""A decode step's logprobs on the device in two launches, capturable, with no sort and no host sync.

Each row's chosen token's log-probability and its top LOGPROBS_TOP alternatives, = log_softmax(logits) without
materialising it. Pass 1, many programs a row (one vocab chunk each): the chunk's max, its sum of exp(x - max)
and its own top K (K rounds of max, the lowest index on ties). Pass 2, one program a row: the row's logsumexp
from the chunks' (max, sum) pairs, the top K of the chunks' candidates (a token of the row's top K is in its
chunk's top K), the chosen token's logit. It replaces torch's logsumexp + topk + gather (token_logprobs_ref,
also its reference), which with logprobs 5 cost the 48B's step ~0.11 ms at B = 1 on an H100 (not broken down by
launch). NaN logits are not supported.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import available
from .pdl import launch_kwargs, pdl_wait

LOGPROBS_TOP = 20  # alternatives computed in the step: the most a request may ask for (engine/logprobs.py)
BLOCK_V = 4096     # vocab chunk a pass-1 program takes: 163 840 -> 40 programs a row
NO_INDEX = tl.constexpr(2**31 - 1)  # "no candidate": past every vocab index


@triton.jit
def _chunk_top(x_ptr, stride_x, V, cmax_ptr, csum_ptr, cval_ptr, cidx_ptr, BLOCK: tl.constexpr, K: tl.constexpr,
               KP: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    out = row * tl.num_programs(1) + c
    pos = c * BLOCK + tl.arange(0, BLOCK)
    live = pos < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + pos, mask=live, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    tl.store(cmax_ptr + out, m)
    tl.store(csum_ptr + out, tl.sum(tl.where(live, tl.exp(x - m), 0.0), axis=0))
    j = tl.arange(0, KP)
    vals = tl.full((KP,), float("-inf"), tl.float32)
    idxs = tl.full((KP,), NO_INDEX, tl.int32)
    for i in range(K):  # the chunk's i-th largest: fewer than K tokens left leave NO_INDEX
        best = tl.max(tl.where(live, x, float("-inf")), axis=0)
        at = tl.min(tl.where(live & (x == best), pos, NO_INDEX), axis=0)
        vals = tl.where(j == i, best, vals)
        idxs = tl.where(j == i, at, idxs)
        live = live & (pos != at)
    tl.store(cval_ptr + out * KP + j, vals)
    tl.store(cidx_ptr + out * KP + j, idxs)


@triton.jit
def _row_merge(x_ptr, stride_x, tok_ptr, nc, cmax_ptr, csum_ptr, cval_ptr, cidx_ptr, chosen_ptr, topi_ptr, topv_ptr,
               K: tl.constexpr, KP: tl.constexpr, CB: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    r = tl.arange(0, CB)
    rok = r < nc
    cm = tl.load(cmax_ptr + row * nc + r, mask=rok, other=float("-inf"))
    m = tl.max(cm, axis=0)
    lse = m + tl.log(tl.sum(tl.where(rok, tl.load(csum_ptr + row * nc + r, mask=rok, other=0.0) * tl.exp(cm - m),
                                     0.0), axis=0))
    j = tl.arange(0, KP)
    at2 = (row * nc + r)[:, None] * KP + j[None, :]
    v = tl.load(cval_ptr + at2, mask=rok[:, None], other=float("-inf"))
    idx = tl.load(cidx_ptr + at2, mask=rok[:, None], other=NO_INDEX)
    live = idx != NO_INDEX
    for i in range(K):  # ties: the lowest index first
        best = tl.max(tl.max(tl.where(live, v, float("-inf")), axis=1), axis=0)
        at = tl.min(tl.min(tl.where(live & (v == best), idx, NO_INDEX), axis=1), axis=0)
        tl.store(topv_ptr + row * K + i, best - lse)
        tl.store(topi_ptr + row * K + i, at.to(tl.int64))
        live = live & (idx != at)
    tok = tl.load(tok_ptr + row)
    tl.store(chosen_ptr + row, tl.load(x_ptr + row.to(tl.int64) * stride_x + tok).to(tl.float32) - lse)


def token_logprobs_ref(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same in PyTorch (logsumexp, topk, gather): the path without Triton, and the kernels' reference."""
    lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    top_v, top_i = logits.float().topk(min(LOGPROBS_TOP, logits.shape[-1]), dim=-1)
    return (logits.float().gather(-1, tokens.view(-1, 1))[:, 0] - lse[:, 0]), top_i, top_v - lse


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, V] logits, [B] chosen tokens -> (chosen [B] FP32, top ids [B, K] int64, top logprobs [B, K] FP32),
    K = min(LOGPROBS_TOP, V), the top in descending order (ties: the lowest id first). Two launches (above);
    where Triton cannot run, token_logprobs_ref."""
    if not available(logits.device) or logits.stride(1) != 1:
        return token_logprobs_ref(logits, tokens)
    B, V = logits.shape
    dev = logits.device
    K = min(LOGPROBS_TOP, V)
    KP = max(triton.next_power_of_2(K), 2)
    block = min(BLOCK_V, triton.next_power_of_2(V))
    nc = triton.cdiv(V, block)
    cmax = torch.empty((B, nc), dtype=torch.float32, device=dev)
    csum = torch.empty_like(cmax)
    cval = torch.empty((B, nc, KP), dtype=torch.float32, device=dev)
    cidx = torch.empty((B, nc, KP), dtype=torch.int32, device=dev)
    chosen = torch.empty((B,), dtype=torch.float32, device=dev)
    top_i = torch.empty((B, K), dtype=torch.int64, device=dev)
    top_v = torch.empty((B, K), dtype=torch.float32, device=dev)
    if B == 0:
        return chosen, top_i, top_v
    pdl = launch_kwargs(dev)
    _chunk_top[(B, nc)](logits, logits.stride(0), V, cmax, csum, cval, cidx, BLOCK=block, K=K, KP=KP,
                        num_warps=8 if block >= 2048 else 4, **pdl)
    _row_merge[(B,)](logits, logits.stride(0), tokens.to(device=dev, dtype=torch.int64).contiguous(), nc, cmax, csum,
                     cval, cidx, chosen, top_i, top_v, K=K, KP=KP, CB=max(triton.next_power_of_2(nc), 2),
                     num_warps=4, **pdl)
    return chosen, top_i, top_v
