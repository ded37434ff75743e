"""How many layers of a prefill chunk run beside each decode step (engine prefill pieces), by time.

A chunk scheduled beside running decodes runs as its own forward, a few layers per engine step; a decode step of the
running requests waits for the piece queued before it, so a piece's time is added to their inter-token latency. A
fixed number of layers a piece (prefill_piece_layers) costs whatever the chunk's layers cost: ~330 ms a 6-layer piece
of the 48B's eager MXFP4 prefill (H100, #65), a 328 ms ITL p99. PieceSizer keeps a piece near a time budget instead:
it measures what a chunk's layers took (CUDA events on the GPU, so the host never waits for them; the clock on the
CPU, where the work is done when the call returns), per layer and per prompt token, and gives each piece as many
layers as fit the budget at the chunk's size (at least one).
"""
from __future__ import annotations

import time

import torch

PIECE_MS = 12.0  # a piece's budget: with a B = 8 decode step of ~6-7 ms (H100), ITL p99 within 25 ms (#65 item 2)
EMA = 0.5        # weight of the newest measurement (a chunk's cost per token moves with its context)


class PieceSizer:
    def __init__(self, budget_ms: float = PIECE_MS, clock=time.perf_counter):
        self.budget_ms, self.clock = budget_ms, clock
        self.ms_per_layer_token: float | None = None  # None until a piece was measured: one layer first
        self._pending: list = []  # (start, end, layers, tokens) whose GPU time is not read yet

    def layers(self, tokens: int, left: int) -> int:
        """Layers for the next piece of a chunk of `tokens` prompt tokens with `left` layers to go."""
        self._collect()
        if self.ms_per_layer_token is None or tokens <= 0:
            return 1
        n = int(self.budget_ms / (self.ms_per_layer_token * tokens))
        return max(1, min(left, n))

    def start(self, device):
        if device is not None and device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self.clock()

    def stop(self, started, layers: int, tokens: int) -> None:
        """A piece of `layers` layers over `tokens` prompt tokens, launched since `started`."""
        if layers <= 0 or tokens <= 0:
            return
        if isinstance(started, float):
            self._learn((self.clock() - started) * 1e3, layers, tokens)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((started, end, layers, tokens))

    def _collect(self) -> None:
        """Learn from the pieces the GPU has finished (query: never a wait)."""
        while self._pending and self._pending[0][1].query():
            start, end, layers, tokens = self._pending.pop(0)
            self._learn(start.elapsed_time(end), layers, tokens)

    def _learn(self, ms: float, layers: int, tokens: int) -> None:
        x = ms / (layers * tokens)
        self.ms_per_layer_token = x if self.ms_per_layer_token is None else EMA * x + (1 - EMA) * self.ms_per_layer_token
