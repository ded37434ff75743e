"""Where a prefill step's time goes: per-kernel GPU time (torch.profiler) of one cold prefill chunk and
of a turn-2 step (64 new tokens after a cached prefix), with the wall time of each.

    python -m peregrine.bench.profile_prefill --model kimi-linear-48b-a3b --dummy-weights --chunks 1024,8192 --context 32768
"""
from __future__ import annotations

import argparse
import collections
import time

import torch

from .profile_step import _device_us
from .ttft import TURN2_NEW_TOKENS, first_token_s, random_prompt

TOP = 40  # kernels listed per profile
TOP_GAPS = 12  # longest GPU idle gaps listed per profile
GAP_STACK_US = 1000  # gaps at least this long also list the host ops that ran inside them
GAP_OPS = 6  # host ops listed per such gap
GAP_US = 50  # gaps longer than this are counted apart: launch latency is ~5-10 us, a host sync or Python is more
TOP_OPS = 30  # aten ops by their own GPU time, per input shapes (--shapes): which tensors the copies move


def profile_call(fn, log, shapes: bool = False, stacks: bool = False) -> dict:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    extra = {}
    if stacks:  # ops carry their Python stacks only in the verbose mode (torch 2.11-2.13: empty otherwise)
        try:
            from torch._C._profiler import _ExperimentalConfig
            extra["experimental_config"] = _ExperimentalConfig(verbose=True)
        except ImportError:
            log("  (no verbose profiler config in this torch: op stacks may come back empty)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=shapes,
                 with_stack=stacks, **extra) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    per, calls = collections.Counter(), collections.Counter()
    for ev in prof.key_averages():
        us = _device_us(ev)
        if us > 0 and ev.device_type is not None and "cuda" in str(ev.device_type).lower():
            per[ev.key] += us
            calls[ev.key] += ev.count
    total = sum(per.values()) / 1e3
    log(f"wall {wall:.1f} ms, GPU kernel time {total:.1f} ms over {sum(calls.values())} launches")
    top = []
    for k, us in per.most_common(TOP):
        top.append({"kernel": k[:110], "ms": us / 1e3, "calls": calls[k]})
        log(f"  {us / 1e3:8.2f} ms  {calls[k]:6d}x  {k[:110]}")
    ops = []
    if shapes:
        log("  top aten ops by their own GPU time, per input shapes:")
        own = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)  # noqa: E731
        evs = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::") and own(e) > 0]
        for e in sorted(evs, key=own, reverse=True)[:TOP_OPS]:
            ops.append({"op": e.key, "shapes": str(e.input_shapes)[:200], "ms": own(e) / 1e3, "calls": e.count})
            log(f"    {own(e) / 1e3:8.2f} ms  {e.count:6d}x  {e.key} {str(e.input_shapes)[:160]}")
    gaps = idle_gaps(prof, log)
    cpu = sorted(prof.key_averages(), key=lambda e: e.cpu_time_total, reverse=True)[:15]
    log("  top CPU ops (self+children):")
    for e in cpu:
        log(f"    {e.cpu_time_total / 1e3:8.2f} ms  {e.count:6d}x  {e.key[:90]}")
    return {"wall_ms": wall, "kernel_ms": total, "top": top, "gaps": gaps} | ({"ops": ops} if shapes else {})


def idle_gaps(prof, log) -> dict:
    """Where the GPU waits: its kernels' intervals merged, the span from the first CPU op to the first kernel
    (host work before the step's GPU work), the idle time between kernels, and the TOP_GAPS longest gaps
    with the kernels on either side (a host sync, or Python between two launches, shows up there)."""
    try:
        dev = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if "cuda" in str(getattr(e, "device_type", "")).lower() and e.time_range.end > e.time_range.start))
        cpu0 = min(e.time_range.start for e in prof.events() if "cpu" in str(getattr(e, "device_type", "")).lower())
    except Exception as e:  # noqa: BLE001 - a profiler without these fields: report, carry on
        log(f"  idle gaps unavailable: {type(e).__name__}: {e}")
        return {}
    if not dev:
        return {}
    gaps, gap_starts, end = [], [], dev[0][1]
    for (s0, e0, name), prev in zip(dev[1:], dev):
        if s0 > end:
            gaps.append((s0 - end, prev[2], name))
            gap_starts.append((s0 - end, end))
        end = max(end, e0)
    idle = sum(g for g, _, _ in gaps)
    out = {"head_ms": (dev[0][0] - cpu0) / 1e3, "span_ms": (end - dev[0][0]) / 1e3, "idle_ms": idle / 1e3,
           "gaps_over_50us_ms": sum(g for g, _, _ in gaps if g > GAP_US) / 1e3,
           "top": [{"us": g, "after": a[:80], "before": b[:80]} for g, a, b in sorted(gaps, reverse=True)[:TOP_GAPS]]}
    log(f"  GPU idle: {out['head_ms']:.1f} ms before its first kernel, {out['idle_ms']:.1f} ms between kernels "
        f"({out['gaps_over_50us_ms']:.1f} ms in gaps > {GAP_US} us) of a {out['span_ms']:.1f} ms span; longest gaps:")
    cpu = [e for e in prof.events() if "cpu" in str(getattr(e, "device_type", "")).lower()]
    for g, (us, s0) in zip(out["top"], sorted(((g, s) for g, s in gap_starts), reverse=True)):
        log(f"    {g['us'] / 1e3:7.2f} ms at +{(s0 - dev[0][0]) / 1e3:.1f} ms  after {g['after'][:60]}  before {g['before'][:60]}")
        if us < GAP_STACK_US:
            continue
        # the engine's named ranges (engine.py _traced) around the gap, innermost first: which phase the host was in
        spans = sorted((e for e in cpu if e.name.startswith("peregrine.") and e.time_range.start < s0 + us
                        and e.time_range.end > s0), key=lambda e: e.time_range.end - e.time_range.start)
        g["in"] = [e.name for e in spans[:3]]
        if spans:
            log(f"        in {' < '.join(g['in'])}")
        inside = sorted((e for e in cpu if s0 <= e.time_range.start < s0 + us and not e.name.startswith("peregrine.")),
                        key=lambda e: -(e.time_range.end - e.time_range.start))
        for e in inside[:GAP_OPS]:  # what the host ran while the GPU waited (the stacks need --stacks)
            where = [f for f in (getattr(e, "stack", None) or []) if "peregrine" in f][:3]
            g.setdefault("host", []).append({"op": e.name[:80], "us": (e.time_range.end - e.time_range.start), "stack": where})
            log(f"        host {(e.time_range.end - e.time_range.start) / 1e3:6.2f} ms  {e.name[:50]}  {' < '.join(where)[:200]}")
    return out


HOST_PHASES = ("_schedule", "_build_step", "_forward", "_complete", "_after_forward", "_sample", "_accept")
SYNC_FRAMES = 4  # innermost frames of this project or fla shown per host sync


def host_phases(eng, prompt, log) -> dict:
    """One cold first token, unprofiled, with each engine phase's host wall time (where the host waits on
    the GPU shows as a long phase), then again under torch's sync debug mode: each op that made the host
    wait for the device, with the innermost frames of this project (or fla) that issued it."""
    import traceback
    import warnings
    acc = collections.defaultdict(float)
    saved = {n: getattr(eng, n) for n in HOST_PHASES}

    def timed(name, fn):
        def inner(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += (time.perf_counter() - t0) * 1e3
        return inner
    for n, fn in saved.items():
        setattr(eng, n, timed(n, fn))
    try:
        total = first_token_s(eng, prompt) * 1e3
    finally:
        for n in saved:
            delattr(eng, n)  # the class's methods again
    log(f"host phases of one cold first token ({total:.1f} ms; nested phases overlap): "
        + ", ".join(f"{n.strip('_')} {v:.2f}" for n, v in acc.items()))
    syncs = []
    if not torch.cuda.is_available():
        return {"total_ms": total, "phases_ms": dict(acc), "syncs": None}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "peregrine/" in f.filename or "/fla/" in f.filename]
        syncs.append({"op": str(message).splitlines()[0][:120],
                      "at": [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in frames[-SYNC_FRAMES:]]})
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning and the filters on the way out
            warnings.simplefilter("always")
            warnings.showwarning = record
            first_token_s(eng, prompt[1:] + prompt[:1])  # another prompt: no prefix hit
    finally:
        torch.cuda.set_sync_debug_mode("default")
    log(f"host syncs in one cold first token: {len(syncs)}")
    for s in syncs:
        log(f"  {s['op']}\n      " + "\n      ".join(reversed(s["at"])))
    return {"total_ms": total, "phases_ms": dict(acc), "syncs": syncs}


def main(argv=None) -> int:
    from ..config import EngineConfig
    from ..engine.build import build_engine
    from .gpu import result_path, run_metadata, write_result
    ap = argparse.ArgumentParser(prog="python -m peregrine.bench.profile_prefill", description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dummy-weights", action="store_true")
    ap.add_argument("--chunks", default="8192", help="comma-separated cold chunk lengths, each profiled (default 8192)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=0,
                    help="tokens per prefill step (default: the longest chunk, one step each); e.g. --chunks 32768 "
                         "--budget 8192 profiles a whole cold 32K prompt as bench ttft runs it, in 4 steps")
    ap.add_argument("--results-dir", default="results")
    ap.add_argument("--ab-runs", type=int, default=0,
                    help="per chunk, this many cold first tokens timed eagerly and with prefill graphs, interleaved "
                         "in one process (same machine, same moment), then a profile of each (default 0: eager only)")
    ap.add_argument("--shapes", action="store_true", help="also list aten ops by their own GPU time per input shapes")
    ap.add_argument("--stacks", action="store_true", help="record Python stacks: GPU idle gaps name the host code in them")
    ap.add_argument("--sync-debug", action="store_true",
                    help="per chunk, also the engine's host phases of an unprofiled cold first token and every op "
                         "that made the host wait for the GPU (torch's sync debug mode), with where it was issued")
    a = ap.parse_args(argv)
    chunks = [int(c) for c in a.chunks.split(",")]
    log = print
    ecfg = EngineConfig(max_num_seqs=2, max_model_len=max(a.context + TURN2_NEW_TOKENS, max(chunks)) + 8,
                        cuda_graphs=bool(a.ab_runs), max_num_batched_tokens=a.budget or max(chunks))
    eng, _ = build_engine(a.model, ecfg, dummy_weights=a.dummy_weights, log=log)
    V = eng.model_cfg.vocab_size
    graphs = getattr(eng.runner, "prefill", None)
    modes = {"eager": None, "prefill graphs": graphs} if graphs is not None else {"eager": None}
    cold, ab = {}, {}
    for n in chunks:
        for mode, pg in modes.items():
            eng.runner.prefill = pg
            first_token_s(eng, random_prompt(n, V, 1))  # warm-up: compiles, autotuning, the bucket's capture
        if graphs is not None:
            ms = {mode: [] for mode in modes}
            for r in range(a.ab_runs):
                for mode, pg in modes.items():
                    eng.runner.prefill = pg
                    ms[mode].append(first_token_s(eng, random_prompt(n, V, 100 + r)) * 1e3)
            ab[n] = ms
            log(f"{n} tokens cold, interleaved: " + "; ".join(
                f"{mode} median {sorted(v)[len(v) // 2]:.1f} ms {[round(x, 1) for x in v]}" for mode, v in ms.items()))
        for mode, pg in modes.items():
            eng.runner.prefill = pg
            log(f"cold prefill of one {n}-token prompt in steps of ≤ {eng.scheduler.max_num_batched_tokens} tokens ({mode})")
            cold[f"{n} {mode}"] = profile_call(lambda: first_token_s(eng, random_prompt(n, V, 2)), log, a.shapes, a.stacks)
            if a.sync_debug:
                cold[f"{n} {mode}"]["host"] = host_phases(eng, random_prompt(n, V, 6), log)
    eng.runner.prefill = graphs
    if not a.context:
        path = write_result(result_path(a.model, "profile-prefill", a.results_dir),
                            {"meta": run_metadata(), "chunks": chunks, "budget": eng.scheduler.max_num_batched_tokens,
                             "cold": cold, "ab_ms": ab})
        log(f"wrote {path}")
        return 0
    p = random_prompt(a.context, V, 3)
    first_token_s(eng, p)
    first_token_s(eng, p + random_prompt(TURN2_NEW_TOKENS, V, 4))  # warm-up of the turn-2 shapes
    log(f"turn 2: {TURN2_NEW_TOKENS} new tokens after a cached {a.context}-token prefix")
    turn2 = profile_call(lambda: first_token_s(eng, p + random_prompt(TURN2_NEW_TOKENS, V, 5)), log)
    path = write_result(result_path(a.model, "profile-prefill", a.results_dir),
                        {"meta": run_metadata(), "chunks": chunks, "context": a.context, "cold": cold, "ab_ms": ab,
                         "turn2": turn2})
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
