"""A decode step's tokens drawn on the device from its logits, so both runners can keep them (and the
step's logprobs) inside their CUDA graphs: penalties, then the sort-free sampler or the argmax."""
from __future__ import annotations

import torch

from ..engine.penalties import apply_device
from ..kernels.sampling import argmax, sample, token_logprobs


def draw(logits: torch.Tensor, step) -> tuple[torch.Tensor, tuple | None]:
    """[B, V] FP32 logits -> ([B] int64 tokens, (chosen, top ids, top logprobs) or None). step.sampling: each
    row's draw (greedy rows the argmax), after step.penalties; else the argmax. step.logprobs: the raw
    logprobs (before penalties, as the host path reports them)."""
    if step.sampling is not None:
        t, k, p, mp, seeds = step.sampling
        x = apply_device(logits, *step.penalties, step.context_lens_t) if step.penalties is not None else logits
        ids = sample(x, t, k, p, seeds, step.context_lens_t, mp, top_k_any=step.sample_top_k)
    else:
        ids = argmax(logits)
    return ids, (token_logprobs(logits, ids) if step.logprobs else None)
