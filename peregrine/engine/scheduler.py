"""Continuous batching with chunked prefill, prefix reuse and up-front cache reservation.

Every step serves each running decode first (one token each), then prefill chunks in FIFO order
within a token budget: max_num_batched_tokens when nobody is decoding, and the smaller
max_prefill_tokens_while_decoding when somebody is, so a long prompt arriving never stalls the
running requests for more than one short chunk's time. One prompt may fill a whole step, but several
share one only up to pack_tokens (8192) between them: a long prompt arriving alone gets one big step
(its MoE GEMMs run at ~1K tokens an expert), while prompts arriving together finish one after another
instead of all at the end of one long step.

A request is admitted (FIFO) when a KDA slot and the MLA blocks for its whole life are free
(cached blocks nobody reads count as free: they are evicted on demand), so a running sequence never
runs out of cache mid-generation and nothing is ever preempted. Admission stops at the first request
that does not fit, so a large early request is not starved by later small ones. With prefix caching
(peregrine/prefix_cache.py) an admitted prompt starts after its longest cached prefix.

Prompts that share a prefix and arrive together (agent sessions opening on one system prompt) compute it
once: a request whose prompt shares at least a block more than its cached prefix with a prompt still
prefilling waits until that prefill has passed the shared part, which then takes a KDA snapshot where the
two part (snap_points), and starts from there. A recomputed fork (a prompt that matches cached blocks past
its deepest snapshot) takes a snapshot at its fork point too, so the next prompt of that fork reuses it.
"""
from __future__ import annotations

from collections import deque

from ..cache import ModelCache
from ..config import PREFILL_STEP_TOKENS
from ..prefix_cache import Match, PrefixCache, common_prefix
from .request import Sequence


class Scheduler:
    def __init__(self, cache: ModelCache, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 max_prefill_tokens_while_decoding: int | None = None, prefix_cache: PrefixCache | None = None,
                 pack_tokens: int = PREFILL_STEP_TOKENS[-1], align: int = 1):
        """align: a prompt chunk that does not finish its prompt ends at a multiple of it (batch-invariant mode:
        the KDA chunk, so a prompt's chunks are the same however the budget splits it)."""
        self.cache, self.pack_tokens, self.align = cache, pack_tokens, align
        self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len = (
            max_num_seqs, max_num_batched_tokens, max_model_len)
        self.decode_budget = min(max_prefill_tokens_while_decoding or max_num_batched_tokens, max_num_batched_tokens)
        self.pc = prefix_cache or PrefixCache(cache.blocks, cache.block_size, 0, bool(cache.cfg.kda_layers), enabled=False)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loads: list[tuple[int, int]] = []  # (snapshot, slot) copies the engine must run before the next forward

    def blocks_needed(self, seq: Sequence) -> int:
        """Blocks for every token the sequence can ever write (its last sampled token is never written)."""
        life = min(seq.prompt_len + seq.params.max_tokens, self.max_model_len)
        return -(-life // self.cache.block_size)

    def can_ever_fit(self, seq: Sequence) -> bool:
        return self.blocks_needed(seq) <= self.cache.num_blocks and self.cache.num_slots > 0

    def _plan(self, seq: Sequence) -> Match | None:
        """The prefix this request would reuse if admitted now, or None if it does not fit now."""
        if self.cache.num_free_slots == 0:
            return None
        if seq.params.prompt_logprobs is not None:
            hit = Match()  # prompt logprobs need the logits of every prompt position: compute them all
        else:
            limit = seq.prompt_len - 1  # the last prompt token is always computed
            if seq.prompt_hashes is None:
                seq.prompt_hashes = []  # extended by each lookup as far as it goes
            hit = self.pc.match(seq.token_ids, limit, seq.prompt_hashes)
        if not self.pc.can_allocate(self.blocks_needed(seq) - hit.num_blocks, hit.blocks):
            return None
        return hit

    def fits_now(self, seq: Sequence) -> bool:
        return self._plan(seq) is not None

    def _wait_for_prefill(self, seq: Sequence, hit: Match) -> bool:
        """Whether seq should wait for a running prefill of the same prefix (see the module's note): that
        prefill is asked for a snapshot where their prompts part (a block end), and seq is admitted once it is
        there. Prompts are compared only where their first blocks are equal."""
        bs = self.cache.block_size
        if not self.pc.enabled or (self.pc.needs_state and not self.pc.can_snapshot):
            return False
        have = hit.num_blocks * bs
        first = seq.token_ids[have:have + bs]
        for other in self.running:
            if not other.in_prefill or other.token_ids[have:have + bs] != first:
                continue
            p = common_prefix(seq.token_ids, other.token_ids, min(seq.prompt_len - 1, other.prompt_len)) // bs * bs
            if p - have >= bs and other.num_cached < p:
                other.snap_points.add(p)
                return True
        return False

    def admits_now(self) -> bool:
        """Whether schedule() would start the first waiting request now (decode steps use no token budget)."""
        return bool(self.waiting) and len(self.running) < self.max_num_seqs and self.fits_now(self.waiting[0])

    def _admit(self, seq: Sequence, hit: Match) -> None:
        self.pc.acquire(hit.blocks)
        seq.blocks = hit.blocks + self.pc.allocate(self.blocks_needed(seq) - hit.num_blocks)
        seq.kda_slot = self.cache.allocate_slot()
        seq.block_hashes = list(hit.hashes)
        seq.num_cached = seq.num_cached_tokens = hit.num_blocks * self.cache.block_size
        if hit.depth > hit.num_blocks:  # a fork recomputed past its last snapshot: one at the fork point next time
            seq.snap_points.add(hit.depth * self.cache.block_size)
        if hit.snapshot is not None:
            self.loads.append((hit.snapshot, seq.kda_slot))
        self.pc.note_query(seq.prompt_len, hit)
        self.running.append(seq)

    def schedule(self, prefill: bool = True) -> list[tuple[Sequence, int]]:
        """(sequence, number of new tokens) for this step: decodes first, prefill chunks within budget
        (none with prefill=False: the engine has a chunk in flight)."""
        decoding = any(not s.in_prefill for s in self.running)
        budget = self.decode_budget if decoding else self.max_num_batched_tokens
        if not prefill:
            budget = 0
        out: list[tuple[Sequence, int]] = []
        used = 0  # prompt tokens in this step so far

        def room() -> int:  # for the next prefill row: the budget, or what packing leaves after the first
            return budget - used if not used else min(budget, self.pack_tokens) - used
        for seq in self.running:
            n = len(seq.token_ids) - seq.num_cached
            if seq.in_prefill:
                n = self._take(seq, room())
                used += n
            if n > 0:
                out.append((seq, n))
        while self.waiting and room() > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self._plan(seq)
            if hit is None or self._wait_for_prefill(seq, hit):
                break
            self.waiting.popleft()
            self._admit(seq, hit)
            n = self._take(seq, room())
            if n == 0:  # admitted; its first chunk is the next step's (the room left is under one aligned chunk)
                break
            used += n
            out.append((seq, n))
        return out

    def _take(self, seq: Sequence, room: int) -> int:
        """Prompt tokens of seq for this step within room: all it has left, or a chunk ending at a multiple of align."""
        left = len(seq.token_ids) - seq.num_cached
        n = max(0, min(left, room))
        if n < left and self.align > 1:
            n = max(0, (seq.num_cached + n) // self.align * self.align - seq.num_cached)
        return n

    def take_loads(self) -> list[tuple[int, int]]:
        loads, self.loads = self.loads, []
        return loads

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
            self.pc.release(seq.blocks)
            seq.blocks = []

