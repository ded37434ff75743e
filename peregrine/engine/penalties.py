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

from ..decode.batch import _to_device

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
            ban = [t for t in ban_ids(p, eos_ids) if 0 <= t < V]
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


MAX_BAN = 8  # end and stop ids a row's min_tokens mask may hold inside the step (more: that row is served on the host)


def apply_device(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, slots: torch.Tensor,
                 rep: torch.Tensor, freq: torch.Tensor, pres: torch.Tensor, ban: torch.Tensor, until: torch.Tensor,
                 context_lens: torch.Tensor) -> torch.Tensor:
    """process() inside a step, capturable: row i reads its output-token counts counts[slots[i]] and its
    prompt-or-output mask seen[slots[i]] ([slots, V] buffers DevicePenalties keeps on the device), and bans
    ban[i] (its end and stop ids, padded with repeats) while the token drawn (index context_lens[i]) is before
    until[i] = prompt length + min_tokens."""
    c, sn = counts[slots], seen[slots]
    r = rep[:, None]
    x = torch.where(sn, torch.where(logits > 0, logits / r, logits * r), logits)
    x = x - freq[:, None] * c - pres[:, None] * (c > 0).float()
    held = (context_lens < until)[:, None].expand(-1, ban.shape[1])
    return x.masked_fill(torch.zeros_like(x, dtype=torch.bool).scatter_(1, ban, held), float("-inf"))


def ban_ids(p, eos_ids) -> list[int]:
    """The ids min_tokens holds back: the request's stop ids, and the end ids unless ignore_eos."""
    return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)))


class DevicePenalties:
    """Per-sequence token counts on the device, so penalised rows are served inside the step (#41).

    counts[slot, t]: how often t occurs in the sequence's output; seen[slot, t]: t is in its prompt or output
    (slot: its KDA slot; the scratch slot past the end serves graph captures). A step that serves a row
    first adds the row's input token (its newest output token) from the step's own input ids, on the device,
    so a step launched ahead counts the token its predecessor drew before the host has it. A sequence
    whose counts lag (a new one, or steps served on the host since) is rebuilt from its host tokens first."""

    def __init__(self, num_slots: int, vocab: int, device):
        self.counts = torch.zeros(num_slots + 1, vocab, dtype=torch.float32, device=device)
        self.seen = torch.zeros(num_slots + 1, vocab, dtype=torch.bool, device=device)
        self.counted: dict[int, tuple[object, int]] = {}  # slot -> (sequence, output tokens its row holds)
        self._key, self._rows = None, None  # the last batch's rows (slots and settings on the device)

    def prepare(self, step, seqs, eos_ids) -> tuple:
        """Bring each row up to date for this decode step, queue the update with its input token, and return
        StepInput.penalties: (counts, seen, slots, repetition, frequency, presence, ban ids, ban until)."""
        dev = self.counts.device
        for s, c in zip(seqs, step.context_lens):
            j = c - 1 - s.prompt_len  # output index of this step's input token (a decode step: one per row)
            if self.counted.get(s.kda_slot, (None, -1)) != (s, j):
                outs = s.output_token_ids[:j]
                self.counts[s.kda_slot].zero_()
                self.seen[s.kda_slot].zero_()
                if outs:
                    t = _to_device(torch.tensor(outs, dtype=torch.long), dev)
                    self.counts[s.kda_slot].index_add_(0, t, torch.ones(len(outs), device=dev))
                self.seen[s.kda_slot][_to_device(torch.tensor(s.token_ids[:s.prompt_len + j], dtype=torch.long), dev)] = True
            self.counted[s.kda_slot] = (s, j + 1)
        key = tuple(seqs)
        if key != self._key:  # a batch's settings are copied once, not every step
            col = lambda vals, dt: _to_device(torch.tensor(vals, dtype=dt), dev)  # noqa: E731
            ps = [s.params for s in seqs]
            bans = [ban_ids(p, eos_ids) if p.min_tokens else [] for p in ps]
            self._rows = (col([s.kda_slot for s in seqs], torch.long), col([p.repetition_penalty for p in ps], torch.float32),
                          col([p.frequency_penalty for p in ps], torch.float32),
                          col([p.presence_penalty for p in ps], torch.float32),
                          col([((b or [0]) * MAX_BAN)[:MAX_BAN] for b in bans], torch.long),  # [0]: never held (until 0)
                          col([s.prompt_len + p.min_tokens if b else 0 for s, p, b in zip(seqs, ps, bans)], torch.int32),
                          torch.ones(len(seqs), device=dev), torch.ones(len(seqs), dtype=torch.bool, device=dev))
            self._key = key
        *rows, one, yes = self._rows
        self.counts.index_put_((rows[0], step.input_ids), one, accumulate=True)
        self.seen.index_put_((rows[0], step.input_ids), yes)
        return (self.counts, self.seen, *rows)
