"""`peregrine bench serve`: drive an OpenAI-compatible server like users do (docs/benchmarks.md §3).

Per --max-concurrency level: --num-prompts streaming /v1/completions requests
(random token-id prompts, ignore_eos so every request makes its --output-len
tokens), at most `concurrency` in flight; with --request-rate R they also arrive
as a Poisson process of R requests/s (seeded), so prefills land among running decodes. Per request: TTFT (send → first
token), ITL (gaps between token chunks), TPOT ((e2e - TTFT) / (tokens - 1)).
Per level: P50/P90/P99 of each, tok/s/user (1000 / median TPOT ms),
throughput per GPU (output tokens / level wall time / --num-gpus), errors.
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time

import httpx

PCTS = (50, 90, 99)


def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(xs: list[float]) -> dict:
    return {**{f"p{p}": percentile(xs, p) for p in PCTS}, "mean": statistics.fmean(xs) if xs else float("nan")}


def make_requests(n: int, input_len: int, output_len: int, ratio: float, lo: int, hi: int, seed: int) -> list[tuple]:
    rng = random.Random(seed)
    span = lambda L: rng.randint(max(1, int(L * (1 - ratio))), max(1, int(L * (1 + ratio))))  # noqa: E731
    return [([rng.randrange(lo, hi) for _ in range(span(input_len))], span(output_len)) for _ in range(n)]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                      timeout: float, sampling: dict | None = None) -> dict:
    """sampling: request fields over the greedy default (temperature, top_p, top_k, min_p, logprobs)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **(sampling or {})}
    t0 = time.perf_counter()
    stamps, n_out, err = [], None, None
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    err = d["error"].get("message", "stream error")
                    break
                if d.get("choices"):
                    stamps.append(time.perf_counter())  # one chunk per token
                if d.get("usage"):
                    n_out = d["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        err = f"{type(e).__name__}: {e}"
    if err or not stamps:
        return {"error": err or "no tokens"}
    n_out = n_out or len(stamps)
    e2e = stamps[-1] - t0
    ttft = stamps[0] - t0
    return {"ttft": ttft, "e2e": e2e, "n_out": n_out, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tpot": (e2e - ttft) / (n_out - 1) if n_out > 1 else None}


def arrivals(n: int, rate: float | None, seed: int) -> list[float]:
    """Send times (s from the level's start): all at 0 without a rate, else a Poisson process."""
    if not rate or rate == float("inf"):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_level(base_url: str, model: str, concurrency: int, reqs: list[tuple], timeout: float,
                    rate: float | None = None, seed: int = 0, sampling: dict | None = None) -> dict:
    url = base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    sched = arrivals(len(reqs), rate, seed)
    sent: list[float] = []
    async with httpx.AsyncClient(limits=limits) as client:
        async def go(at, p, m):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            async with sem:
                sent.append(time.perf_counter() - t0)
                return await one_request(client, url, model, p, m, timeout, sampling)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(go(at, p, m) for at, (p, m) in zip(sched, reqs)))
        wall = time.perf_counter() - t0
    ok = [r for r in res if "error" not in r]
    errors = [r["error"] for r in res if "error" in r]
    ms = lambda xs: [x * 1e3 for x in xs]  # noqa: E731
    tpot = ms([r["tpot"] for r in ok if r["tpot"] is not None])
    out_tokens = sum(r["n_out"] for r in ok)
    med_tpot = percentile(tpot, 50)
    return {"concurrency": concurrency, "request_rate": rate, "arrivals_s": sched, "sent_s": sorted(sent),
            "num_prompts": len(reqs), "completed": len(ok), "errors": len(errors),
            "error_samples": errors[:5], "wall_s": wall, "output_tokens": out_tokens,
            "ttft_ms": summary(ms([r["ttft"] for r in ok])), "tpot_ms": summary(tpot),
            "itl_ms": summary(ms([x for r in ok for x in r["itl"]])), "e2e_ms": summary(ms([r["e2e"] for r in ok])),
            "tok_s_user": 1e3 / med_tpot if tpot and med_tpot > 0 else float("nan"),
            "output_tok_s": out_tokens / wall if wall > 0 else float("nan")}


def server_model(base_url: str) -> str:
    r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def run(base_url: str, concurrencies: list[int], input_len: int, output_len: int, num_prompts: int | None = None,
        model: str | None = None, num_gpus: int = 1, range_ratio: float = 0.0, token_range=(32, 127),
        warmup: int = 2, timeout: float = 600.0, seed: int = 0, log=print, request_rate: float | None = None,
        sampling: dict | None = None) -> dict:
    model = model or server_model(base_url)
    if warmup:
        asyncio.run(run_level(base_url, model, warmup, make_requests(warmup, input_len, min(output_len, 8), 0, *token_range,
                                                                     seed + 999), timeout))
    levels = []
    for i, c in enumerate(concurrencies):
        n = num_prompts or 5 * c
        reqs = make_requests(n, input_len, output_len, range_ratio, *token_range, seed + i)
        lv = asyncio.run(run_level(base_url, model, c, reqs, timeout, request_rate, seed + i, sampling))
        lv["throughput_per_gpu"] = lv["output_tok_s"] / num_gpus
        levels.append(lv)
        log(f"concurrency {c:3d}: {lv['completed']}/{n} ok, {lv['errors']} errors; TTFT p50 {lv['ttft_ms']['p50']:.1f} ms, "
            f"TPOT p50 {lv['tpot_ms']['p50']:.2f} ms, ITL p99 {lv['itl_ms']['p99']:.2f} ms; "
            f"{lv['tok_s_user']:.1f} tok/s/user, {lv['throughput_per_gpu']:.1f} tok/s/GPU")
    return {"model": model, "base_url": base_url, "input_len": input_len, "output_len": output_len,
            "range_ratio": range_ratio, "num_gpus": num_gpus, "request_rate": request_rate, "sampling": sampling,
            "levels": levels}


def plot(payload: dict | list[dict], path) -> None:
    """Interactivity (x) against throughput per GPU (y), one line per payload (configuration)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    payloads = payload if isinstance(payload, list) else [payload]
    payload = payloads[0]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for pl in payloads:
        lv = pl["levels"]
        x, y = [v["tok_s_user"] for v in lv], [v["throughput_per_gpu"] for v in lv]
        ax.plot(x, y, "o-", label=pl.get("label") or pl["model"])
        for v, xi, yi in zip(lv, x, y):
            ax.annotate(f"c={v['concurrency']}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("interactivity (tok/s/user)")
    ax.set_ylabel("throughput per GPU (output tok/s)")
    ax.set_title(f"{payload['model']}: ISL {payload['input_len']} / OSL {payload['output_len']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _sampling(args) -> dict | None:
    from ..config import ConfigError
    from .cli import sampling_settings
    try:
        return sampling_settings(args)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def run_cli(args) -> int:
    from ..config import ConfigError
    from .gpu import result_path, run_metadata, write_result
    rate = getattr(args, "request_rate", None)
    if rate is not None and not rate > 0:
        raise ConfigError(f"--request-rate must be > 0 requests/s, got {rate}")
    for name in ("input_len", "output_len", "num_gpus", "warmup"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {0 if name == 'warmup' else 1}")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ConfigError("--num-prompts must be >= 1")
    try:
        lo, hi = (int(x) for x in args.token_range.split(","))
    except ValueError:
        raise ConfigError(f"--token-range must be LO,HI, got {args.token_range!r}") from None
    if not 0 <= lo < hi:
        raise ConfigError(f"--token-range needs 0 <= LO < HI, got {args.token_range!r}")
    log = lambda m: print(f"[bench serve] {m}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        payload = run(args.base_url, args.max_concurrency, args.input_len, args.output_len, args.num_prompts, args.model,
                      args.num_gpus, args.range_ratio, (lo, hi), args.warmup, args.timeout, args.seed, log, rate,
                      _sampling(args))
    except httpx.HTTPError as e:
        raise ConfigError(f"cannot reach the server at {args.base_url}: {e}") from None
    payload["label"] = args.label
    payload["meta"] = run_metadata()
    slug = payload["model"].replace("/", "_")
    what = "serve" + (f"-{args.label}" if args.label else "")
    path = write_result(result_path(slug, what, args.results_dir), payload)
    log(f"wrote {path}")
    if not args.no_plot:
        png = path.with_suffix(".png")
        try:
            plot(payload, png)
            log(f"wrote {png}")
        except ImportError:
            log("matplotlib is not installed: no PNG (the JSON has every number)")
    return 1 if any(lv["errors"] for lv in payload["levels"]) else 0


def combine_main(argv: list[str] | None = None) -> int:
    """python -m peregrine.bench.serve OUT.png RUN.json [RUN.json ...]: one plot of several runs."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m peregrine.bench.serve", description=combine_main.__doc__)
    ap.add_argument("png")
    ap.add_argument("runs", nargs="+")
    a = ap.parse_args(argv)
    plot([json.loads(open(r).read()) for r in a.runs], a.png)
    print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(combine_main())
