"""The prefill MoE's expert GEMMs against their floors (docs/benchmarks.md §2): models/moe.py grouped_experts
(sort, the two grouped GEMMs, the SwiGLU-weight and combine glue) and its two grouped GEMMs alone, at a
step's token counts from a turn-2 step (64) to a whole 32K prompt, Kimi-Linear widths (256 experts,
top-8, I = 1024, D = 2304), uniform random routing (dummy weights route about so). Reported against the
weight-read floor (the experts the step uses, at the copy bandwidth measured in the same run) and the
compute floor (PEAK_TFLOPS): which one binds, and how far each step size is from it.
    python -m peregrine.bench.moe_grouped [--quick]
"""
from __future__ import annotations

import torch

from peregrine.bench.gpu import graph_time
from peregrine.bench.ttft import PEAK_TFLOPS
from peregrine.models.layers import swiglu
from peregrine.models.moe import grouped_experts

TOKENS = (64, 256, 1024, 2048, 8192, 32768)
QUICK_TOKENS = (64, 1024, 8192)
E, TOP_K, I, D = 256, 8, 1024, 2304
DTYPE = torch.bfloat16
DEVICE = "cuda"


def _routing(N: int, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    scores = torch.rand(N, E, device=DEVICE, generator=g)
    w, ids = scores.topk(TOP_K, -1)
    return ids, w / w.sum(-1, keepdim=True)


def run(copy_gbps: float, full: bool = True, iters: int = 10) -> list[dict]:
    w13 = (torch.randn(E, 2 * I, D, device=DEVICE) * 0.02).to(DTYPE)
    w2 = (torch.randn(E, D, I, device=DEVICE) * 0.02).to(DTYPE)
    per_expert = (w13[0].numel() + w2[0].numel()) * DTYPE.itemsize
    rows = []
    for N in TOKENS if full else QUICK_TOKENS:
        x = torch.randn(N, D, device=DEVICE).to(DTYPE)
        ids, w = _routing(N, N)
        used = int(torch.unique(ids).numel())
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        xs = x[order // TOP_K]
        counts = torch.zeros(E, dtype=torch.int64, device=DEVICE).scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = torch.empty(N * TOP_K, I, device=DEVICE, dtype=DTYPE)

        def gemms():
            torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
            torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
        t_all, s_all = graph_time([lambda: grouped_experts(x, w13, w2, ids, w, swiglu)], iters)
        t_mm, s_mm = graph_time([gemms], iters)
        wbytes = used * per_expert
        act = N * TOP_K * (D + 2 * I + I + D) * DTYPE.itemsize  # xs read, gu written, h read, ys written (the GEMMs' own traffic)
        flop = 2 * N * TOP_K * (2 * I * D + I * D)
        floor_read = (wbytes + act) / copy_gbps / 1e6
        floor_comp = flop / PEAK_TFLOPS / 1e9
        rows.append({"tokens": N, "experts_used": used, "weight_bytes": wbytes, "act_bytes": act, "flop": flop,
                     "layer_ms": t_all, "gemms_ms": t_mm, "read_floor_ms": floor_read, "compute_floor_ms": floor_comp,
                     "gemms_pct_of_floor": max(floor_read, floor_comp) / t_mm,
                     "gemms_gbps": (wbytes + act) / t_mm / 1e6, "gemms_tflops": flop / t_mm / 1e9,
                     "pct_of_copy": (wbytes + act) / t_mm / 1e6 / copy_gbps,
                     "layer_samples_ms": s_all, "gemms_samples_ms": s_mm})
        del x, xs, h
        torch.cuda.empty_cache()
    return rows


def main():
    from peregrine.bench.gpu import family_main
    family_main("moe-grouped", run, lambda r: (
        f"{r['tokens']:>6} tokens ({r['experts_used']:>3} experts): grouped_experts {r['layer_ms']:8.3f} ms, its GEMMs "
        f"{r['gemms_ms']:8.3f} ms = {r['gemms_gbps']:6.0f} GB/s ({100 * r['pct_of_copy']:5.1f}% of copy), "
        f"{r['gemms_tflops']:6.1f} TFLOP/s; floors read {r['read_floor_ms']:.3f} / compute {r['compute_floor_ms']:.3f} ms "
        f"-> {100 * r['gemms_pct_of_floor']:5.1f}% of floor"), doc=__doc__)


if __name__ == "__main__":
    main()

