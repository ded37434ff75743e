"""Batch sampler over [S, V] float32 logits.

Greedy rows take the argmax. Other rows: temperature → top-k → top-p (at least one token
kept) → one draw from the row's own torch.Generator, so a request's samples depend only
on its seed and its logits, never on what else is in the batch.
"""
from __future__ import annotations

import torch

from .request import SamplingParams


def make_generator(seed: int, device) -> torch.Generator:
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(seed)
    return g


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """Sampling distribution of each row [S, V]; temperature/top_k/top_p are [S] (top_k 0 = off)."""
    x = logits.float() / temperature[:, None]
    sx, order = x.sort(dim=-1, descending=True)
    V = x.shape[-1]
    rank = torch.arange(V, device=x.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)
    sx = sx.masked_fill(rank >= k[:, None], float("-inf"))
    p = sx.softmax(dim=-1)
    # drop a token when the tokens ranked above it already reach top_p (rank 0 sees 0 < top_p, so
    # it always stays); top_p = 1 drops nothing, so rounding in the cumsum cannot cut the tail
    drop = ((p.cumsum(dim=-1) - p) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sx = sx.masked_fill(drop, float("-inf"))
    out = torch.empty_like(x)
    out.scatter_(-1, order, sx.softmax(dim=-1))
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row; generators[i] may be None only for greedy rows."""
    S = logits.shape[0]
    out = logits.argmax(dim=-1)
    rows = [i for i in range(S) if not params[i].greedy]
    if rows:
        dev = logits.device
        t = lambda vals, dt: torch.tensor(vals, dtype=dt, device=dev)  # noqa: E731
        ps = [params[i] for i in rows]
        probs = filtered_probs(logits[rows], t([p.temperature for p in ps], torch.float32),
                               t([p.top_k for p in ps], torch.long), t([p.top_p for p in ps], torch.float32))
        for j, i in enumerate(rows):  # one draw per row from its own stream
            out[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return out.tolist()
