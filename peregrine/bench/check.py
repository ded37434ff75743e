"""The head check's verdict (scripts/gpu_check.sh, issue #57): each real-traffic target against the figure a
`bench decode` (greedy, sampled, sampled + logprobs, one engine) and a `bench spec` (synthetic acceptance)
run measured, met or short, as one table. `bench serve --workload agent` runs (scripts/gpu_agent_serve.sh) are
judged too: a server with speculation against one without, each mode (greedy, sampled) and concurrency paired.

    python -m peregrine.bench.check RESULTS_DIR [--out check.json]

Ratios only, each from one run; absolute step times are printed beside them for the record.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SAMPLED_MAX = 1.03           # sampled step / greedy step, every B
LOGPROBS_MAX = 1.05          # sampled with logprobs 5 / greedy step, every B
SPEC_378_MIN = {1: 1.7, 2: 1.5, 4: 1.3, 8: 1.15}  # synthetic acceptance 3.78, k = 7: x plain tok/s/user
SPEC_6_MIN = {1: 2.2}        # synthetic acceptance 6.0, k = 7
SAMPLED_SPEEDUP_MIN = 0.95   # a sampled configuration's speedup over the greedy one's: within 5 %
SPEC_FLOOR = 1.0             # any length >= 1.5: the width chooser falls back to plain steps
FLOOR_FROM_LENGTH = 1.5
GREEDY_DRIFT_PCT = 1.0       # greedy B = 1 within this of the last record on the same GPU and model
# the last greedy B = 1 records, ms: (GPU name fragment, model) -> (low, high), results/README.md
GREEDY_RECORDS = {("H200", "kimi-linear-48b-a3b"): (2.344, 2.357)}
AGENT_TPOT_MAX = 0.8         # agent sessions at c = 8: TPOT p50 with speculation / without
AGENT_TTFT_MAX = 1.05        # TTFT p50 with speculation / without: within 5 % (no worse than 1.05x)
AGENT_ITL_P99_MS = 25.0      # ITL p99 with speculation, ms
AGENT_CONCURRENCY = 8


def _row(target: str, figure, limit: str, met: bool | None, note: str = "") -> dict:
    return {"target": target, "figure": figure, "limit": limit,
            "verdict": "n/a" if met is None else ("met" if met else "short"), "note": note}


def decode_rows(d: dict) -> list[dict]:
    b = d.get("backends", {}).get("latency_specialized", {})
    rows = []
    if b.get("status") != "ok":
        return [_row("bench decode latency_specialized", None, "runs", False, b.get("reason", "missing")[:120])]
    greedy = {x["batch"]: x["median_ms"] for x in b["batches"]}
    for key, lim, what in (("sampled_batches", SAMPLED_MAX, "sampled 0.6/0.95"),
                           ("sampled_logprobs_batches", LOGPROBS_MAX, "sampled + logprobs 5")):
        got = {x["batch"]: x for x in b.get(key, [])}
        for B in sorted(greedy):
            x = got.get(B)
            if x is None:
                rows.append(_row(f"{what} / greedy step, B={B}", None, f"<= {lim}", None, "not measured"))
                continue
            rows.append(_row(f"{what} / greedy step, B={B}", round(x["vs_greedy"], 3), f"<= {lim}",
                             x["vs_greedy"] <= lim, f"{x['median_ms']:.3f} vs {greedy[B]:.3f} ms"))
    gpu, model = d.get("metadata", {}).get("gpu", ""), d.get("model", "")
    rec = next((v for (g, m), v in GREEDY_RECORDS.items() if g in gpu and m == model), None)
    if 1 in greedy:
        if rec:
            lo, hi = rec[0] * (1 - GREEDY_DRIFT_PCT / 100), rec[1] * (1 + GREEDY_DRIFT_PCT / 100)
            rows.append(_row("greedy step B=1 vs last record", round(greedy[1], 3), f"{lo:.3f}-{hi:.3f} ms",
                             greedy[1] <= hi, f"record {rec[0]}-{rec[1]} ms"))
        else:
            rows.append(_row("greedy step B=1 (ms)", round(greedy[1], 3), "record", None,
                             f"no earlier record for {model} on {gpu}"))
    return rows


def spec_rows(d: dict) -> list[dict]:
    rows, floor_worst = [], None
    for entry in d.get("batches", []):
        B = entry["batch"]
        for c in entry["configs"]:
            L, width = c.get("acceptance_length"), c.get("width")
            if c.get("status") == "error" and "synthetic" in c.get("label", ""):
                rows.append(_row(c["label"] + f", B={B}", None, "runs", False, c.get("reason", "")[:120]))
                continue
            if L is None or width != "auto" or c.get("k") != 7:
                continue
            s = c["speedup_vs_plain"]
            if L >= FLOOR_FROM_LENGTH and (floor_worst is None or s < floor_worst[0]):  # sampled rows too
                floor_worst = (s, L, B, " sampled" if c.get("sampled") else "")
            if c.get("sampled"):
                v = c.get("vs_greedy_speedup")
                rows.append(_row(f"synthetic {L:g} sampled speedup / greedy speedup, B={B}",
                                 None if v is None else round(v, 3), f">= {SAMPLED_SPEEDUP_MIN}",
                                 None if v is None else v >= SAMPLED_SPEEDUP_MIN, f"sampled {s:.3f}x plain sampled"))
                continue
            lim = (SPEC_378_MIN if abs(L - 3.78) < 1e-6 else SPEC_6_MIN if abs(L - 6.0) < 1e-6 else {}).get(B)
            if lim is not None:
                rows.append(_row(f"synthetic {L:g}, k=7, auto: x plain, B={B}", round(s, 3), f">= {lim}", s >= lim,
                                 f"verify {c.get('median_verify_step_ms') or 0:.3f} ms; widths {c.get('width_steps')}"))
    if floor_worst is not None:
        s, L, B, what = floor_worst
        rows.append(_row(f"synthetic, any length >= {FLOOR_FROM_LENGTH}: worst x plain", round(s, 3),
                         f">= {SPEC_FLOOR}", s >= SPEC_FLOOR, f"at length {L:g}{what}, B={B}"))
    return rows


def _agent_level(d: dict, c: int) -> dict | None:
    return next((lv for lv in d.get("levels", []) if lv.get("concurrency") == c), None)


def agent_rows(runs: list[dict], c: int = AGENT_CONCURRENCY) -> list[dict]:
    """`bench serve --workload agent` runs: a speculative server's (its /metrics counted drafts) against a plain one's,
    paired by mode (greedy or sampled) with forced replies; 0 errors in every run; the plain server's forced run
    beside its unforced one (the model's own replies) for the record."""
    rows, by = [], {}
    for d in runs:
        lv = _agent_level(d, c)
        if lv is None:
            continue
        spec = "drafts" in (lv.get("server") or {})
        mode = "sampled" if d.get("sampling") else "greedy"
        forced = d.get("agent", {}).get("forced", True)
        by[(spec, mode, forced)] = (d, lv)
        rows.append(_row(f"agent c={c} {'spec' if spec else 'plain'} {mode}{'' if forced else ' unforced'}: errors",
                         lv["errors"], "0", lv["errors"] == 0, f"{lv['completed']} turns answered ({d.get('label')})"))
    for mode in ("greedy", "sampled"):
        s, p = by.get((True, mode, True)), by.get((False, mode, True))
        if s is None or p is None:
            if s is not None or p is not None:
                rows.append(_row(f"agent c={c} {mode}: spec vs plain", None, "both runs", None,
                                 f"only the {'spec' if s else 'plain'} run"))
            continue
        (sd, sl), (_, pl) = s, p
        acc = (sl.get("server") or {}).get("acceptance_length")
        tp, tt = sl["tpot_ms"]["p50"] / pl["tpot_ms"]["p50"], sl["ttft_ms"]["p50"] / pl["ttft_ms"]["p50"]
        rows.append(_row(f"agent c={c} {mode}: TPOT p50 spec / plain", round(tp, 3), f"<= {AGENT_TPOT_MAX}",
                         tp <= AGENT_TPOT_MAX, f"{sl['tpot_ms']['p50']:.2f} vs {pl['tpot_ms']['p50']:.2f} ms; "
                         + (f"acceptance length {acc:.2f}" if acc else "no drafts")))
        rows.append(_row(f"agent c={c} {mode}: TTFT p50 spec / plain", round(tt, 3), f"<= {AGENT_TTFT_MAX}",
                         tt <= AGENT_TTFT_MAX, f"{sl['ttft_ms']['p50']:.1f} vs {pl['ttft_ms']['p50']:.1f} ms"))
        itl = sl["itl_ms"]["p99"]
        rows.append(_row(f"agent c={c} {mode}: ITL p99 spec (ms)", round(itl, 2), f"<= {AGENT_ITL_P99_MS:g}",
                         itl <= AGENT_ITL_P99_MS, f"plain {pl['itl_ms']['p99']:.2f} ms"))
    f, u = by.get((False, "greedy", True)), by.get((False, "greedy", False))
    if f is not None and u is not None:  # forced rows keep decode lookahead: the plain forced run costs what it would
        (_, fl), (_, ul) = f, u
        r = fl["tpot_ms"]["p50"] / ul["tpot_ms"]["p50"]
        la = lambda lv: (lv.get("server") or {}).get("lookahead_steps")  # noqa: E731
        rows.append(_row(f"agent c={c} greedy: TPOT p50 plain forced / unforced", round(r, 3), "record", None,
                         f"{fl['tpot_ms']['p50']:.2f} vs {ul['tpot_ms']['p50']:.2f} ms"
                         + (f"; lookahead steps {la(fl):.0f} vs {la(ul):.0f}" if None not in (la(fl), la(ul)) else "")))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| target | figure | limit | verdict | note |", "|---|---:|---|---|---|"]
    lines += [f"| {r['target']} | {'' if r['figure'] is None else r['figure']} | {r['limit']} | {r['verdict']} "
              f"| {r['note']} |" for r in rows]
    return "\n".join(lines)


def check(results_dir: str | Path) -> dict:
    """Every decode, spec_decode and serve_agent JSON under results_dir, read; one verdict row per target."""
    out, agent = {"runs": [], "rows": []}, []
    for p in sorted(Path(results_dir).rglob("*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        kind = d.get("kind") if isinstance(d, dict) else None
        if kind not in ("decode", "spec_decode", "serve_agent"):
            continue
        md = d.get("metadata") or d.get("meta") or {}
        out["runs"].append({"file": str(p), "kind": kind, "model": d.get("model"), "gpu": md.get("gpu"),
                            "commit": md.get("commit"), "copy_gbps": (d.get("copy_bandwidth") or {}).get("gbps")})
        if kind == "serve_agent":
            agent.append(d)
            continue
        out["rows"] += decode_rows(d) if kind == "decode" else spec_rows(d)
    out["rows"] += agent_rows(agent)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results_dir", help="the folder the head check's benchmarks wrote into")
    ap.add_argument("--out", default=None, help="also write the verdicts as JSON here")
    a = ap.parse_args(argv)
    r = check(a.results_dir)
    if not r["runs"]:
        print(f"error: no decode, spec_decode or serve_agent results under {a.results_dir}", file=sys.stderr)
        return 2
    for run in r["runs"]:
        gb = f"{run['copy_gbps']:.0f} GB/s" if run["copy_gbps"] else "n/a"
        print(f"{run['kind']:>11}: {run['model']} on {run['gpu']} at {run['commit']}, copy {gb}  ({run['file']})")
    print(table(r["rows"]))
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
