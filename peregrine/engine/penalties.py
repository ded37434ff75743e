"""Logits processing before sampling: the min_tokens mask, OpenAI's presence/frequency penalties and
the repetition penalty (vLLM's and transformers').

- min_tokens: until a sequence has produced that many tokens, its end ids (unless ignore_eos) and
  stop_token_ids get -inf, so it cannot stop early (stop strings wait too: stops.py).
- penalties (OpenAI's definition): logit[t] -= frequency_penalty * c[t] + presence_penalty * (c[t] > 0),
  c[t] = how often t occurs in the tokens generated so far (the prompt does not count).
- repetition_penalty r (applied before the two above, as vLLM does): every token of the prompt or the output
  so far has its logit divided by r when positive, multiplied by r when not (r > 1: all less likely).

Only rows that need it are touched, on a copy; the caller keeps the raw logits for logprobs.
"""
from __future__ import annotations

import torch

PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's bounds for presence_penalty and frequency_penalty


def needs_processing(p) -> bool:
    return p.min_tokens > 0 or p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def process(logits: torch.Tensor, seqs, eos_ids) -> torch.Tensor:
    """Processed logits [S, V] for sampling (the input itself when no row needs processing)."""
    rows = [i for i, s in enumerate(seqs) if needs_processing(s.params)]
    if not rows:
        return logits
    out = logits.float().clone()
    V = out.shape[-1]
    for i in rows:
        s, p = seqs[i], seqs[i].params
        gen = s.output_token_ids
        if len(gen) < p.min_tokens:
            ban = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            ban = [t for t in ban if 0 <= t < V]
            if ban:
                out[i, torch.tensor(ban, device=out.device)] = float("-inf")
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(s.token_ids)), device=out.device)
            v = out[i, seen]
            out[i, seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and gen:
            c = torch.zeros(V, device=out.device).index_add_(
                0, torch.tensor(gen, device=out.device), torch.ones(len(gen), device=out.device))
            out[i] -= p.frequency_penalty * c + p.presence_penalty * (c > 0).float()
    return out
