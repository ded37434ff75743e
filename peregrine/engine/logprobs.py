"""Log-probabilities of sampled tokens and of prompt tokens, from the step's FP32 logits.

Reported values are the model's own distribution, log_softmax of the raw logits, before
temperature, penalties or the min_tokens mask (vLLM's default "raw" logprobs), so they do not
depend on how a token was chosen.

Prompt logprobs (echo / lm-eval loglikelihood) need logits at every prompt position, where a
prefill normally computes only the last: `prompt_rows` asks the forward for all positions of the
sequences that want them (StepInput.logits_idx) and `split_prompt_rows` turns those rows into each
prompt token's logprob, leaving one sampling row per sequence as usual. Only positions the prefill
computes get one: a prefix cache must compute the whole prompt of a request with prompt_logprobs
(positions it skipped would stay None), and tensor parallel does not carry logits_idx to the other
ranks yet (the engine refuses prompt_logprobs there).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's chat limit, vLLM's default)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely tokens of that position, most likely first


def compute(logits: torch.Tensor, chosen: list[int], k: list[int]) -> list[TokenLogprob]:
    """Row i: logprob of chosen[i] and the top k[i] alternatives, from FP32 logits [R, V]."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ch = lp.gather(-1, torch.tensor(chosen, device=lp.device).view(-1, 1))[:, 0].tolist()
    kmax = max(k, default=0)
    top_v, top_i = (lp.topk(kmax, dim=-1) if kmax else (None, None))
    tv, ti = (top_v.tolist(), top_i.tolist()) if kmax else ([[]] * len(chosen), [[]] * len(chosen))
    return [TokenLogprob(c, v, list(zip(ti[r][:k[r]], tv[r][:k[r]]))) for r, (c, v) in enumerate(zip(chosen, ch))]


def record(seqs, logits: torch.Tensor, toks: list[int]) -> None:
    """Sampled tokens' logprobs for the sequences that asked for them, kept until emitted."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return
    out = compute(logits[rows], [toks[i] for i in rows], [seqs[i].params.logprobs for i in rows])
    for i, tl in zip(rows, out):
        seqs[i].pending_logprobs.append(tl)


def record_device(seqs, toks: list[int], chosen: list[float], top_ids: list[list[int]], top_vals: list[list[float]]) -> None:
    """The same, from logprobs the runner took inside the step (kernels/logprobs.token_logprobs), read back."""
    for i, s in enumerate(seqs):
        k = s.params.logprobs
        if k is not None:
            s.pending_logprobs.append(TokenLogprob(toks[i], chosen[i], list(zip(top_ids[i][:k], top_vals[i][:k]))))


def wants_prompt_rows(batch) -> bool:
    return any(s.in_prefill and s.params.prompt_logprobs is not None for s, _ in batch)


def prompt_rows(batch, device) -> tuple[torch.Tensor | None, list[int]]:
    """(logits_idx for the step, or None for the usual last row per sequence; each sequence's
    sampling row among the rows the forward will return)."""
    if not wants_prompt_rows(batch):
        return None, list(range(len(batch)))
    idx, last, flat = [], [], 0
    for s, n in batch:
        if s.in_prefill and s.params.prompt_logprobs is not None:
            idx.extend(range(flat, flat + n))
        else:
            idx.append(flat + n - 1)
        last.append(len(idx) - 1)
        flat += n
    return torch.tensor(idx, dtype=torch.long, device=device), last


def split_prompt_rows(batch, logits: torch.Tensor, last: list[int]) -> torch.Tensor:
    """Record prompt logprobs from the rows prompt_rows asked for; -> one sampling row per sequence.
    Call before the sequences' num_cached moves past this step."""
    if len(last) == logits.shape[0] and not wants_prompt_rows(batch):
        return logits
    a = 0
    for (s, n), b in zip(batch, last):
        if s.in_prefill and s.params.prompt_logprobs is not None:
            _record_prompt(s, logits[a:b + 1], s.num_cached, n)
        a = b + 1
    return logits if len(last) == logits.shape[0] else logits[torch.tensor(last, device=logits.device)]


def _record_prompt(seq, rows: torch.Tensor, start: int, n: int) -> None:
    """rows[j] (position start + j) predicts token start + j + 1, while that is a prompt token."""
    m = min(n, seq.prompt_len - 1 - start)
    if m <= 0:
        return
    targets = seq.token_ids[start + 1:start + 1 + m]
    seq.prompt_logprobs[start + 1:start + 1 + m] = compute(rows[:m], targets, [seq.params.prompt_logprobs] * m)
