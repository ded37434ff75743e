"""Where the engine's host memory goes (issue #47): `python -m peregrine.bench.host_alloc`.

1. Per step phase, the host allocations of a few decode steps (torch.profiler's memory events, grouped by
   the engine's own peregrine.* ranges: build_step, forward, sample, ...): how many ops allocate, and bytes.
2. Waves of mixed requests (greedy and seeded sampling, logprobs, prompts of 8-600 tokens) through
   LLMEngine.generate: after each wave the resident size and glibc's own account (mallinfo2: heap held,
   in use, free but kept, mmapped), so what the allocator keeps is seen next to what the program uses.
Run it with PEREGRINE_MALLOC_TRIM_S=0 to see the allocator without the engine's trims.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import time

import torch

from ..config import EngineConfig
from ..engine.build import build_engine
from ..engine.request import SamplingParams
from ..host_memory import malloc_info, rss_bytes, trim_period

MB = 2**20


def phase_allocations(eng, steps: int = 10, rows: int = 4, seed: int = 0) -> dict:
    """{phase: (allocating ops per step, KiB per step)} over `steps` decode steps of `rows` sequences."""
    rng = random.Random(seed)
    for i in range(rows):
        eng.add_request([rng.randint(32, 126) for _ in range(rng.randint(50, 300))],
                        SamplingParams(max_tokens=steps + 8, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True))
    for _ in range(3):  # prefill, first decodes
        eng.step()
    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts, profile_memory=True) as prof:
        for _ in range(steps):
            eng.step()
    count, nbytes = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.self_cpu_memory_usage <= 0:
            continue
        p, label = e.cpu_parent, "outside the engine's ranges"
        while p is not None:
            if p.name.startswith("peregrine."):
                label = p.name
                break
            p = p.cpu_parent
        count[label] += 1
        nbytes[label] += e.self_cpu_memory_usage
    while eng.has_unfinished():
        eng.step()
    return {k: {"allocating_ops_per_step": count[k] / steps, "kib_per_step": round(nbytes[k] / steps / 1024, 1)}
            for k in count}


def waves(eng, n: int, per_wave: int = 32, seed: int = 0, log=print) -> list[dict]:
    rng, out, t0 = random.Random(seed), [], time.time()
    for w in range(n):
        prompts, params = [], []
        for i in range(per_wave):
            prompts.append([rng.randint(32, 126) for _ in range(rng.randint(8, 600))])
            params.append(SamplingParams(max_tokens=rng.randint(4, 48), temperature=0.8 if i % 2 else 0.0, seed=i,
                                         logprobs=rng.choice([None, 3])))
        eng.generate(prompts, params)
        row = {"wave": w, "seconds": round(time.time() - t0, 1), "rss_mb": round(rss_bytes() / MB, 1),
               **{f"malloc_{k}_mb": round(v / MB, 1) for k, v in (malloc_info() or {}).items()}}
        log(json.dumps(row))
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="peregrine-tiny")
    ap.add_argument("--waves", type=int, default=12)
    ap.add_argument("--out", default=None, help="write the JSON here")
    a = ap.parse_args()
    eng, _ = build_engine(a.model, EngineConfig(), log=lambda *x: None)
    res = {"model": a.model, "trim_period_s": trim_period(), "rss_start_mb": round(rss_bytes() / MB, 1),
           "phases": phase_allocations(eng)}
    print(json.dumps(res["phases"], indent=1))
    res["waves"] = waves(eng, a.waves)
    from .gpu import run_metadata
    res["meta"] = run_metadata()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
