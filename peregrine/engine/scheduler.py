"""Continuous batching with chunked prefill and up-front cache reservation.

A request is admitted (FIFO) when a KDA slot and the MLA blocks for its whole life are
free, so a running sequence never runs out of cache mid-generation and nothing is ever
preempted. Admission stops at the first request that does not fit, so a large early
request is not starved by later small ones.
"""
from __future__ import annotations

from collections import deque

from ..cache import ModelCache
from .request import Sequence


class Scheduler:
    def __init__(self, cache: ModelCache, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        self.cache = cache
        self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len = (
            max_num_seqs, max_num_batched_tokens, max_model_len)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def blocks_needed(self, seq: Sequence) -> int:
        """Blocks for every token the sequence can ever write (its last sampled token is never written)."""
        life = min(seq.prompt_len + seq.params.max_tokens, self.max_model_len)
        return -(-life // self.cache.block_size)

    def can_ever_fit(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq) <= self.cache.num_blocks and self.cache.num_slots > 0

    def fits_now(self, seq: Sequence) -> bool:
        return self.cache.num_free_slots > 0 and self.cache.blocks.num_free >= self.blocks_needed(seq)

    def admits_now(self) -> bool:
        """Whether schedule() would start the first waiting request now (decode steps use no token budget)."""
        return bool(self.waiting) and len(self.running) < self.max_num_seqs and self.fits_now(self.waiting[0])

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, number of new tokens) for this step: decodes always, prefill chunks within budget."""
        budget = self.max_num_batched_tokens
        out: list[tuple[Sequence, int]] = []
        for seq in self.running:
            n = len(seq.token_ids) - seq.num_cached
            if seq.in_prefill:
                n = min(n, budget)
                budget -= n
            if n > 0:
                out.append((seq, n))
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.fits_now(seq):
                break
            self.waiting.popleft()
            seq.kda_slot = self.cache.allocate_slot()
            seq.blocks = self.cache.blocks.allocate(self.blocks_needed(seq))
            self.running.append(seq)
            n = min(seq.prompt_len, budget)
            budget -= n
            out.append((seq, n))
        return out

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and give its slot and blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.kda_slot is not None:
            self.cache.free_slot(seq.kda_slot)
            seq.kda_slot = None
        if seq.blocks:
            self.cache.blocks.free(seq.blocks)
            seq.blocks = []
