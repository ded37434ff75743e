"""Ranks other than 0: build the same engine's shard on rank 0's word, then run every
step rank 0 sends, in lockstep (same runner, same path, same collectives)."""
from __future__ import annotations

import gc
import sys

import torch

from ..engine.parts import build_parts, report_holdings
from ..host_memory import Trimmer
from . import control


def _log(tp):
    return lambda m: print(f"[peregrine rank {tp.rank}] {m}", file=sys.stderr, flush=True)


def serve(tp) -> None:
    """Run rank 0's commands until it says exit. A rank that fails mid-step exits at once
    (rank 0 then fails at its next collective instead of waiting on a dead peer)."""
    try:
        _serve(tp)
    except Exception:
        import os
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _serve(tp) -> None:
    runner = cache = None
    snapshots = None  # the next step's in-layer KDA snapshots (prefix caching)
    trimmer = Trimmer()  # rank 0's engine trims its own; this rank's steps allocate alike
    while True:
        kind, msg = control.recv(tp, tp.device or torch.device("cpu"), getattr(runner, "greedy_tokens", None))
        if kind == "step":
            step, flags = msg
            for s in control.new_sequences(step):  # rank 0 zeroes these when it admits the sequence
                cache.state[:, s].zero_()
                cache.conv[:, s].zero_()
            runner.record_routing = bool(flags & control.RECORD_ROUTING)
            step.kda_snapshots, snapshots = snapshots, None
            runner.forward(step)
            trimmer.after_step(idle=False)  # a rank never knows it is idle: it trims once a period while stepping
            continue
        cmd, *args = msg
        if cmd == "exit":
            return
        if cmd == "build":
            runner = cache = None  # the previous engine's memory goes before the next one is built
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            runner, cache = build_shard(tp, *args)
        elif cmd == "kda_snapshots":
            snapshots = args[0]
        elif cmd == "cache_ops":
            cache.apply(args[0])
        elif cmd == "replay":
            B, iters, sampled = args
            runner.graph_replay_time(B, iters, sampled=sampled)
        else:
            raise RuntimeError(f"rank {tp.rank}: unknown command {cmd!r}")


def build_shard(tp, model: str, ecfg, dummy_weights: bool, verbose: bool):
    log = _log(tp) if verbose else (lambda m: None)
    try:
        parts = build_parts(model, ecfg, dummy_weights, log, tp)
        err = None
    except Exception as e:  # reported to rank 0 through the holdings exchange, never a hang
        parts, err = None, f"{type(e).__name__}: {e}"
    report_holdings(tp, parts[1] if parts else None, err, log)
    if parts is None:
        return None, None
    _cfg, _m, cache, runner, _folder = parts
    return runner, cache
