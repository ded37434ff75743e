"""The engine's batch sampler over [S, V] logits: one token per row, on the logits' device.

Greedy rows take the argmax. Other rows: temperature, min-p, top-k, top-p (vLLM's order; at least one
token kept), then one draw keyed by (the request's seed, the position of the token drawn): a request's
samples depend only on its seed, its positions and its logits, never on the batch it shares, on a step
launched ahead, or on how many draws it made before. On a GPU the sort-free kernel draws
(kernels/sampling.py); on the CPU its PyTorch reference with the same random bits (sample_ref).
"""
from __future__ import annotations

import torch

from ..kernels.sampling import filtered_probs_ref, sample as sample_kernel, sample_ref
from .request import SamplingParams


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Sampling distribution of each row [S, V] (FP64); temperature/top_k/top_p/min_p are [S] (top_k 0 = off)."""
    return torch.stack([filtered_probs_ref(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i]),
                                           float(min_p[i]) if min_p is not None else 0.0)
                        for i in range(logits.shape[0])])


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]) -> list[int]:
    """One token per row: row i with params[i], drawn with key (seeds[i], positions[i])."""
    S = logits.shape[0]
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1).tolist()
    dev = logits.device
    t = lambda vals, dt: torch.tensor(vals, dtype=dt, device=dev)  # noqa: E731
    args = (t([p.temperature for p in params], torch.float32), t([p.top_k for p in params], torch.int32),
            t([p.top_p for p in params], torch.float32), t(seeds, torch.int64), t(positions, torch.int64),
            t([p.min_p for p in params], torch.float32))
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    top_k_any = any(0 < p.top_k < x.shape[-1] and not p.greedy for p in params)
    out = sample_kernel(x, *args, top_k_any=top_k_any) if dev.type == "cuda" else sample_ref(x, *args)
    assert out.shape == (S,)
    return out.tolist()
