"""`peregrine bench serve`: drive an OpenAI-compatible server like users do (docs/benchmarks.md §3).

Per --max-concurrency level: --num-prompts streaming /v1/completions requests
(random token-id prompts, ignore_eos so every request makes its --output-len
tokens), at most `concurrency` in flight; with --request-rate R they also arrive
as a Poisson process of R requests/s (seeded), so prefills land among running decodes. Per request: TTFT (send → first
token), ITL (gaps between token chunks), TPOT ((e2e - TTFT) / (tokens - 1)).
Per level: P50/P90/P99 of each, tok/s/user (1000 / median TPOT ms),
throughput per GPU (output tokens / level wall time / --num-gpus), errors.

--workload agent: coding-agent sessions instead (speculative/replay.py's, from this package's source), each a
loop of turns, every turn re-sending the whole conversation so far (the last turn's prompt + its reply + the
new file and tool output), a turn sent when the session's previous one ended, at most `concurrency` sessions
in flight. Each reply is sent as forced_tokens (a server started with --allow-forced-replies emits exactly
those, so speculation is accepted on real agent text at the engine's real cost; --unforced: the model's own
replies, same prompts and max_tokens). Per level also: per-turn context lengths and latencies, and the server's
speculative acceptance and decode lookahead steps over the level (/metrics deltas).

--workload agentx --traces DIR: InferenceX's agentic benchmark, aiperf's AgentX scenario replaying kv-cache-tester
traces (bench/agentx.py).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import statistics
import sys
import time

import httpx

from .metrics import parse_counters

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
                      timeout: float, sampling: dict | None = None, extra: dict | None = None) -> dict:
    """sampling: request fields over the greedy default (temperature, top_p, top_k, min_p, logprobs); extra: more
    fields (forced_tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **(sampling or {}), **(extra or {})}
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
    return {"concurrency": concurrency, "request_rate": rate, "arrivals_s": sched, "sent_s": sorted(sent),
            "num_prompts": len(reqs), **level_stats(res, wall)}


def level_stats(res: list[dict], wall: float) -> dict:
    """A level's figures from its requests' records (one_request's) and its wall time."""
    ok = [r for r in res if "error" not in r]
    errors = [r["error"] for r in res if "error" in r]
    ms = lambda xs: [x * 1e3 for x in xs]  # noqa: E731
    tpot = ms([r["tpot"] for r in ok if r["tpot"] is not None])
    out_tokens = sum(r["n_out"] for r in ok)
    med_tpot = percentile(tpot, 50)
    return {"completed": len(ok), "errors": len(errors),
            "error_samples": errors[:5], "wall_s": wall, "output_tokens": out_tokens,
            "ttft_ms": summary(ms([r["ttft"] for r in ok])), "tpot_ms": summary(tpot),
            "itl_ms": summary(ms([x for r in ok for x in r["itl"]])), "e2e_ms": summary(ms([r["e2e"] for r in ok])),
            "tok_s_user": 1e3 / med_tpot if tpot and med_tpot > 0 else float("nan"),
            # InferenceX's interactivity (aiperf's): 1 / the p90 over requests of (e2e - TTFT) / (tokens - 1)
            "interactivity_p90": 1e3 / percentile(tpot, 90) if tpot and percentile(tpot, 90) > 0 else float("nan"),
            "output_tok_s": out_tokens / wall if wall > 0 else float("nan")}


def server_card(base_url: str) -> dict:
    """The server's first /v1/models entry (peregrine's carries max_model_len and vocab_size)."""
    r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]


def server_model(base_url: str) -> str:
    return server_card(base_url)["id"]


# ---- the agent workload (--workload agent) ----
AGENT_TURNS = 8                # turns per session (sessions per level: the level's concurrency)
AGENT_CONTEXT_CHARS = 120_000  # replay.agent_sessions' max_chars: the 48B's last turns reach ~19-25K tokens (pieces)
# the /metrics counters a level's deltas are taken of (server-wide: the level's own requests only run meanwhile)
COUNTERS = {"peregrine:spec_drafts": "drafts", "peregrine:spec_draft_tokens": "draft_tokens",
            "peregrine:spec_accepted_tokens": "accepted_tokens", "peregrine:decode_lookahead_steps": "lookahead_steps",
            "peregrine:decode_steps": "engine_steps", "peregrine:prefix_cache_hits": "prefix_cache_hit_tokens",
            "peregrine:prefix_cache_queries": "prefix_cache_query_tokens"}


def agent_turns(n_sessions: int, turns: int, context_chars: int, vocab_size: int, seed: int = 0, salt: str = "",
                max_reply_tokens: int | None = None) -> tuple[list[list[tuple[list[int], list[int]]]], str]:
    """Agent-shaped sessions (speculative/replay.py: agent_sessions) as token ids -> (per session, per turn
    (prompt, reply); the token kind). Turn t's prompt is turn t-1's prompt + its reply + the turn's new text (a
    file, a tool's output, the user's ask): the whole conversation re-sent, token for token. Tokens are pieces
    (replay.PieceTokenizer: a large BPE's granularity, where a dummy model's byte-level stand-in would be 3-4x
    finer) on a large vocabulary, UTF-8 bytes on a small one. max_reply_tokens cuts each reply (and the
    conversation carries it cut). salt: each session opens with 4 tokens hashed from it and a line naming the
    session (encoded after everything else), so runs with different salts share no cached prefix and the same
    token ids otherwise."""
    from ..config import ConfigError
    from ..speculative.replay import FIRST_PIECE_ID, PieceTokenizer, agent_sessions
    if vocab_size > 4 * FIRST_PIECE_ID:
        enc, kind = PieceTokenizer(vocab_size).encode, "pieces"
    elif vocab_size >= 256:
        enc, kind = (lambda t: list(t.encode("utf-8"))), "bytes"  # noqa: E731
    else:
        raise ConfigError(f"the agent workload needs a vocabulary of at least 256 tokens, the server's has {vocab_size}")
    try:
        out = []
        for pairs in agent_sessions(n_sessions, turns, seed, context_chars):
            rows, prev, done = [], [], ""
            for ctx, reply in pairs:
                assert ctx.startswith(done), "agent_sessions: a context that does not extend the last one"
                prompt = prev + enc(ctx[len(done):])
                r = enc(reply)[:max_reply_tokens] if max_reply_tokens else enc(reply)
                rows.append((prompt, r))
                prev, done = prompt + r, ctx + reply
            out.append(rows)
        if salt:  # ids hashed from the salt (pieces take ids in order of appearance, the same for any salt)
            lo, span = (vocab_size // 2, vocab_size // 2 - FIRST_PIECE_ID) if kind == "pieces" else (32, 95)
            h = hashlib.sha256(salt.encode()).digest()
            head = [lo + int.from_bytes(h[4 * j:4 * j + 4], "big") % span for j in range(4)]
            out = [[(head + enc(f" session {i}.\n") + p, r) for p, r in rows] for i, rows in enumerate(out)]
    except ValueError as e:  # too many distinct pieces for the vocabulary, or no file fits the context
        raise ConfigError(f"the agent workload: {e}") from None
    return out, kind


def reuse_against_perfect(level: dict, sessions: list, block_size: int | None) -> dict | None:
    """The level's prefix-cache hit tokens (the server's counter) against a perfect cache's on the same requests
    in the order they were sent (bench/reuse.py), at the server's block size; None without either."""
    from .reuse import theoretical_hits
    hits = (level.get("server") or {}).get("prefix_cache_hit_tokens")
    if hits is None or not block_size:
        return None
    perfect = sum(theoretical_hits([sessions[si][ti] for si, ti in level["sent"]], block_size))
    return {"hit_tokens": hits, "perfect_hit_tokens": perfect, "of_perfect": hits / perfect if perfect else None,
            "prompt_tokens": sum(len(sessions[si][ti][0]) for si, ti in level["sent"]), "block_size": block_size}


def server_counters(base_url: str) -> dict:
    """The COUNTERS now (under their short names), from /metrics; {} when it cannot be read."""
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", timeout=30)
        r.raise_for_status()
    except httpx.HTTPError:
        return {}
    return {COUNTERS[k]: v for k, v in parse_counters(r.text, COUNTERS).items()}


def counter_deltas(before: dict, after: dict) -> dict:
    """A level's counters (after - before) and the speculative acceptance they give (None without drafts)."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    drafts, toks, acc = d.get("drafts", 0), d.get("draft_tokens", 0), d.get("accepted_tokens", 0)
    d["acceptance_length"] = 1 + acc / drafts if drafts else None  # tokens per verified draft, the bonus counted
    d["acceptance_rate"] = acc / toks if toks else None
    return d


async def run_agent_level(base_url: str, model: str, concurrency: int, sessions: list, timeout: float,
                          sampling: dict | None = None, forced: bool = True) -> dict:
    """Every session a loop of its turns (a turn sent when the one before ended), at most `concurrency` sessions
    in flight; a failed turn is counted and the session goes on with its next (recorded) turn."""
    url = base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        sent = []  # (session, turn) in the order sent: the perfect cache's order (bench/reuse.py)

        async def session(si, rows):
            out = []
            async with sem:
                for ti, (prompt, reply) in enumerate(rows):
                    sent.append((si, ti))
                    r = await one_request(client, url, model, prompt, len(reply), timeout, sampling,
                                          {"forced_tokens": reply} if forced else None)
                    out.append({**r, "session": si, "turn": ti, "input_tokens": len(prompt), "output_tokens": len(reply)})
            return out
        t0 = time.perf_counter()
        res = [r for rs in await asyncio.gather(*(session(i, rows) for i, rows in enumerate(sessions))) for r in rs]
        wall = time.perf_counter() - t0
    ms = lambda xs: [x * 1e3 for x in xs]  # noqa: E731
    per_turn = []
    for t in range(max(len(rows) for rows in sessions)):
        rs = [r for r in res if r["turn"] == t]
        ok = [r for r in rs if "error" not in r]
        per_turn.append({"turn": t, "requests": len(rs), "errors": len(rs) - len(ok),
                         "input_tokens": summary([r["input_tokens"] for r in rs]) | {"max": max(r["input_tokens"] for r in rs)},
                         "output_tokens": summary([r["output_tokens"] for r in rs]),
                         "ttft_ms": summary(ms([r["ttft"] for r in ok])),
                         "tpot_ms": summary(ms([r["tpot"] for r in ok if r["tpot"] is not None]))})
    requests = [{k: r.get(k) for k in ("session", "turn", "input_tokens", "output_tokens", "ttft", "tpot", "e2e",
                                        "n_out", "error")} for r in res]
    return {"concurrency": concurrency, "sessions": len(sessions), "num_prompts": len(res), **level_stats(res, wall),
            "turns": per_turn, "requests": requests, "sent": sent}


def run_agent(base_url: str, concurrencies: list[int], model: str | None = None, num_gpus: int = 1,
              sessions: int | None = None, turns: int | None = None,
              context_chars: int | None = None, vocab_size: int | None = None, forced: bool = True,
              max_reply_tokens: int | None = None, salt: str | None = None, warmup: int = 2, timeout: float = 600.0,
              seed: int = 0, log=print, sampling: dict | None = None) -> dict:
    """--workload agent: per concurrency c, `sessions` (default c) agent sessions of `turns` turns (agent_turns)."""
    from ..config import ConfigError
    turns, context_chars = turns or AGENT_TURNS, context_chars or AGENT_CONTEXT_CHARS
    card = server_card(base_url)
    model = model or card["id"]
    vocab_size = vocab_size or card.get("vocab_size")
    if not vocab_size:
        raise ConfigError("the server's /v1/models entry has no vocab_size: give --vocab-size")
    salt = os.urandom(4).hex() if salt is None else salt
    if warmup:
        asyncio.run(run_level(base_url, model, warmup, make_requests(warmup, 64, 8, 0, 32, 127, seed + 999), timeout))
    levels = []
    for i, c in enumerate(concurrencies):
        work, kind = agent_turns(sessions or c, turns, context_chars, vocab_size, seed + i, salt, max_reply_tokens)
        longest = max(len(p) + len(r) for rows in work for p, r in rows)
        if card.get("max_model_len") and longest > card["max_model_len"]:
            raise ConfigError(f"the agent sessions reach {longest} tokens, past the server's max_model_len "
                              f"{card['max_model_len']}: lower --context-chars or --turns, or serve a longer --max-model-len")
        before = server_counters(base_url)
        lv = asyncio.run(run_agent_level(base_url, model, c, work, timeout, sampling, forced))
        lv["server"] = counter_deltas(before, server_counters(base_url)) if before else None
        lv["prefix_cache"] = reuse_against_perfect(lv, work, card.get("block_size"))
        lv["throughput_per_gpu"] = lv["output_tok_s"] / num_gpus
        levels.append(lv)
        acc = (lv["server"] or {}).get("acceptance_length")
        last = lv["turns"][-1]["input_tokens"]
        log(f"concurrency {c:3d}: {lv['sessions']} sessions x {turns} turns, {lv['completed']}/{lv['num_prompts']} ok, "
            f"{lv['errors']} errors; last turn's context {last['p50']:.0f} tokens (max {last['max']}); "
            f"TTFT p50 {lv['ttft_ms']['p50']:.1f} ms, TPOT p50 {lv['tpot_ms']['p50']:.2f} ms, "
            f"ITL p99 {lv['itl_ms']['p99']:.2f} ms; {lv['tok_s_user']:.1f} tok/s/user, P90 interactivity "
            f"{lv['interactivity_p90']:.1f}" + (f"; acceptance length {acc:.2f}" if acc else "")
            + (f"; prefix-cache hits {lv['prefix_cache']['of_perfect']:.1%} of a perfect cache's"
               if lv["prefix_cache"] and lv["prefix_cache"]["of_perfect"] is not None else "")
            + (f"; first error: {lv['error_samples'][0]}" if lv["errors"] else ""))
    return {"kind": "serve_agent", "model": model, "base_url": base_url, "workload": "agent", "num_gpus": num_gpus,
            "sampling": sampling,
            "agent": {"sessions": sessions, "turns": turns, "context_chars": context_chars, "vocab_size": vocab_size,
                      "tokens": kind, "forced": forced, "max_reply_tokens": max_reply_tokens, "salt": salt,
                      "seed": seed},
            "levels": levels}


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
        xkey = "interactivity_p90" if pl.get("workload") == "agentx" else "tok_s_user"  # InferenceX's x for AgentX
        x, y = [v[xkey] for v in lv], [v["throughput_per_gpu"] for v in lv]
        ax.plot(x, y, "o-", label=pl.get("label") or pl["model"])
        for v, xi, yi in zip(lv, x, y):
            ax.annotate(f"c={v['concurrency']}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel(("P90 " if payload.get("workload") == "agentx" else "") + "interactivity (tok/s/user)")
    ax.set_ylabel("throughput per GPU (output tok/s)")
    if payload.get("workload") == "agentx":
        ax.set_title(f"{payload['model']}: AgentX traces ({payload['agentx']['n_traces']})")
    elif payload.get("workload") == "agent":
        a = payload["agent"]
        ax.set_title(f"{payload['model']}: agent sessions, {a['turns']} turns")
    else:
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
    workload = getattr(args, "workload", "random")
    agent, agentx = workload == "agent", workload == "agentx"
    if agentx != (getattr(args, "traces", None) is not None):
        raise ConfigError("--traces is the agentx workload's (and it needs them)")
    if getattr(args, "duration", None) is not None and (not agentx or not args.duration > 0):
        raise ConfigError("--duration is the agentx workload's profiled seconds per level, > 0")
    if agentx:
        given = [f"--{n.replace('_', '-')}" for n in ("request_rate", "num_prompts", "sessions", "turns",
                                                       "context_chars", "max_reply_tokens", "vocab_size")
                 if getattr(args, n, None) is not None] + (["--unforced"] if getattr(args, "unforced", False) else [])
        if given or _sampling(args):
            raise ConfigError(f"{', '.join(given) or 'sampling'}: the agentx workload sends the traces' requests as "
                              "aiperf's AgentX does (streamed, ignore_eos, no sampling fields)")
    elif agent:
        if rate is not None or args.num_prompts is not None:
            raise ConfigError("--request-rate and --num-prompts describe the random workload; the agent workload's "
                              "requests are its sessions' turns (--sessions, --turns)")
        for name in ("sessions", "turns", "context_chars", "vocab_size", "max_reply_tokens"):
            v = getattr(args, name, None)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    elif getattr(args, "unforced", False):
        raise ConfigError("--unforced is an option of --workload agent")
    try:
        if agentx:
            from .agentx import DURATION_S
            from .agentx import run as run_agentx
            payload = run_agentx(args.base_url, args.max_concurrency, args.traces, level_stats, args.model,
                                 args.num_gpus, args.duration or DURATION_S, args.seed, args.salt, args.timeout, log)
        elif agent:
            payload = run_agent(args.base_url, args.max_concurrency, args.model, args.num_gpus, args.sessions,
                                args.turns, args.context_chars, args.vocab_size, not args.unforced,
                                args.max_reply_tokens, args.salt, args.warmup, args.timeout, args.seed, log,
                                _sampling(args))
        else:
            payload = run(args.base_url, args.max_concurrency, args.input_len, args.output_len, args.num_prompts,
                          args.model, args.num_gpus, args.range_ratio, (lo, hi), args.warmup, args.timeout, args.seed,
                          log, rate, _sampling(args))
    except httpx.HTTPError as e:
        raise ConfigError(f"cannot reach the server at {args.base_url}: {e}") from None
    payload["label"] = args.label
    payload["meta"] = run_metadata()
    slug = payload["model"].replace("/", "_")
    what = {"agent": "serve-agent", "agentx": "serve-agentx"}.get(workload, "serve")
    what += f"-{args.label}" if args.label else ""
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
