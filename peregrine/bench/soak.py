"""`peregrine bench soak`: a running server under mixed traffic for a while, its memory sampled.

What a long-running deployment sees (issue #47): up to --concurrency clients sending completions
and chat, streaming or not, n = 1..3, logprobs, stop strings, greedy or seeded temperature 0.8,
prompts sharing long prefixes, a tenth of the streams dropped mid-way. Half the requests are one of
--templates fixed requests, each answered once by the idle server first: a greedy or seeded answer
under load must equal that reference (text and finish reason of every choice), so a lost or
corrupted request is counted, never missed. The other half are fresh prompts of changing length
on the same prefixes, which must finish. /metrics is scraped every --sample-every seconds for
the server's resident memory (process_resident_memory_bytes) and, on a GPU, its device memory;
after the load the server must come back to no running, waiting or cached-in-use work.

The load runs for --duration seconds or, with --requests N, until N requests have been answered (then
--duration, if given, only bounds the time, and reaching the bound first fails the soak). Request i's kind
(fresh or pool, streamed, dropped) and body depend on the seed and i alone, never on timing, so a run by
request count sends the same mix on any machine, fast or slow.

Warm-up is the reference pass (every kind of request once, one at a time) and, with --warmup-load S (or
--warmup-requests N), S seconds (N requests) of the same load (first batched steps, graph variants, pinned
buffers: one-time host memory);
growth is the resident memory once idle after the load minus the same at rest after the warm-up: what
an operator sees between two quiet moments. The samples taken under load are in the result too.

--answers exact (default) wants every greedy or seeded answer equal to the idle server's: what FP32 on
the CPU guarantees. In BF16 on a GPU each batch size runs its own kernels, so a near-tie may go either
way (docs/correctness.md §2): --answers top5 then checks greedy answers by vLLM's rule, equal up to a first
divergence whose token is in the idle server's top 5 there, and seeded answers only for their shape
(choices, finish reasons); how many differ, and where, is reported either way.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

IDLE_SETTLE_S = 3.0   # after the load: the engine's idle trim and the last aborts land within this
REST_READS = 3        # memory at rest: the least of this many reads a second apart (one read caught a transient)
DROP_SHARE = 0.1      # streams closed after their first chunk (a client gone mid-way)
FRESH_SHARE = 0.5     # requests with a prompt never seen before (only their success is checked)
PREFIX_CHARS = (200, 600, 1200)  # shared prompt prefixes: prefix caching's hits and evictions under load
GAUGES = {"rss": "process_resident_memory_bytes", "gpu_used": "peregrine:gpu_memory_used_bytes",
          "gpu_reserved": "peregrine:gpu_memory_reserved_bytes", "running": "peregrine:num_requests_running",
          "waiting": "peregrine:num_requests_waiting", "cache": "peregrine:cache_usage_perc",
          "kda_slots": "peregrine:kda_slot_usage_perc", "trims": "peregrine:host_memory_trims_total"}


TOP_N = 5  # alternatives the idle reference keeps per token for --answers top5 (vLLM's check_logprobs_close)


@dataclass
class Template:
    endpoint: str          # "completions" or "chat"
    body: dict             # greedy or seeded: its answer is fixed
    want: list | None = None  # [(text, finish_reason)] per choice, from the idle server
    top: list | None = None   # greedy, --answers top5: [(token, [top-5 tokens])] per position of the answer


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    checked: int = 0
    mismatched: list = field(default_factory=list)
    differed: list = field(default_factory=list)  # pool answers unlike the idle one: first differing token (or None)
    dropped: int = 0
    errors: dict = field(default_factory=dict)  # HTTP status or exception name -> count

    def error(self, key) -> None:
        self.errors[str(key)] = self.errors.get(str(key), 0) + 1


LETTERS = "abcdefghijklmnopqrstuvwxyz     .,"


def make_templates(n: int, seed: int, max_tokens: int, prefixes: list[str] | None = None,
                   tail: int = 60) -> list[Template]:
    """n requests, every second one seeded sampling, every third chat; prompts are a shared prefix
    and a random tail of up to `tail` characters."""
    rng = random.Random(seed)
    letters = LETTERS
    prefixes = prefixes or ["".join(rng.choice(letters) for _ in range(k)) for k in PREFIX_CHARS]
    out = []
    for i in range(n):
        text = rng.choice(prefixes) + " " + "".join(rng.choice(letters) for _ in range(rng.randint(4, tail)))
        sampled = i % 2 == 1
        body = {"max_tokens": rng.randint(4, max_tokens), "temperature": 0.8 if sampled else 0.0,
                "n": rng.choice([1, 1, 2, 3])}
        if sampled:
            body["seed"] = rng.randrange(2**31)
        if rng.random() < 0.3:
            body["stop"] = [rng.choice(letters[:26]) + rng.choice(letters[:26])]
        if rng.random() < 0.3:
            body["logprobs"] = True if i % 3 == 0 else None
        chat = i % 3 == 2
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
            if body.pop("logprobs", None):
                body["logprobs"], body["top_logprobs"] = True, 2
        else:
            body["prompt"] = text
            if body.pop("logprobs", None):
                body["logprobs"] = 2
        out.append(Template("chat" if chat else "completions", {k: v for k, v in body.items() if v is not None}))
    return out


def _choice_text(endpoint: str, choice: dict) -> str:
    return choice["message"]["content"] if endpoint == "chat" else choice["text"]


async def _call(client: httpx.AsyncClient, t: Template, stream: bool, drop: bool, model: str, tally: Tally):
    """-> [(text, finish_reason)] per choice, or None (dropped or failed: tallied)."""
    body = dict(t.body, model=model, stream=stream)
    url = f"/v1/{'chat/completions' if t.endpoint == 'chat' else 'completions'}"
    tally.sent += 1
    try:
        if not stream:
            r = await client.post(url, json=body)
            if r.status_code != 200:
                tally.error(r.status_code)
                return None
            ch = sorted(r.json()["choices"], key=lambda c: c["index"])
            return [(_choice_text(t.endpoint, c), c["finish_reason"]) for c in ch]
        texts, fins = {}, {}
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                tally.error(r.status_code)
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if drop:  # the client goes away after its first chunk
                    tally.dropped += 1
                    return None
                for c in json.loads(line[6:]).get("choices", []):
                    piece = (c.get("delta") or {}).get("content") if t.endpoint == "chat" else c.get("text")
                    texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
                    if c.get("finish_reason"):
                        fins[c["index"]] = c["finish_reason"]
        return [(texts.get(i, ""), fins.get(i)) for i in range(t.body.get("n", 1))]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        tally.error(type(e).__name__)
        return None


async def _reference_top(client: httpx.AsyncClient, t: Template, model: str) -> list | None:
    """The idle server's greedy answer to t, token by token with its top TOP_N alternatives."""
    body = {k: v for k, v in t.body.items() if k not in ("logprobs", "top_logprobs", "n")}
    body.update(model=model, stream=False)
    if t.endpoint == "chat":
        body.update(logprobs=True, top_logprobs=TOP_N)
        r = await client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            return None
        lp = r.json()["choices"][0]["logprobs"]["content"]
        return [(e["token"], [a["token"] for a in e["top_logprobs"]]) for e in lp]
    body["logprobs"] = TOP_N
    r = await client.post("/v1/completions", json=body)
    if r.status_code != 200:
        return None
    lp = r.json()["choices"][0]["logprobs"]
    return [(tok, list(alts)) for tok, alts in zip(lp["tokens"], lp["top_logprobs"])]


def first_divergence(top: list, text: str) -> tuple[int, bool]:
    """(token index where text leaves the reference, whether text's token there is one of its top alternatives);
    (len(top), True) when text follows the reference to its end (or stops inside it)."""
    at = 0
    for i, (tok, alts) in enumerate(top):
        if text.startswith(tok, at):
            at += len(tok)
            continue
        if at >= len(text):  # a stop string cut the answer here
            return len(top), True
        return i, any(a and text.startswith(a, at) for a in alts if a != tok)
    return len(top), True


def judge(t: Template, got: list, answers: str) -> tuple[bool, int | None]:
    """(acceptable, first differing token or None) of an answer to a pool request."""
    if got == t.want:
        return True, None
    if answers == "exact":
        return False, None
    if len(got) != len(t.want) or any(f not in ("stop", "length") for _, f in got):
        return False, None
    if t.body.get("temperature", 1.0) > 0:  # seeded: only its shape can be checked in BF16
        return True, None
    at, ok = min((first_divergence(t.top, text) for text, _ in got), key=lambda d: (d[1], d[0]))
    return ok, at


async def scrape(client: httpx.AsyncClient) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    r = await client.get("/metrics")
    vals = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            vals.setdefault(s.name, s.value)
    return {k: vals.get(name) for k, name in GAUGES.items()}


async def at_rest(client: httpx.AsyncClient) -> dict:
    """The idle server's gauges, the read with the least resident memory of REST_READS a second apart."""
    reads = []
    for i in range(REST_READS):
        if i:
            await asyncio.sleep(1.0)
        reads.append(await scrape(client))
    return min(reads, key=lambda r: r["rss"] if r["rss"] is not None else 0)


def draw(phase: str, seed: int, i: int, pool: list[Template], prefixes: list[str], max_tokens: int):
    """Request i of a load phase ("warmup" or "load"): (fresh, template, stream, drop), from the seed and i alone."""
    r = random.Random(f"{phase}:{seed}:{i}")
    # half the requests are fresh (a new tail on a shared prefix, sizes that keep changing: what makes an
    # allocator fragment); they must succeed, and only the pool's answers are compared
    fresh = r.random() < FRESH_SHARE
    t = make_templates(1, r.randrange(2**31), max_tokens, prefixes, tail=800)[0] if fresh else r.choice(pool)
    stream = r.random() < 0.5
    drop = stream and r.random() < DROP_SHARE
    return fresh, t, stream, drop


async def soak(base_url: str, duration: float | None, concurrency: int, sample_every: float,
               templates: int = 24, max_tokens: int = 24, seed: int = 0, model: str | None = None,
               log=print, warmup_load: float = 0.0, answers: str = "exact", requests: int | None = None,
               warmup_requests: int | None = None) -> dict:
    """duration: seconds of load (None: no bound; then `requests` must be given); requests: end the load after
    this many requests (duration then only bounds it). warmup_load / warmup_requests: the same for the warm-up
    (neither: the reference pass only)."""
    if duration is None and not requests:
        raise ValueError("soak needs a duration or a request count")
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        model = model or (await client.get("/v1/models")).json()["data"][0]["id"]
        pool = make_templates(templates, seed, max_tokens)
        idle = Tally()
        log(f"soak: {len(pool)} reference answers from the idle server")
        for t in pool:
            t.want = await _call(client, t, stream=False, drop=False, model=model, tally=idle)
            if answers == "top5" and t.want is not None and t.body.get("temperature", 1.0) == 0:
                t.top = await _reference_top(client, t, model)
            if t.want is None or (answers == "top5" and t.body.get("temperature", 1.0) == 0 and t.top is None):
                raise RuntimeError(f"the idle server failed a reference request: {idle.errors}")

        async def user(phase: str, tally: Tally, stop_at: float, budget: int | None):
            while time.monotonic() < stop_at and (budget is None or tally.sent < budget):
                fresh, t, stream, drop = draw(phase, seed, tally.sent, pool, prefixes, max_tokens)
                got = await _call(client, t, stream, drop, model, tally)  # counts it sent before its first await
                if got is None:
                    continue
                tally.ok += 1
                if fresh:
                    if any(f not in ("stop", "length") for _, f in got):
                        tally.mismatched.append({"request": t.body, "stream": stream, "got": got})
                    continue
                tally.checked += 1
                ok, at = judge(t, got, answers)
                if got != t.want:
                    tally.differed.append(at)
                if not ok:
                    tally.mismatched.append({"request": t.body, "stream": stream, "want": t.want, "got": got})

        async def sampler():
            while True:
                samples.append({"t": round(time.monotonic() - t0, 2), **await scrape(client)})
                log(f"soak: t={samples[-1]['t']:.0f}s rss {samples[-1]['rss'] / 2**20:.0f} MB, "
                    f"{tally.sent} sent, {sum(tally.errors.values())} errors")
                await asyncio.sleep(sample_every)

        prefixes = [t.body.get("prompt") or t.body["messages"][0]["content"] for t in pool]
        tally = Tally()

        def until(seconds: float | None) -> float:
            return time.monotonic() + seconds if seconds else float("inf")

        def amount(seconds: float | None, budget: int | None) -> str:
            return " and at most ".join(([f"{budget} requests"] if budget else [])
                                        + ([f"{seconds:.0f} s"] if seconds else []))

        if warmup_load > 0 or warmup_requests:
            log(f"soak: warm-up load of {amount(warmup_load, warmup_requests)} from {concurrency} clients")
            warm = Tally()
            stop_at = until(warmup_load)
            await asyncio.gather(*(user("warmup", warm, stop_at, warmup_requests) for _ in range(concurrency)))
            log(f"soak: warm-up: {warm.sent} sent, {len(warm.mismatched)} wrong, {sum(warm.errors.values())} errors")
            tally.errors, tally.mismatched = dict(warm.errors), list(warm.mismatched)  # they count all the same
        await asyncio.sleep(IDLE_SETTLE_S)
        samples = []
        start = dict(await at_rest(client), t=0.0)
        t0 = time.monotonic()
        log(f"soak: at rest after the warm-up: rss {start['rss'] / 2**20:.0f} MB; load of {amount(duration, requests)} "
            f"from {concurrency} clients")
        stop_at = until(duration)

        s_task = asyncio.create_task(sampler())
        await asyncio.gather(*(user("load", tally, stop_at, requests) for _ in range(concurrency)))
        load_s = time.monotonic() - t0
        await asyncio.sleep(IDLE_SETTLE_S)
        s_task.cancel()
        end = await at_rest(client)
        end["t"] = round(time.monotonic() - t0, 2)
    during = [s["rss"] for s in samples]
    mb = lambda b: round(b / 2**20, 1)  # noqa: E731
    res = {"base_url": base_url, "model": model, "duration_s": duration, "requests": requests,
           "load_s": round(load_s, 2), "concurrency": concurrency,
           "templates": len(pool), "requests_sent": tally.sent, "requests_ok": tally.ok, "checked": tally.checked,
           "answers": answers, "warmup_load_s": warmup_load, "warmup_requests": warmup_requests,
           "mismatched": len(tally.mismatched), "mismatch_examples": tally.mismatched[:3],
           "differed": len(tally.differed),
           "first_divergence_median": statistics.median(d) if (d := [a for a in tally.differed if a is not None]) else None,
           "dropped_streams": tally.dropped, "errors": tally.errors,
           "rss_start_idle_mb": mb(start["rss"]), "rss_end_idle_mb": mb(end["rss"]),
           "rss_growth_mb": mb(end["rss"] - start["rss"]), "rss_max_during_mb": mb(max(during, default=start["rss"])),
           "rss_median_during_mb": mb(statistics.median(during)) if during else None,
           "start": start, "end": end, "samples": samples}
    if end.get("gpu_used") is not None:
        res["gpu_used_growth_mb"] = mb(end["gpu_used"] - start["gpu_used"])
        res["gpu_reserved_growth_mb"] = mb(end["gpu_reserved"] - start["gpu_reserved"])
    return res


def verdict(res: dict, max_growth_mb: float) -> list[str]:
    """What failed, in words (empty: the soak passed)."""
    bad = []
    if res.get("requests") and res["requests_sent"] < res["requests"]:
        bad.append(f"only {res['requests_sent']} of {res['requests']} requests sent within the {res['duration_s']:.0f} s bound")
    if res["rss_growth_mb"] > max_growth_mb:
        bad.append(f"resident memory at rest grew {res['rss_growth_mb']:.1f} MB over the load (bound {max_growth_mb} MB)")
    if res["mismatched"]:
        bad.append(f"{res['mismatched']} answers differ from the idle server's"
                   + (" beyond a top-5 near-tie (or lost their shape)" if res.get("answers") == "top5" else ""))
    if res["errors"]:
        bad.append(f"errors: {res['errors']}")
    e = res["end"]
    if e["running"] or e["waiting"] or e["cache"] or e["kda_slots"]:
        bad.append(f"not idle after the load: running {e['running']}, waiting {e['waiting']}, cache {e['cache']}, "
                   f"KDA slots {e['kda_slots']}")
    return bad


def add_bench_soak_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("soak", help="mixed traffic against a running server; memory growth, lost or wrong answers")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to drive (default http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models entry)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of load after the warm-up (default 120); with --requests, a time bound (default none)")
    p.add_argument("--requests", type=int, default=None,
                   help="end the load after this many requests instead (the same mix on any machine)")
    p.add_argument("--concurrency", type=int, default=8, help="clients at once (default 8)")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between /metrics samples (default 10)")
    p.add_argument("--max-tokens", type=int, default=24, help="largest max_tokens of a request (default 24)")
    p.add_argument("--max-growth-mb", type=float, default=50.0, help="resident growth that fails the soak (default 50)")
    p.add_argument("--warmup-load", type=float, default=0.0,
                   help="seconds of the same load before memory at rest is first read (default 0: the one-at-a-time "
                        "reference pass only); one-time allocations of batched steps then do not count as growth")
    p.add_argument("--warmup-requests", type=int, default=None,
                   help="warm-up of this many requests instead (with --warmup-load, whichever ends first)")
    p.add_argument("--answers", choices=("exact", "top5"), default="exact",
                   help="exact: greedy and seeded answers equal the idle server's (FP32); top5: greedy answers equal "
                        "up to a first divergence inside the idle top 5, seeded ones checked for shape (BF16 on a GPU)")
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.set_defaults(func=cmd_bench_soak)
    return p


def cmd_bench_soak(args) -> int:
    if args.duration is None and args.requests is None:
        args.duration = 120.0
    if (args.duration is not None and args.duration <= 0) or args.concurrency < 1 or args.sample_every <= 0 \
            or args.max_tokens < 4 or args.warmup_load < 0 or (args.requests is not None and args.requests < 1) \
            or (args.warmup_requests is not None and args.warmup_requests < 1):
        print("error: --duration and --sample-every must be > 0, --concurrency, --requests and --warmup-requests "
              ">= 1, --max-tokens >= 4, --warmup-load >= 0", file=sys.stderr)
        return 2
    try:
        res = asyncio.run(soak(args.base_url, args.duration, args.concurrency, args.sample_every,
                               max_tokens=args.max_tokens, model=args.model, warmup_load=args.warmup_load,
                               answers=args.answers, requests=args.requests, warmup_requests=args.warmup_requests))
    except httpx.HTTPError as e:
        print(f"error: cannot reach the server at {args.base_url}: {e}", file=sys.stderr)
        return 1
    from .gpu import run_metadata
    res["meta"] = run_metadata()
    bad = verdict(res, args.max_growth_mb)
    res["failed"] = bad
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"soak: {res['requests_sent']} requests, {res['checked']} checked ({res['differed']} unlike the idle "
          f"answer, first difference at token {res['first_divergence_median']} in the median), "
          f"{res['dropped_streams']} dropped streams; "
          f"rss at rest {res['rss_start_idle_mb']:.0f} -> {res['rss_end_idle_mb']:.0f} MB "
          f"({res['rss_growth_mb']:+.1f} MB; under load max {res['rss_max_during_mb']:.0f})")
    for b in bad:
        print(f"FAILED: {b}")
    return 1 if bad else 0
