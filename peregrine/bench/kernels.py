"""`peregrine bench kernels`: every kernel family's GPU microbenchmark in one run,
against the copy bandwidth measured in that same run (docs/benchmarks.md §2)."""
from __future__ import annotations

import argparse
import importlib
import traceback

from . import gpu

FAMILIES = ("gemm", "norm", "kda", "kda_conv", "mla", "mla_prefill", "moe", "moe_mxfp4", "moe_prefill", "moe_mxfp4_prefill")  # peregrine/bench/kernels_<family>.py, each with run()


def markdown(rows: list[dict]) -> str:
    out = ["| family | kernel | shape | time ms | GB/s | % copy | baseline |", "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        base = ""
        for k in ("cublas_ms", "torch_ms", "fla_ms", "standard_ms", "partials_ms", "chain_ms"):
            if r.get(k) is not None:
                base += f"{k[:-3]} {r[k]:.4f} ms "
        pct = r.get("pct_of_copy")  # every family reports a fraction of the copy bandwidth
        out.append(f"| {r.get('family', '')} | {r.get('kernel', '')} | {r.get('shape', '')} | {r.get('time_ms', float('nan')):.4f} | "
                   f"{r.get('gbps', float('nan')):.0f} | {'' if pct is None else f'{100 * pct:.0f}'} | {base.strip()} |")
    return "\n".join(out)


def result_name(families) -> str:
    """File stem: `kernels` for every family, else `kernels-<families>`, so a partial run never
    overwrites the day's full one."""
    fams = [f for f in FAMILIES if f in families]
    return "kernels" if fams == list(FAMILIES) else "kernels-" + "-".join(fams)


def bench_kernels(families=FAMILIES, full: bool = True, results_dir: str = "results", log=print) -> dict:
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError("bench kernels needs a CUDA GPU")
    copy = gpu.copy_bandwidth()
    log(f"copy bandwidth {copy['gbps']:.0f} GB/s (same run)")
    rows, errors = [], {}
    for fam in families:
        try:
            mod = importlib.import_module(f"peregrine.bench.kernels_{fam}")
            got = mod.run(copy["gbps"], full=full)
            for r in got:
                r.setdefault("family", fam)
            rows += got
            log(markdown(got))
        except Exception as e:  # one family failing must not hide the others' numbers
            errors[fam] = traceback.format_exc()
            log(f"WARNING: kernels_{fam} failed: {e!r}")
    payload = {"meta": gpu.run_metadata(), "copy_bandwidth": copy, "rows": rows, "errors": errors}
    import datetime
    from pathlib import Path
    path = gpu.write_result(Path(results_dir) / f"{datetime.date.today().isoformat()}-{gpu.gpu_slug()}-{result_name(families)}.json", payload)
    path.with_suffix(".md").write_text(f"# Kernel microbenchmarks\n\ncopy bandwidth {copy['gbps']:.0f} GB/s\n\n{markdown(rows)}\n")
    log(f"wrote {path}")
    return payload


def add_bench_kernels_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("kernels", help="kernel microbenchmarks: time, GB/s, %% of same-run copy bandwidth")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma list from {','.join(FAMILIES)}")
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--results-dir", default="results", help="where the JSON goes (default results)")

    def run(args) -> int:
        fams = [f for f in args.families.split(",") if f]
        bad = [f for f in fams if f not in FAMILIES]
        if bad:
            print(f"error: unknown kernel families {bad}; valid: {', '.join(FAMILIES)}")
            return 2
        res = bench_kernels(fams, full=not args.quick, results_dir=args.results_dir)
        return 1 if res["errors"] else 0
    p.set_defaults(func=run)
    return p
