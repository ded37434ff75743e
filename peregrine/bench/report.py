"""`peregrine bench report`: decode result files -> PNG plot + Markdown performance table.

The plot has step time (ms) and % of the same-run copy bandwidth against B,
one line per backend per result file. With --readme the table replaces the
README section between the perf-table markers.
"""
from __future__ import annotations

import json
from pathlib import Path

PERF_START = "<!-- perf-table:start -->"
PERF_END = "<!-- perf-table:end -->"
DEFAULT_GLOB = "*-decode.json"


def load_results(paths) -> list[dict]:
    """Decode result dicts from JSON files (other kinds are ignored); each gets its file name as '_file'."""
    out = []
    for p in map(Path, paths):
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            raise ValueError(f"result file not found: {p}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not valid JSON ({e.msg})") from None
        if isinstance(d, dict) and d.get("kind") == "decode":
            d["_file"] = p.name
            out.append(d)
    return out


def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def markdown_table(results: list[dict]) -> str:
    lines = []
    for r in results:
        md, cb = r.get("metadata", {}), r.get("copy_bandwidth") or {}
        c = r.get("config", {})
        lines.append(f"**{r['model']}** on {md.get('gpu', '?')} — commit `{md.get('commit', '?')}`, "
                     f"torch {md.get('torch')}, triton {md.get('triton')}, copy bandwidth "
                     f"{_f(cb.get('gbps'), '.0f')} GB/s; input {c.get('input_len')}, output {c.get('output_len')}, "
                     f"{c.get('prompt_sets')} prompt sets × {c.get('runs')} runs"
                     + (f" ({r['_file']})" if r.get("_file") else ""))
        lines += ["", "| backend | B | median ms | P90 ms | tok/s/user | graph replay ms (Δ) | experts/layer | GB/step | GB/s | % copy BW |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, b in r.get("backends", {}).items():
            if not b.get("batches"):
                lines.append(f"| {name} | {b.get('status', '?')}: {b.get('reason', '')} |  |  |  |  |  |  |  |  |")
                continue
            for x in b["batches"]:
                gr = x.get("graph_replay_ms")
                cross = "–" if gr is None else f"{gr:.3f} ({x['agreement_pct']:+.1f} %)"
                lines.append(f"| {name} | {x['batch']} | {x['median_ms']:.3f} | {x['p90_ms']:.3f} | {x['tok_s_user']:.1f} | "
                             f"{cross} | {_f(x.get('distinct_experts_mean'), '.1f')} | {x['bytes_per_step'] / 1e9:.2f} | "
                             f"{x['achieved_gbps']:.0f} | {_f(x.get('pct_copy_bw'), '.1f')} |")
            if b.get("status") != "ok":
                lines.append(f"| {name} | {b['status']}: {b.get('reason', '')} |  |  |  |  |  |  |  |  |")
        for name, b in r.get("backends", {}).items():  # the same engine's step with decode lookahead off
            off = [(x["batch"], x["median_ms"], x["no_lookahead"]["median_ms"]) for x in b.get("batches") or []
                   if (x.get("no_lookahead") or {}).get("median_ms")]
            if off:
                lines += ["", f"{name} with decode lookahead off (same run): "
                          + ", ".join(f"B={B}: {o:.3f} ms (on: {m:.3f})" for B, m, o in off)]
        if r.get("ratios"):
            lines += ["", "standard / latency_specialized median step: "
                      + ", ".join(f"B={k}: {v:.2f}×" for k, v in r["ratios"].items())]
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict], out: str | Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        for name, b in r.get("backends", {}).items():
            xs = b.get("batches") or []
            if not xs:
                continue
            label = f"{r['model']} {name}" + (f" [{r['_file']}]" if len(results) > 1 and r.get("_file") else "")
            B = [x["batch"] for x in xs]
            ax_t.plot(B, [x["median_ms"] for x in xs], marker="o", label=label)
            pct = [(x["batch"], x["pct_copy_bw"]) for x in xs if x.get("pct_copy_bw") is not None]
            if pct:
                ax_r.plot(*zip(*pct), marker="o", label=label)
    ax_t.set(xlabel="batch size B (running requests)", ylabel="median decode step (ms)", title="Decode step time")
    ax_r.set(xlabel="batch size B (running requests)", ylabel="% of same-run copy bandwidth", title="Roofline share",
             ylim=(0, 100))
    for ax in (ax_t, ax_r):
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return save_figure(fig, out)


def save_figure(fig, out: str | Path) -> Path:
    """Lay out, write (creating the folder) and close a matplotlib figure."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def update_readme(readme: str | Path, table: str) -> None:
    """Replace the text between the perf-table markers (appending a marked section if there is none)."""
    p = Path(readme)
    text = p.read_text() if p.exists() else ""
    block = f"{PERF_START}\n{table.rstrip()}\n{PERF_END}"
    if PERF_START in text and PERF_END in text:
        a, rest = text.split(PERF_START, 1)
        _, b = rest.split(PERF_END, 1)
        text = a + block + b
    elif PERF_START in text or PERF_END in text:
        raise ValueError(f"{p}: only one of {PERF_START} / {PERF_END} present")
    else:
        text = text.rstrip() + ("\n\n" if text else "") + "## Performance\n\n" + block + "\n"
    p.write_text(text)


def report(paths, out: str | Path = "results/decode.png", readme: str | Path | None = None,
           results_dir: str | Path = "results", log=print) -> dict:
    paths = list(paths) or sorted(Path(results_dir).glob(DEFAULT_GLOB))
    results = load_results(paths)
    if not results:
        raise ValueError(f"no decode result files among {[str(p) for p in paths] or results_dir}")
    table = markdown_table(results)
    png = plot(results, out)
    md = Path(out).with_suffix(".md")
    md.write_text(table)
    if readme:
        update_readme(readme, table)
    log(table)
    log(f"wrote {png} and {md}" + (f"; updated {readme}" if readme else ""))
    return {"png": str(png), "md": str(md), "table": table}
