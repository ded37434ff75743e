"""MXFP4 routed-expert microbenchmark (docs/benchmarks.md §2) at K3 expert widths: latent 3584,
expert inter 3072, top-16 of 192 experts (k3-slice), B = 1..8.

Timed as a CUDA graph of REPS calls, each with a different routing (so weights stream
from HBM: 192 MXFP4 experts are 3.4 GB, far past the 60 MB L2). GB/s counts the
packed bytes (codes + E8M0 scales) of the distinct experts each call routes, plus
activations. Side by side in the same run: the BF16 expert kernel (kernels/moe.py,
SiTU, 3.6x the bytes) and the standard path's dequantize-then-GEMM
(models/moe.mxfp4_experts, eager). The MXFP4 kernels (kernels/moe_mxfp4_v3.py, through
moe_mxfp4_experts) and v4 (kernels/moe_mxfp4_v4.py over the load-time repack) get a tile sweep each;
a config whose output disagrees with the FP32 reference is skipped and reported, never timed. v3_* / v4_*
fields are each form's fastest config; time_ms/gbps/pct_of_copy the fastest of both (mx_kernel).
    python -m peregrine.bench.kernels_moe_mxfp4 [--quick] [--v4] [--verify] [--probe]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from peregrine.kernels import moe_mxfp4 as mx
from peregrine.kernels import moe_mxfp4_v3 as mx3
from peregrine.kernels import moe_mxfp4_v4 as mx4
from peregrine.kernels import mxfp4_repack
from peregrine.kernels import mxfp4_format as mxfp4
from peregrine.kernels.moe import moe_experts

DZ, I, E, TOP_K = 3584, 3072, 192, 16  # k3-slice routed experts (latent width, inter, experts, top-k)
BS = (1, 2, 4, 8)
REPS = 16      # routings per graph replay: rotates experts, amortises the replay launch
TOL = 2e-2     # BF16 operands: relative RMS error against the FP32 reference
V3_SWEEP = [   # mx3.KEYS order: DECODE, UP_BLOCK_I, UP_BLOCK_KB, UP_WARPS, UP_STAGES, DOWN_BLOCK_D, DOWN_BLOCK_KB,
    #            DOWN_WARPS, DOWN_STAGES; the first is the default
    tuple(mx3.DEFAULTS[k] for k in mx3.KEYS),
    ("asm", 128, 32, 8, 4, 128, 32, 8, 4),   # B <= 4's (BY_BATCH)
    ("asm", 64, 32, 4, 4, 64, 32, 4, 4),     # B = 8's
    ("asm", 128, 64, 8, 4, 128, 64, 8, 4),
    ("asm", 256, 32, 8, 4, 256, 32, 8, 4),
    ("dot_scaled", 64, 64, 4, 3, 64, 64, 4, 3),
    ("plain", 64, 64, 4, 3, 64, 64, 4, 3),
]
V4_SWEEP = [   # mx4.KEYS order: BLOCK_I, BLOCK_D, BK, STAGES, WARPS; None: mx4's defaults for the B (first)
    None, (64, 128, 64, 6, 4), (64, 128, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 64, 8, 4),
    (64, 64, 64, 6, 4), (128, 256, 64, 4, 8), (128, 256, 128, 3, 8), (64, 128, 128, 3, 4),
    # around B = 1's best (two warpgroups): the down grid's wave count (narrower BLOCK_D), a deeper ring
    (128, 128, 64, 4, 8), (128, 256, 64, 6, 8), (128, 256, 128, 4, 8),
]
VERIFY_BS = (16, 32, 64)  # verify steps' rows (--verify): v4 and BF16 only (v3 takes at most 16 tokens a tile)
PROBE = [      # --probe: v3's measurement stand-ins (wrong values, timed unchecked) beside asm at the same tiles:
    #            "probe" (a 4-move decode) is what the load pipeline and MMAs cost, "probe_bf16" (the tile's bytes
    #            as BF16 to the MMA from shared memory) the ceiling without the register operand
    ("probe", 128, 32, 8, 4, 128, 32, 8, 4), ("asm", 128, 32, 8, 4, 128, 32, 8, 4),
    ("probe", 64, 32, 4, 4, 64, 32, 4, 4), ("asm", 64, 32, 4, 4, 64, 32, 4, 4),
    ("probe", 128, 32, 8, 8, 128, 32, 8, 8),
    # wider row segments per step (the BF16 experts stream 256-512 contiguous bytes a row a step, v3 32)
    ("probe", 128, 64, 8, 4, 128, 64, 8, 4), ("probe", 64, 128, 4, 3, 64, 128, 4, 3),
    ("probe", 128, 128, 8, 3, 128, 128, 8, 3), ("probe", 32, 256, 4, 3, 32, 256, 4, 3),
    ("probe", 16, 256, 4, 3, 16, 256, 4, 3),
    ("asm", 64, 128, 4, 3, 64, 128, 4, 3), ("asm", 32, 256, 4, 3, 32, 256, 4, 3),
    ("probe_bf16", 128, 32, 8, 4, 128, 32, 8, 4), ("probe_bf16", 64, 32, 4, 4, 64, 32, 4, 4),
    ("probe_bf16", 64, 128, 4, 4, 64, 128, 4, 4), ("probe_bf16", 32, 256, 4, 4, 32, 256, 4, 4),
]


def mx_expert_bytes() -> float:
    """w1, w3, w2 of one expert: half a byte a value plus one scale byte per 32 values."""
    return 3 * I * DZ * (0.5 + 1 / mxfp4.GROUP)


class Weights:
    def __init__(self, bf16: bool):
        g = torch.Generator(device="cuda").manual_seed(0)
        u8 = lambda *s: torch.randint(0, 256, s, device="cuda", generator=g, dtype=torch.uint8)  # noqa: E731
        self.q13, self.q2 = u8(E, 2 * I, DZ // 2), u8(E, DZ, I // 2)
        self.s13 = torch.full((E, 2 * I, DZ // 32), 127 - 7, dtype=torch.uint8, device="cuda")  # RMS ~ 0.02
        self.s2 = torch.full((E, DZ, I // 32), 127 - 7, dtype=torch.uint8, device="cuda")
        self.w13 = self.w2 = None
        if bf16:  # the same values in BF16 (12.7 GB), dequantized 8 experts at a time
            self.w13 = torch.empty(E, 2 * I, DZ, dtype=torch.bfloat16, device="cuda")
            self.w2 = torch.empty(E, DZ, I, dtype=torch.bfloat16, device="cuda")
            for a in range(0, E, 8):
                self.w13[a:a + 8] = mxfp4.dequantize(self.q13[a:a + 8], self.s13[a:a + 8], torch.bfloat16)
                self.w2[a:a + 8] = mxfp4.dequantize(self.q2[a:a + 8], self.s2[a:a + 8], torch.bfloat16)

    def mx(self):
        return self.q13, self.s13, self.q2, self.s2

    def v4(self):
        """The same weights in kernels/mxfp4_repack.py's layout (made once)."""
        if not hasattr(self, "_v4"):
            self._v4 = (*mxfp4_repack.repack(self.q13, self.s13), *mxfp4_repack.repack(self.q2, self.s2))
            self.v4_fold = mx4.fold_scales(self.s13, self.s2)  # the folded-scale decode (checked once)
        return self._v4


def routings(B: int):
    g = torch.Generator(device="cuda").manual_seed(B)
    out = []
    for _ in range(REPS):
        logits = torch.randn(B, E, device="cuda", generator=g)
        ids = torch.topk(logits, TOP_K, dim=-1).indices.to(torch.int32)
        w = torch.softmax(torch.gather(logits, 1, ids.long()), -1)
        out.append((torch.randn(B, DZ, device="cuda", generator=g).to(torch.bfloat16), ids.contiguous(), w))
    return out


def time_graph(fn, calls, iters: int) -> list[float]:
    from peregrine.bench.gpu import time_fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:2]:  # compile + allocator warm-up outside the capture
            fn(*c)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            fn(*c)
    samples = [t / len(calls) for t in time_fn(graph.replay, iters=iters, warmup=3)]
    del graph
    return samples


def _sweep(B: int, key: str, configs: list[dict], fn, calls, ref, nbytes: float, iters: int, sweep: list, log):
    """Each config checked against the FP32 reference on calls[0], then timed over all calls as a CUDA graph;
    every outcome appended to `sweep` under `key`; a failing config is reported, not fatal. -> (ms, config) of the
    fastest, or None."""
    best = None
    x, ids, w = calls[0]
    for c in configs:
        try:
            err = (fn(x, ids, w, c).float() - ref).norm() / ref.norm()
            if not err < TOL:
                raise ValueError(f"relative error {err:.2e} >= {TOL}")
            t = statistics.median(time_graph(lambda x, i, w: fn(x, i, w, c), calls, iters))
        except Exception as e:  # noqa: BLE001 - a failing config is reported, not fatal
            log(f"B={B} {key} {c}: skipped ({type(e).__name__}: {str(e)[:160]})")
            sweep.append({"B": B, key: c, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        sweep.append({"B": B, key: c, "time_ms": t, "gbps": nbytes / t / 1e6, "rel_err": float(err)})
        if best is None or t < best[0]:
            best = (t, c)
    return best


def run(copy_gbps: float, full: bool = True, iters: int = 20, log=print, bs: tuple = BS, v3_sweep: bool | None = None,
        v4_sweep: bool | None = None, v4_probe: bool = False) -> list[dict]:
    """One row per B (bench/kernels.py's family interface: time_ms, gbps, pct_of_copy are the fastest MXFP4
    kernel's, mx_kernel names it). v3_sweep / v4_sweep: every config of V3_SWEEP / V4_SWEEP, else the default.
    v4_probe: also v4's fastest config with its decode replaced by 4 moves (unchecked: what the decode costs)."""
    W = Weights(bf16=True)
    ebytes_mx, ebytes_bf = mx_expert_bytes(), 3 * I * DZ * 2
    rows, sweep = [], []
    quick = not full
    v3_all = full if v3_sweep is None else v3_sweep
    v4_all = full if v4_sweep is None else v4_sweep
    for B in ((1, 8) if quick else bs):
        calls = routings(B)
        distinct = statistics.mean(torch.unique(ids).numel() for _, ids, _ in calls)
        act_bytes = B * DZ * 2 * 2
        mx_bytes, bf_bytes = distinct * ebytes_mx + act_bytes, distinct * ebytes_bf + act_bytes
        x, ids, w = calls[0]
        ref = mx.moe_mxfp4_experts_ref(x, *W.mx(), ids, w, "situ")
        row = {"kernel": "moe_mxfp4_experts", "shape": f"B={B} E={E} k={TOP_K} Dz={DZ} I={I}",
               "B": B, "E": E, "top_k": TOP_K, "Dz": DZ, "I": I, "distinct_experts": distinct,
               "mxfp4_bytes": mx_bytes, "bf16_bytes": bf_bytes}
        v3_cfgs = [dict(zip(mx3.KEYS, cfg)) for cfg in (V3_SWEEP if v3_all else V3_SWEEP[:1])]
        best = _sweep(B, "config", v3_cfgs, lambda x, i, w, c: mx.moe_mxfp4_experts(
            x, *W.mx(), i, w, activation="situ", config=c), calls, ref, mx_bytes, iters, sweep, log)
        if best is not None:
            t, c = best
            row.update({"v3_ms": t, "v3_config": c, "v3_gbps": mx_bytes / t / 1e6,
                        "v3_pct_of_copy": mx_bytes / t / 1e6 / copy_gbps,
                        "v3_default_ms": next((s["time_ms"] for s in sweep if s["B"] == B and "time_ms" in s
                                               and s["config"] == dict(zip(mx3.KEYS, V3_SWEEP[0]))), None),
                        "time_ms": t, "gbps": mx_bytes / t / 1e6, "pct_of_copy": mx_bytes / t / 1e6 / copy_gbps})
        v4_cfgs = [mx4._config(None if cfg is None else dict(zip(mx4.KEYS, cfg)), B)
                   for cfg in (V4_SWEEP if v4_all else V4_SWEEP[:1])]

        def v4(x, i, w, c):
            if not mx4.supports(x, DZ, I, B, c):  # else the portable form would be timed under v4's name
                raise ValueError("outside the v4 kernels' gate")
            return mx4.moe_mxfp4_experts_v4(x, *W.v4(), i, w, activation="situ", config=c, fold=W.v4_fold)
        best4 = _sweep(B, "v4_config", v4_cfgs, v4, calls, ref, mx_bytes, iters, sweep, log)
        if v4_probe and best4 is not None:  # the best config with the decode replaced by 4 moves (wrong values)
            c = {**best4[1], "PROBE": 1}
            try:
                t = statistics.median(time_graph(lambda x, i, w: v4(x, i, w, c), calls, iters))
                sweep.append({"B": B, "v4_config": c, "time_ms": t, "gbps": mx_bytes / t / 1e6, "checked": False})
                row.update(v4_probe_ms=t, v4_probe_pct_of_copy=mx_bytes / t / 1e6 / copy_gbps)
            except Exception as e:  # noqa: BLE001
                row["v4_probe_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if best4 is not None:
            t, c = best4
            row.update({"v4_ms": t, "v4_config": c, "v4_gbps": mx_bytes / t / 1e6,
                        "v4_pct_of_copy": mx_bytes / t / 1e6 / copy_gbps})
            if row.get("time_ms") is None or t < row["time_ms"]:
                row.update(time_ms=t, gbps=mx_bytes / t / 1e6, pct_of_copy=mx_bytes / t / 1e6 / copy_gbps)
        row["mx_kernel"] = "v4" if best4 is not None and row["time_ms"] == best4[0] else "v3"
        try:
            t = statistics.median(time_graph(lambda x, i, w: moe_experts(x, W.w13, W.w2, i, w, activation="situ",
                                                                          ), calls, iters))
            row.update(bf16_ms=t, bf16_gbps=bf_bytes / t / 1e6, bf16_pct_of_copy=bf_bytes / t / 1e6 / copy_gbps)
        except Exception as e:  # noqa: BLE001
            row["bf16_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        try:
            from peregrine.bench.gpu import time_fn
            from peregrine.models.layers import situ
            from peregrine.models.moe import mxfp4_experts
            it = iter(range(1 << 30))
            act = lambda gu: situ(gu, 4.0, 25.0)  # noqa: E731

            def std():
                x, i, w = calls[next(it) % REPS]
                mxfp4_experts(x, *W.mx(), i.long(), w, act)
            row["standard_ms"] = statistics.median(time_fn(std, iters=max(3, iters // 4), warmup=2))
        except Exception as e:  # noqa: BLE001
            row["standard_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if "v3_ms" in row and "bf16_ms" in row:
            row["speedup_vs_bf16"] = row["bf16_ms"] / row["v3_ms"]
        if "v4_ms" in row and "bf16_ms" in row:
            row["v4_speedup_vs_bf16"] = row["bf16_ms"] / row["v4_ms"]
        row["sweep"] = [x for x in sweep if x["B"] == B]
        log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "sweep"}))
        rows.append(row)
    return rows


def probe(copy_gbps: float, iters: int = 20, log=print, only: tuple = ()) -> list[dict]:
    """PROBE's configs at every B: time and % of copy (MXFP4 bytes as in run), no correctness check."""
    W, rows = Weights(bf16=False), []
    for B in BS:
        calls = routings(B)
        distinct = statistics.mean(torch.unique(ids).numel() for _, ids, _ in calls)
        nbytes = distinct * mx_expert_bytes() + B * DZ * 2 * 2
        for cfg in (c for c in PROBE if not only or c[0] in only):
            c = dict(zip(mx3.KEYS, cfg))
            t = statistics.median(time_graph(lambda x, i, w: mx.moe_mxfp4_experts(
                x, *W.mx(), i, w, activation="situ", config=c), calls, iters))
            rows.append({"B": B, "config": c, "time_ms": t, "gbps": nbytes / t / 1e6,
                         "pct_of_copy": nbytes / t / 1e6 / copy_gbps, "checked": False})
            log(f"B={B} {cfg}: {t:.4f} ms, {100 * nbytes / t / 1e6 / copy_gbps:.1f} % of copy")
    return rows


def main() -> None:
    from peregrine.bench.gpu import copy_bandwidth, result_path, run_metadata, write_result
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="B = 1 and 8, default tiles only")
    ap.add_argument("--results-dir", default="results")
    ap.add_argument("--probe", action="store_true", help="only v3's probes (PROBE, unchecked: a 4-move decode, the bytes as BF16 from shared memory, "
                    "beside the real decode)")
    ap.add_argument("--probe-decodes", default="", help="with --probe: only these decodes (comma-separated)")
    ap.add_argument("--v4", action="store_true", help="v4's sweep beside v3's default tiles (not v3's sweep), and v4's "
                    "fastest tiles with the decode replaced by 4 moves (unchecked: the decode's cost)")
    ap.add_argument("--verify", action="store_true", help=f"also B = {', '.join(map(str, VERIFY_BS))} (verify steps' rows)")
    args = ap.parse_args()
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s")
    if args.probe:
        path = write_result(result_path("k3-slice", "kernels-moe-mxfp4-probe", args.results_dir),
                            {"meta": run_metadata(), "copy": copy,
                             "rows": probe(copy["gbps"], only=tuple(args.probe_decodes.split(",")) if args.probe_decodes else ())})
        print("wrote", path)
        return
    rows = run(copy["gbps"], full=not args.quick, bs=BS + (VERIFY_BS if args.verify else ()),
               v3_sweep=False if args.v4 else None, v4_probe=args.v4)
    print(f"{'B':>2} {'experts':>7} {'v3 ms':>8} {'GB/s':>6} {'%copy':>6} {'v4 ms':>8} {'%copy':>6} {'BF16 ms':>8} "
          f"{'%copy':>6} {'std ms':>7}")
    for r in rows:
        f = lambda k, fmt: format(r[k], fmt) if r.get(k) is not None else "-"  # noqa: E731
        pct = lambda k: format(100 * r[k], ".1f") if r.get(k) is not None else "-"  # noqa: E731
        print(f"{r['B']:>2} {r['distinct_experts']:>7.1f} {f('v3_ms', '8.4f')} {f('v3_gbps', '6.0f')} "
              f"{pct('v3_pct_of_copy'):>6} {f('v4_ms', '8.4f')} {pct('v4_pct_of_copy'):>6} {f('bf16_ms', '8.4f')} "
              f"{pct('bf16_pct_of_copy'):>6} {f('standard_ms', '7.2f')}")
    path = write_result(result_path("k3-slice", "kernels-moe-mxfp4", args.results_dir),
                        {"meta": run_metadata(), "copy": copy, "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
