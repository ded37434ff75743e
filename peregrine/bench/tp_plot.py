"""Decode step time against the tensor-parallel size, one line per batch size B:

    python -m peregrine.bench.tp_plot [FILES or DIRS ...] [--results-dir results] [--out PNG]

Reads decode result files (`peregrine bench decode`; TP = N files are named MODEL-tpN-decode,
the size is read from the file's tensor_parallel_size) and writes, per model, one PNG with a
panel per decode backend (results/MODEL-decode-tp.png unless --out) and prints the table. Where
several files give the same (model, TP), the last one by file name (dated names: the newest) wins.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .report import DEFAULT_GLOB, load_results, save_figure


def collect(paths) -> dict:
    """{model: {backend: {B: {tp: median ms}}}} from decode result files and folders of them."""
    files = []
    for p in map(Path, paths):
        files += sorted(p.glob(DEFAULT_GLOB)) if p.is_dir() else [p]
    out: dict = {}
    for r in load_results(sorted(files, key=lambda f: f.name)):  # later names overwrite earlier ones
        tp = int(r.get("tensor_parallel_size") or 1)
        for backend, b in r.get("backends", {}).items():
            for x in b.get("batches") or []:
                out.setdefault(r["model"], {}).setdefault(backend, {}).setdefault(x["batch"], {})[tp] = x["median_ms"]
    return out


def table(model: str, per_backend: dict) -> str:
    tps = sorted({tp for per_b in per_backend.values() for ms in per_b.values() for tp in ms})
    lines = [f"**{model}**: median decode step (ms) against TP", "",
             "| backend | B | " + " | ".join(f"TP={t}" for t in tps) + " |", "|---|---:|" + "---:|" * len(tps)]
    for backend, per_b in per_backend.items():
        for B in sorted(per_b):
            lines.append(f"| {backend} | {B} | " + " | ".join(
                f"{per_b[B][t]:.3f}" if t in per_b[B] else "–" for t in tps) + " |")
    return "\n".join(lines) + "\n"


def plot(model: str, per_backend: dict, out: str | Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(per_backend)
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4.2), squeeze=False)
    for ax, (backend, per_b) in zip(axes[0], per_backend.items()):
        for B in sorted(per_b):
            tps = sorted(per_b[B])
            ax.plot(tps, [per_b[B][t] for t in tps], marker="o", label=f"B={B}")
        ax.set(xlabel="tensor-parallel size (GPUs)", ylabel="median decode step (ms)", title=f"{model} {backend}")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8], labels=["1", "2", "4", "8"])
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="decode step time against the tensor-parallel size")
    ap.add_argument("paths", nargs="*", help="decode result files or folders (default: --results-dir)")
    ap.add_argument("--results-dir", default="results")
    ap.add_argument("--out", default=None, help="PNG path (one model only); default RESULTS_DIR/MODEL-decode-tp.png")
    args = ap.parse_args(argv)
    try:
        data = collect(args.paths or [args.results_dir])
    except ValueError as e:  # a named file that is missing or not JSON
        print(e, file=sys.stderr)
        return 1
    if not data:
        print(f"no decode result files in {args.paths or args.results_dir}", file=sys.stderr)
        return 1
    if args.out and len(data) > 1:
        print(f"--out names one file but the results hold {len(data)} models: {', '.join(data)}", file=sys.stderr)
        return 1
    for model, per_backend in data.items():
        png = plot(model, per_backend, args.out or Path(args.results_dir) / f"{model}-decode-tp.png")
        print(table(model, per_backend) + f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
