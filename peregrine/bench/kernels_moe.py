"""Fused MoE decode microbenchmark (BENCHMARKS.md §2), Kimi-Linear real shapes.

Ours (route + experts, both down paths) is timed as a CUDA graph of REPS calls,
each on a different x, hence a different random routing: the 3.6 GB of expert
weights far exceed the 60 MB L2 and consecutive calls touch different experts,
so weights stream from HBM. Bytes = distinct experts actually routed (counted on
the host, outside the timed region) × expert bytes + router + activations.
The standard path (eager PyTorch, loop over distinct experts, host sync) is timed
per call over the same rotating inputs.
    python -m peregrine.bench.kernels_moe [--quick]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from peregrine.kernels.moe import moe_forward, moe_route

D, I, E, TOP_K, SCALING = 2304, 1024, 256, 8, 2.446  # kimi-linear-48b-a3b MoE layer
BS = (1, 2, 4, 8)
REPS = 16  # calls (= routing sets) per graph replay: amortises the replay launch, rotates experts
DTYPE = torch.bfloat16


def standard_moe(x, gate_w, bias, w13, w2, top_k=TOP_K, scaling=SCALING):
    """The plain eager path: router in FP32, then one pair of matmuls per distinct expert."""
    s = torch.sigmoid(x.float() @ gate_w.float().t())
    ids = torch.topk(s + bias, top_k, dim=-1).indices
    w = s.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * scaling
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():  # host sync: the reason this path cannot be graph-captured
        tok, slot = (ids == e).nonzero(as_tuple=True)
        g, u = (x[tok] @ w13[e].t()).split(w13.shape[1] // 2, dim=-1)
        y = (F.silu(g) * u) @ w2[e].t()
        out.index_add_(0, tok, y.float() * w[tok, slot, None])
    return out.to(x.dtype)


class Case:
    def __init__(self, B: int, dtype=DTYPE):
        g = torch.Generator(device="cuda").manual_seed(B)
        r = lambda *s, scale: (torch.randn(*s, device="cuda", generator=g) * scale).to(dtype)  # noqa: E731
        self.w13 = r(E, 2 * I, D, scale=D ** -0.5)
        self.w2 = r(E, D, I, scale=I ** -0.5)
        self.gate_w = r(E, D, scale=D ** -0.5)
        self.bias = torch.randn(E, device="cuda", generator=g) * 0.02
        self.xs = [r(B, D, scale=1.0) for _ in range(REPS)]
        self.out = torch.empty(B, D, device="cuda", dtype=dtype)
        distinct = [moe_route(x, self.gate_w, self.bias, TOP_K, True, SCALING)[0].unique().numel() for x in self.xs]
        self.distinct = statistics.mean(distinct)
        esz = torch.finfo(dtype).bits // 8
        expert_bytes = 3 * I * D * esz
        self.bytes = self.distinct * expert_bytes + E * D * esz + 2 * B * D * esz
        self.B = B

    def call(self, x, down):
        moe_forward(x, self.gate_w, self.bias, self.w13, self.w2, TOP_K, True, SCALING, out=self.out, down=down)

    def time_graph(self, down: str, iters: int) -> list[float]:
        from peregrine.bench.gpu import time_fn
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for x in self.xs[:3]:  # compile + allocator warm-up outside capture
                self.call(x, down)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for x in self.xs:
                self.call(x, down)
        samples = [t / REPS for t in time_fn(graph.replay, iters=iters, warmup=3)]
        del graph
        return samples

    def time_standard(self, iters: int) -> list[float]:
        from peregrine.bench.gpu import time_fn
        it = iter(range(1 << 30))
        return time_fn(lambda: standard_moe(self.xs[next(it) % REPS], self.gate_w, self.bias, self.w13, self.w2),
                       iters=iters, warmup=5)


def run(copy_gbps: float, full: bool = True, iters: int = 30) -> list[dict]:
    """One row per B: ours (fused and partials down paths) and the standard eager path."""
    rows = []
    for B in BS if full else (1, 8):
        case = Case(B)
        row = {"kernel": "moe_route+experts", "B": B, "D": D, "I": I, "E": E, "top_k": TOP_K,
               "distinct_experts": case.distinct, "bytes": case.bytes}
        for name, samples in (("fused", case.time_graph("fused", iters)),
                              ("partials", case.time_graph("partials", iters)),
                              ("standard", case.time_standard(iters))):
            t = statistics.median(samples)
            gbps = case.bytes / t / 1e6
            row.update({f"{name}_ms": t, f"{name}_gbps": gbps, f"{name}_pct_of_copy": gbps / copy_gbps,
                        f"{name}_samples_ms": samples})
        row.update(time_ms=row["fused_ms"], gbps=row["fused_gbps"], pct_of_copy=row["fused_pct_of_copy"])
        rows.append(row)
        del case
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    from peregrine.bench.gpu import copy_bandwidth, result_path, run_metadata, write_result
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="B = 1 and 8 only")
    args = ap.parse_args()
    copy = copy_bandwidth()
    rows = run(copy["gbps"], full=not args.quick)
    for r in rows:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if "samples" not in k}))
    path = write_result(result_path("kimi-linear-48b-a3b", "kernels-moe"),
                        {"meta": run_metadata(), "copy": copy, "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
