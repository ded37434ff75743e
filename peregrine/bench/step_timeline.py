"""Where a captured decode step's time goes: the kernel timeline of CUDA graph replays (not eager
steps: their launch gaps are the host's, not the graph's), per B.

    python -m peregrine.bench.step_timeline --model kimi-linear-48b-a3b --dummy-weights --batch-sizes 1,8

Each kernel's cost is its *increment*: every instant of the step is charged to the earliest-started
kernel running then, idle time to the next kernel to start. With PDL a kernel starts early and waits
under its predecessor, so its duration overstates it; increments sum to the step's span exactly. Kernels group by name and grid
(one GEMM shape per grid). The JSON keeps one replay's whole sequence for per-layer reading.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import tempfile

REPLAYS = 10  # profiled replays per B; every figure is their per-replay mean
TOKEN_STRIDE = 7919  # --distinct-tokens: row b's token is 1 + b * this (mod the vocabulary), a prime apart


def distinct_tokens(B: int, vocab: int) -> list[int]:
    """One token per batch row, all different (B ≤ vocab - 1), none of them 0 (the capture's token)."""
    ids = [1 + b * TOKEN_STRIDE % (vocab - 1) for b in range(B)]
    if len(set(ids)) < B:  # a vocabulary the stride divides: consecutive ids instead
        ids = list(range(1, B + 1))
    return ids


def kernel_events(trace: dict) -> list[dict]:
    """The kernels of a chrome trace (torch.profiler's export): name, start and end in µs, stream, grid."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") != "kernel" or "dur" not in e:
            continue
        a = e.get("args", {})
        out.append({"name": e["name"], "ts": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"]),
                    "stream": a.get("stream"), "grid": tuple(a.get("grid", ()))})
    return sorted(out, key=lambda k: k["ts"])


def split_replays(events: list[dict], n: int) -> list[list[dict]]:
    """n replays of one graph launch the same kernels: equal consecutive runs by start time."""
    if n <= 0 or len(events) % n:
        raise ValueError(f"{len(events)} kernels do not split into {n} equal replays")
    k = len(events) // n
    return [events[i * k:(i + 1) * k] for i in range(n)]


def increments(seq: list[dict]) -> list[float]:
    """Per kernel (in seq's order) the step time charged to it, in µs: each instant goes to the
    earliest-started kernel running then (a PDL kernel waiting under its predecessor, or a side-stream
    kernel under a longer one, costs only what it outlives), idle time to the next kernel to start.
    They sum to the span."""
    inc = [0.0] * len(seq)
    t = min(k["ts"] for k in seq)
    for i in sorted(range(len(seq)), key=lambda i: (seq[i]["ts"], seq[i]["end"])):
        inc[i] = max(0.0, seq[i]["end"] - t)
        t = max(t, seq[i]["end"])
    return inc


def busy_us(seq: list[dict]) -> float:
    """The union of the kernels' intervals: time with at least one kernel on the GPU."""
    total, cur_s, cur_e = 0.0, None, None
    for k in sorted(seq, key=lambda k: k["ts"]):
        if cur_e is None or k["ts"] > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = k["ts"], k["end"]
        else:
            cur_e = max(cur_e, k["end"])
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def summarize(replays: list[list[dict]]) -> dict:
    """Per-replay means: span, busy, the count of kernels that started before their predecessor ended
    (PDL overlap), and per (name, grid) group its launches, summed duration and summed increment."""
    groups = collections.defaultdict(lambda: [0, 0.0, 0.0])
    spans, busy, early = [], [], []
    for seq in replays:
        inc = increments(seq)
        spans.append(max(k["end"] for k in seq) - min(k["ts"] for k in seq))
        busy.append(busy_us(seq))
        early.append(sum(1 for a, b in zip(seq, seq[1:]) if b["ts"] < a["end"]))
        for k, d in zip(seq, inc):
            g = groups[(k["name"], k["grid"])]
            g[0] += 1
            g[1] += k["end"] - k["ts"]
            g[2] += d
    n = len(replays)
    rows = [{"kernel": name, "grid": list(grid), "calls": c / n, "dur_us": d / n, "inc_us": i / n}
            for (name, grid), (c, d, i) in groups.items()]
    rows.sort(key=lambda r: -r["inc_us"])
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    return {"span_us": mean(spans), "busy_us": mean(busy), "early_starts": mean(early),
            "kernels": len(replays[0]), "groups": rows}


def sequence(seq: list[dict]) -> list[dict]:
    """One replay as rows: name, grid, stream, start offset, duration and increment (µs)."""
    t0 = min(k["ts"] for k in seq)
    return [{"kernel": k["name"], "grid": list(k["grid"]), "stream": k["stream"], "start_us": k["ts"] - t0,
             "dur_us": k["end"] - k["ts"], "inc_us": d} for k, d in zip(seq, increments(seq))]


def profile_replays(replay, n: int = REPLAYS) -> list[list[dict]]:
    import torch
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            replay()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    return split_replays(kernel_events(trace), n)


def run(model: str, batch_sizes, dummy: bool, log=print, distinct: bool = False) -> list[dict]:
    import torch

    from ..config import EngineConfig
    from ..engine.build import build_engine
    eng, _ = build_engine(model, EngineConfig(decode_backend="latency_specialized", max_num_seqs=max(batch_sizes),
                                              max_model_len=512), dummy_weights=dummy, log=log)
    graphs = eng.runner.graphs
    rows = []
    for B in batch_sizes:
        ids = torch.tensor(distinct_tokens(B, eng.runner.model.cfg.vocab_size), device="cuda") if distinct else None
        replay = graphs.scratch_replay(B, ids) if graphs is not None else None
        if replay is None:
            log(f"B={B}: no captured graph, skipped")
            continue
        replays = profile_replays(replay)
        s = summarize(replays)
        s.update(B=B, replay_ms=eng.runner.graph_replay_time(B, 100), sequence=sequence(replays[-1]),
                 tokens="distinct" if distinct else "one for every row")
        rows.append(s)
        log(f"B={B}: graph replay {s['replay_ms']:.3f} ms; profiled span {s['span_us'] / 1e3:.3f} ms, GPU busy "
            f"{s['busy_us'] / 1e3:.3f} ms, {s['kernels']} kernels, {s['early_starts']:.0f} start before their predecessor ends")
        log("    inc µs   dur µs  calls  kernel [grid]")
        for g in s["groups"][:25]:
            log(f"  {g['inc_us']:8.1f} {g['dur_us']:8.1f} {g['calls']:6.0f}  {g['kernel'][:70]} {g['grid']}")
    del eng, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    from . import gpu
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="kimi-linear-48b-a3b")
    ap.add_argument("--dummy-weights", action="store_true")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--distinct-tokens", action="store_true",
                    help="a different token in every batch row (the MoE then routes as a real batch does; "
                         "default: the capture's one token in every row, so B > 1 rows choose the same experts)")
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args()
    copy = gpu.copy_bandwidth()
    rows = run(a.model, [int(x) for x in a.batch_sizes.split(",")], a.dummy_weights, distinct=a.distinct_tokens)
    path = gpu.write_result(gpu.result_path(a.model, "step-timeline", a.results_dir),
                            {"meta": gpu.run_metadata(), "copy_bandwidth": copy, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
