"""Programmatic Dependent Launch microbenchmark (issue #5 item 4): one CUDA graph of a decode-like
chain, per layer add_rms_norm -> skinny GEMM 2304->12576 -> skinny GEMM 4096->2304 (the KDA input
and output projections of kimi-linear-48b-a3b), 27 layers with their own weights (2.1 GB, far past
L2), replayed with and without PDL at B = 1 and 8.

    python -m peregrine.bench.pdl            # ~1 min on an H200; JSON under results/

Modes: "plan" takes each GEMM's config from gemm_plan.json (cuBLAS where the plan says so: those
edges stay fully serialized), "triton" forces the Triton kernel (heuristic tiles) so every edge
can overlap. Each (mode, B) also checks that both graphs give bit-identical outputs. A failing
case is recorded with its error and skipped.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from peregrine.kernels import gemm
from peregrine.kernels.gemm import skinny_gemm
from peregrine.kernels.norm import add_rms_norm
from peregrine.kernels.pdl import pdl

HIDDEN, UP_N, DOWN_K = 2304, 12576, 4096  # Kimi-Linear hidden, fused KDA input projection, o_proj input
LAYERS = 27                               # Kimi-Linear's KDA layer count
EPS = 1e-5
ITERS = 50                                # replays timed per graph (each ~1-3 ms)
DTYPE = torch.bfloat16


class Chain:
    """Weights and static buffers of the chain; `step` launches it (captured or eager)."""

    def __init__(self, B: int, device, layers: int = LAYERS, hidden: int = HIDDEN, up_n: int = UP_N,
                 down_k: int = DOWN_K, mode: str = "plan", seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)
        rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=device) * scale).to(DTYPE)  # noqa: E731
        self.w1 = [rnd(up_n, hidden, scale=hidden ** -0.5) for _ in range(layers)]
        self.w2 = [rnd(hidden, down_k, scale=down_k ** -0.5) for _ in range(layers)]
        self.nw = [1 + rnd(hidden, scale=0.1) for _ in range(layers)]
        self.x0, self.r0 = rnd(B, hidden), rnd(B, hidden)
        self.x, self.r = self.x0.clone(), self.r0.clone()
        self.h = torch.empty(B, hidden, dtype=DTYPE, device=device)
        self.y1 = torch.empty(B, up_n, dtype=DTYPE, device=device)
        self.down_k = down_k
        self.cfg1 = self.cfg2 = None
        if mode == "triton":  # never cuBLAS: every edge is between two PDL-capable kernels
            self.cfg1, self.cfg2 = gemm.heuristic(B, up_n, hidden), gemm.heuristic(B, hidden, down_k)
        self.gemm_cfgs = [self.cfg1 or gemm.lookup(B, up_n, hidden), self.cfg2 or gemm.lookup(B, hidden, down_k)]

    def reset(self):
        self.x.copy_(self.x0)
        self.r.copy_(self.r0)

    def step(self):
        for w1, w2, nw in zip(self.w1, self.w2, self.nw):
            add_rms_norm(self.x, self.r, nw, EPS, out=self.h)
            skinny_gemm(self.h, w1, out=self.y1, config=self.cfg1)
            skinny_gemm(self.y1[:, :self.down_k], w2, out=self.x, config=self.cfg2)
        return self.x

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.w1 + self.w2 + self.nw)


def capture(chain: Chain, on: bool):
    with pdl(on):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # Triton compiles and allocator warm-up outside the capture
                chain.step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain.step()
    torch.cuda.synchronize()
    return g


def measure(B: int, mode: str, copy_gbps: float, layers: int = LAYERS) -> list[dict]:
    from peregrine.bench.gpu import time_fn
    chain = Chain(B, "cuda", layers=layers, mode=mode)
    graphs, outs, rows = {}, {}, []
    for on in (False, True):
        graphs[on] = capture(chain, on)
        chain.reset()
        graphs[on].replay()
        torch.cuda.synchronize()
        outs[on] = chain.x.clone()
    identical = bool(torch.equal(outs[False], outs[True]))
    nbytes = chain.weight_bytes() + 4 * layers * B * HIDDEN * 2  # + activations, negligible
    for on in (False, True):
        ms = time_fn(graphs[on].replay, iters=ITERS, warmup=5)
        med = statistics.median(ms)
        gbps = nbytes / (med * 1e-3) / 1e9
        rows.append({"B": B, "mode": mode, "pdl": on, "replay_ms": med, "bytes": nbytes, "gbps": gbps,
                     "pct_of_copy": gbps / copy_gbps, "layers": layers, "bit_identical": identical,
                     "gemm_configs": chain.gemm_cfgs, "samples_ms": ms})
    rows[1]["speedup"] = rows[0]["replay_ms"] / rows[1]["replay_ms"]
    del graphs, chain
    torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    out = ["| mode | B | PDL | replay ms | GB/s | % copy BW | speedup | bit-identical |", "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['mode']} | {r['B']} | error: {r['error'][:80]} |")
            continue
        out.append(f"| {r['mode']} | {r['B']} | {'on' if r['pdl'] else 'off'} | {r['replay_ms']:.3f} | {r['gbps']:.0f} | "
                   f"{100 * r['pct_of_copy']:.1f} | {r.get('speedup', 1.0):.3f} | {r['bit_identical']} |")
    return "\n".join(out)


def main():
    from peregrine.bench.gpu import copy_bandwidth, result_path, run_metadata, write_result
    from peregrine.kernels.pdl import supported
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--modes", default="plan,triton")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args()
    if not supported("cuda", None):
        raise SystemExit("PDL needs a Hopper-or-newer CUDA GPU (and TRITON_INTERPRET unset)")
    copy = copy_bandwidth()
    rows = []
    for mode in a.modes.split(","):
        for B in (int(v) for v in a.batch_sizes.split(",")):
            try:
                rows += measure(B, mode, copy["gbps"], a.layers)
            except Exception as e:  # one broken case must not lose the others
                rows.append({"B": B, "mode": mode, "error": f"{type(e).__name__}: {e}"})
                torch.cuda.synchronize()
            print(table(rows[-2:]), flush=True)
    meta = run_metadata() | {"copy_gbps": copy["gbps"], "copy_samples_ms": copy["samples_ms"]}
    path = write_result(result_path("kernels", "pdl", a.results_dir), {"meta": meta, "rows": rows})
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s\n{table(rows)}\n-> {path}")


if __name__ == "__main__":
    main()
