"""Experts across N ranks: tensor parallel inside every expert vs expert parallel, at B ≤ 8
(issue #9: measure, keep the winner). One GPU emulates one rank of each layout with the
fused MoE kernels (kernels/moe.py) at the model's real widths:

  tp  every rank: all B·k assignments, each expert's I/N rows (w13 [E, 2I/N, D], w2 [E, D, I/N])
  ep  rank r: only the assignments routed to its E/N experts (full rows), one row per
      assignment (k = 1); the step waits for the busiest rank, so its time is the max over ranks

Each layout is timed as REPS calls in one CUDA graph, as the decode step runs it (timing single
calls measured the host's launch cost, ~200 µs, not the kernels). Routes are seeded uniform top-k
draws (dummy-weight routing is close to uniform), the same for both. Prints median µs per layout and B and writes results/DATE-GPU-MODEL-moe-split-tpN-bench.json.

    python -m peregrine.bench.moe_split [--model kimi-linear-48b-a3b] [--tp 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from ..config import resolve_model

ROUTE_SEEDS = 4  # route draws per B (the EP imbalance varies with them)
ITERS = 50
REPS = 10  # calls per CUDA graph: timed on the device alone, without the per-call host launch cost


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="MoE split across ranks: TP inside experts vs expert parallel")
    ap.add_argument("--model", default="kimi-linear-48b-a3b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--results-dir", default="results")
    ap.add_argument("--device", default="cuda", help="cuda (timed); cpu runs the same calls once through the "
                                                      "Triton interpreter, a smoke test of the harness (times meaningless)")
    args = ap.parse_args(argv)
    from ..kernels.moe import moe_experts
    from . import gpu
    cfg, _ = resolve_model(args.model)
    if cfg.expert_quant is not None:
        print("error: BF16 experts only (the MXFP4 path has no fused kernel yet)", file=sys.stderr)
        return 2
    N, E, I, D, k = args.tp, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts_per_token
    dev = torch.device(args.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type == "cuda":  # µs per call, from a graph of REPS calls (a decode step is one graph too)
        timed = lambda fn: gpu.graph_time([fn] * REPS, ITERS)[0] * 1e3  # noqa: E731
    else:
        timed = lambda fn: (fn(), 0.0)[1]  # noqa: E731
    w13_tp = torch.randn(E, 2 * I // N, D, dtype=dt, device=dev) * D ** -0.5
    w2_tp = torch.randn(E, D, I // N, dtype=dt, device=dev) * (I // N) ** -0.5
    w13_ep = torch.randn(E // N, 2 * I, D, dtype=dt, device=dev) * D ** -0.5
    w2_ep = torch.randn(E // N, D, I, dtype=dt, device=dev) * I ** -0.5
    rows = []
    for B in [int(x) for x in args.batch_sizes.split(",")]:
        tp_us, ep_us = [], []
        for seed in range(ROUTE_SEEDS):
            g = torch.Generator().manual_seed(seed)
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(B)]).to(torch.int32)
            x = torch.randn(B, D, dtype=dt, device=dev)
            w = torch.rand(B, k, device=dev)
            idc = ids.to(dev)
            # the decode step's expert launches: partials + the fixed-order combine
            tp_us.append(timed(lambda: moe_experts(x, w13_tp, w2_tp, idc, w)))
            worst = 0.0
            for r in range(N):
                mine = (ids >= r * E // N) & (ids < (r + 1) * E // N)
                if not mine.any():
                    continue
                tok = mine.nonzero()[:, 0].to(dev)
                loc = (ids[mine] - r * E // N).view(-1, 1).to(torch.int32).to(dev)
                xs, ws = x[tok].contiguous(), w[mine.to(dev)].view(-1, 1).contiguous()
                t = timed(lambda: moe_experts(xs, w13_ep, w2_ep, loc, ws))
                worst = max(worst, t)
            ep_us.append(worst)
        row = {"batch": B, "tp_us": statistics.median(tp_us), "ep_us": statistics.median(ep_us)}
        row["winner"] = "tp" if row["tp_us"] <= row["ep_us"] else "ep"
        rows.append(row)
        print(f"B={B}: TP inside experts {row['tp_us']:.1f} µs, expert parallel (busiest rank) {row['ep_us']:.1f} µs "
              f"-> {row['winner']}", flush=True)
    path = gpu.write_result(gpu.result_path(f"{cfg.name}-moe-split-tp{N}", "bench", args.results_dir),
                            {"kind": "moe-split", "model": cfg.name, "tp": N, "metadata": gpu.run_metadata(), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
