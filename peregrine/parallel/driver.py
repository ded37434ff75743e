"""Rank 0's runner: each step goes to the other ranks first, then runs here like there."""
from __future__ import annotations

from . import control


class TPDriver:
    @property
    def lookahead(self) -> bool:  # a lookahead step's ids: every rank's own on-device argmax (control.IDS_FROM_GREEDY)
        return getattr(self.inner, "lookahead", False)

    def __init__(self, inner, tp):
        self.inner, self.tp = inner, tp
        self._record = False

    def forward(self, step):
        if step.kda_snapshots:  # prefix caching: the KDA layers of every rank take the same snapshots
            control.send_obj(self.tp, ("kda_snapshots", step.kda_snapshots))
        control.send_step(self.tp, step, control.RECORD_ROUTING if self._record else 0)
        return self.inner.forward(step)

    def cache_ops(self, ops) -> None:
        """Snapshot copies (ModelCache.apply) on every other rank; the engine runs them here itself."""
        control.send_obj(self.tp, ("cache_ops", ops))

    @property
    def record_routing(self) -> bool:
        return self._record

    @record_routing.setter
    def record_routing(self, on: bool) -> None:  # every rank takes the same (eager) path
        self._record = bool(on)
        self.inner.record_routing = self._record

    def graph_replay_time(self, B: int, iters: int = 100, sampled: bool = False):
        control.send_obj(self.tp, ("replay", B, iters, sampled))  # the graphs hold collectives: every rank replays
        return self.inner.graph_replay_time(B, iters, sampled=sampled)

    def __getattr__(self, name):  # last_path, greedy_tokens, fallback_reasons, routing counts, ...
        return getattr(self.inner, name)
