"""All-reduce microbenchmark at the decode step's real message sizes (B x hidden BF16):
NCCL against the one-shot symmetric-memory all-reduce (parallel/symm.py), each
timed inside a CUDA graph of REPS back-to-back all-reduces, as the decode step
replays them.

    python -m peregrine.bench.allreduce [--world 2] [--hidden 2304,7168] [--batch-sizes 1,...,8]

Reports per variant and size: median µs per all-reduce, algorithm bandwidth
(bytes / time), bus bandwidth (x 2(N-1)/N, NCCL's convention) and its % of the
HBM copy bandwidth measured in the same run; results/DATE-GPU-tpN-allreduce.json (N = --world).
A variant that fails (or whose sum is wrong) is reported and skipped.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import traceback

import torch

REPS = 20     # all-reduces per graph replay: launch overhead amortised, as in a 54-all-reduce decode step
ITERS = 30    # timed replays
WARMUP = 5


def _time_graph(fn, reps: int = REPS) -> float:
    """Median µs of one fn() call, timed as a CUDA graph of `reps` calls."""
    from .gpu import time_fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    torch.cuda.synchronize()
    return statistics.median(time_fn(g.replay, iters=ITERS, warmup=WARMUP)) * 1e3 / reps


def _rank(rank: int, world: int, port: int, hiddens: list[int], batches: list[int], q) -> None:
    from ..parallel.launch import _join
    from ..parallel.symm import OneShot
    tp = _join(rank, world, rank, "cuda", f"tcp://127.0.0.1:{port}")
    dev, dt = tp.device, torch.bfloat16
    rows = []
    for D in hiddens:
        oneshot = OneShot.create(tp, max(batches), D, dt, dev, log=(print if rank == 0 else None))
        for B in batches:
            x = torch.full((B, D), float(rank + 1), dtype=dt, device=dev)
            want = float(world * (world + 1) // 2)
            variants = {"nccl": lambda: tp.all_reduce(x)}
            if oneshot is not None:  # the partial already in the buffer (the fused GEMM epilogue), or copied in
                variants["oneshot_symm"] = lambda: oneshot.all_reduce(oneshot.buffer(B))
                variants["oneshot_symm_copy"] = lambda: oneshot.all_reduce(x)
            for name, fn in variants.items():
                r = {"variant": name, "hidden": D, "batch": B, "bytes": B * D * 2}
                try:
                    x.fill_(rank + 1)
                    if oneshot is not None:
                        oneshot.reset()
                        oneshot.buffer(B).fill_(rank + 1)
                    if not bool((fn() == want).all()):
                        raise RuntimeError("wrong sum")
                    if oneshot is not None:
                        oneshot.reset()
                    us = _time_graph(fn)
                    alg = r["bytes"] / (us * 1e-6) / 1e9
                    r.update(status="ok", us=us, algbw_gbps=alg, busbw_gbps=alg * 2 * (world - 1) / world)
                except Exception as e:
                    r.update(status="error", reason=repr(e), traceback=traceback.format_exc())
                rows.append(r)
    if rank == 0:
        q.put(rows)
    import torch.distributed as dist
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="all-reduce microbenchmark: one-shot symmetric memory vs NCCL")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", default="2304,7168", help="kimi-linear-48b-a3b and K3 hidden sizes")
    ap.add_argument("--batch-sizes", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--results-dir", default="results")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < args.world:
        print(f"error: needs {args.world} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp
    from ..parallel.launch import _free_port, set_env
    from . import gpu
    set_env()
    copy = gpu.copy_bandwidth()
    hiddens = [int(x) for x in args.hidden.split(",")]
    batches = [int(x) for x in args.batch_sizes.split(",")]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    ps = [ctx.Process(target=_rank, args=(r, args.world, port, hiddens, batches, q)) for r in range(args.world)]
    for p in ps:
        p.start()
    rows = q.get(timeout=540)
    for p in ps:
        p.join(timeout=60)
    for r in rows:
        if r["status"] == "ok":
            r["pct_copy_bw"] = r["busbw_gbps"] / copy["gbps"] * 100
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s (same run); world {args.world}; µs per all-reduce in a graph of {REPS}")
    print(f"{'hidden':>6} {'B':>2} {'bytes':>6} | {'nccl µs':>8} {'busGB/s':>8} | {'1shot µs':>8} {'busGB/s':>8} | "
          f"{'+copy µs':>8} {'busGB/s':>8} | speedup")
    by = {(r["hidden"], r["batch"], r["variant"]): r for r in rows}
    for D in hiddens:
        for B in batches:
            n, o, c = (by.get((D, B, v), {}) for v in ("nccl", "oneshot_symm", "oneshot_symm_copy"))
            f = lambda r: (f"{r['us']:8.2f} {r['busbw_gbps']:8.1f}" if r.get("status") == "ok" else f"{'n/a':>8} {'':>8}")  # noqa: E731
            sp = f"{n['us'] / o['us']:.2f}x" if n.get("status") == o.get("status") == "ok" else "-"
            print(f"{D:>6} {B:>2} {B * D * 2:>6} | {f(n)} | {f(o)} | {f(c)} | {sp}")
    bad = [r for r in rows if r["status"] != "ok"]
    for r in bad:
        print(f"FAILED {r['variant']} hidden {r['hidden']} B {r['batch']}: {r['reason']}")
    path = gpu.write_result(gpu.result_path(f"tp{args.world}", "allreduce", args.results_dir),
                            {"kind": "allreduce", "world": args.world, "reps_per_graph": REPS, "metadata": gpu.run_metadata(),
                             "copy_bandwidth": {k: v for k, v in copy.items() if k != "samples_ms"}, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
