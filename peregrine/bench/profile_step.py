"""Where a decode step's time goes: per-kernel GPU time of one step (eager, under
torch.profiler) next to the graph-replayed step time, per backend and B.

    python -m peregrine.bench.profile_step --model kimi-linear-48b-a3b --dummy-weights --batch-sizes 1,8
"""
from __future__ import annotations

import argparse
import collections
import gc

import torch

from . import gpu

STEPS = 10  # profiled eager steps per (backend, B); the per-step average is reported


def _device_us(ev) -> float:
    return getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)


def profile_backend(model: str, backend: str, batch_sizes, dummy: bool, log=print) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    from ..config import EngineConfig
    from ..engine import SamplingParams
    from ..engine.build import build_engine

    eng, _ = build_engine(model, EngineConfig(decode_backend=backend, max_num_seqs=max(batch_sizes), max_model_len=512),
                          dummy_weights=dummy, log=log)
    r = eng.runner
    seen = {}
    fwd = r.forward
    r.forward = lambda st: (seen.__setitem__("step", st), fwd(st))[1]
    rows = []
    for B in batch_sizes:
        ids = [eng.add_request([1 + i], SamplingParams(max_tokens=400, ignore_eos=True)) for i in range(B)]
        for _ in range(4):
            eng.step()
        st = seen["step"]
        assert st.is_decode and st.num_seqs == B
        eager = (lambda: r._step(st)) if backend != "standard" else (lambda: r._forward(st))
        for _ in range(3):
            eager()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                eager()
            torch.cuda.synchronize()
        per = collections.Counter()
        calls = collections.Counter()
        for ev in prof.key_averages():
            us = _device_us(ev)
            if us > 0:
                per[ev.key] += us / STEPS
                calls[ev.key] += ev.count / STEPS
        kernel_ms = sum(per.values()) / 1e3
        replay = r.graph_replay_time(B, 100)
        top = [{"kernel": k, "ms": v / 1e3, "calls": calls[k], "share": v / 1e3 / kernel_ms} for k, v in per.most_common(25)]
        rows.append({"backend": backend, "B": B, "kernel_ms_per_step": kernel_ms, "graph_replay_ms": replay,
                     "launches_per_step": sum(calls.values()), "top_kernels": top})
        log(f"{backend} B={B}: kernels {kernel_ms:.3f} ms/step over {sum(calls.values()):.0f} launches; graph replay {replay} ms")
        for t in top[:12]:
            log(f"   {t['ms']:8.4f} ms  {t['calls']:5.0f}x  {100 * t['share']:5.1f}%  {t['kernel'][:90]}")
        for i in ids:
            eng.abort(i)
        eng.step()
    del eng, r
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="kimi-linear-48b-a3b")
    ap.add_argument("--dummy-weights", action="store_true")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--backends", default="latency_specialized,standard")
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args()
    bs = [int(x) for x in a.batch_sizes.split(",")]
    copy = gpu.copy_bandwidth()
    rows = []
    for be in a.backends.split(","):
        rows += profile_backend(a.model, be, bs, a.dummy_weights)
        gc.collect()  # the engine sits in a reference cycle; two 92 GiB models do not fit together
        torch.cuda.empty_cache()
    path = gpu.write_result(gpu.result_path(a.model, "profile", a.results_dir),
                            {"meta": gpu.run_metadata(), "copy_bandwidth": copy, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
