"""Requests as the user sees them (params, outputs) and as the engine tracks them (Sequence)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch


class RequestError(ValueError):
    """A user mistake in a request; the message names the problem."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


@dataclass
class SamplingParams:
    temperature: float = 0.0      # 0 → greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 → off
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        if not _is_num(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RequestError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise RequestError(f"seed must be an int or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        bad = [t for t in self.stop_token_ids if not _is_int(t) or not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"stop_token_ids must be token ids in [0, {vocab_size}), got {bad[:5]}")


@dataclass
class RequestOutput:
    request_id: str
    prompt_len: int
    new_token_ids: list[int]        # produced in this step
    output_token_ids: list[int]     # all produced so far (a stop/eos token is included)
    finished: bool
    finish_reason: str | None       # "stop" | "length" | "abort"


@dataclass
class StepInfo:
    num_seqs: int
    num_prefill_tokens: int
    num_decode_seqs: int
    path: str
    duration_s: float
    num_new_tokens: int = 0          # tokens appended to sequences this step (> rows with speculation)
    num_draft_tokens: int = 0        # speculative: drafted tokens verified this step
    num_accepted_tokens: int = 0     # speculative: of those, accepted
    lookahead: bool = False          # this step's forward was launched by the step before (decode lookahead)


class Sequence:
    """Engine-side state of one request: tokens, cache placement, sampler stream."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams,
                 on_token: Callable[[RequestOutput], None] | None, seed: int):
        self.request_id, self.params, self.on_token, self.seed = request_id, params, on_token, seed
        self.token_ids = list(prompt)
        self.prompt_len = len(prompt)
        self.num_cached = 0               # tokens already written to the caches
        self.kda_slot: int | None = None
        self.blocks: list[int] = []       # reserved for the whole life of the request (a reused prefix first)
        self.block_hashes: list[int] = []  # prefix-cache chain hash of each full cached block, in order
        self.num_reused = 0               # prompt tokens taken from the prefix cache, not computed
        self.decode_snap: int | None = None  # this sequence's latest decode-time KDA snapshot
        self.generator: torch.Generator | None = None  # made on first sample, on the logits device
        self.finish_reason: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self, new: list[int]) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt_len, list(new), self.output_token_ids,
                             self.finished, self.finish_reason)
