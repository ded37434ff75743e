"""A decode step's tokens drawn on the device from its logits, so both runners can keep them (and the
step's logprobs) inside their CUDA graphs: penalties, then the sort-free sampler or the argmax."""
from __future__ import annotations

import torch

from ..engine import guided
from ..engine.penalties import apply_device
from ..kernels.logprobs import token_logprobs
from ..kernels.sampling import argmax, sample


def draw(logits: torch.Tensor, step) -> tuple[torch.Tensor, tuple | None]:
    """[B, V] FP32 logits -> ([B] int64 tokens, (chosen, top ids, top logprobs) or None). step.sampling: each
    row's draw (greedy rows the argmax), after step.penalties; else the argmax. step.logprobs: the raw
    logprobs (before penalties, as the host path reports them).
    Each draw is keyed by (seed, the position of the token drawn): a decode step's row draws token
    context_lens (the sequence's length); a verify step's rows (step.spec_tokens = T, B·T rows, the sampling
    settings repeated T times) each draw the token after their input, at step.positions + 1. step.logit_bias and
    step.logit_mask (structured output, engine/guided.py) apply first, to greedy rows too."""
    x = logits
    if step.logit_mask is not None or step.logit_bias is not None:
        x = guided.apply(logits, step.logit_mask, step.logit_bias)
    if step.sampling is not None:
        t, k, p, mp, seeds = step.sampling
        x = apply_device(x, *step.penalties, step.context_lens_t) if step.penalties is not None else x
        at = step.positions + 1 if step.spec_tokens else step.context_lens_t
        ids = sample(x, t, k, p, seeds, at, mp, top_k_any=step.sample_top_k)
    else:
        ids = argmax(x)
    return ids, (token_logprobs(logits, ids) if step.logprobs else None)
