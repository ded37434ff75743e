"""`peregrine bench serve --workload agentx`: InferenceX's agentic benchmark without aiperf (docs/benchmarks.md §3e).

InferenceX's "Agentic" numbers come from aiperf's AgentX scenario (`aiperf profile --scenario inferencex-agentx-mvp`,
aiperf 0.13.0) replaying coding-agent sessions recorded in kv-cache-tester's trace format. This replays the same
traces by the same rules (read from aiperf's weka_trace loader and its agentic replay), so that a GPU machine
without aiperf gets the same requests and the same figures:
- Conversations: a trace's top-level requests are one conversation in file order; each subagent entry is one more,
  spawned by the last top-level request before it and joined by the first later one that starts after the subagent's
  recorded end (none: it runs in the background); subagents with no earlier top-level request are dropped.
- Prompts: chat messages rebuilt from hash ids, `block_size` tokens a block (equal ids in a trace, equal text). A turn
  keeps the conversation up to its longest common block prefix with the turn before, then appends the new blocks:
  ceil(last reply / block) of them as the assistant's message (one fewer when that would end the prompt on it; fewer
  when a later turn cuts back into them), the rest and the prompt's partial last block (tokens of its own) as a user
  message. The first turn opens with a system message when the trace declares tool / system tokens. The tree's
  cache-bust marker (`[rid:` 12 hex digits `]` and a blank line) opens the first user message: every play of a
  trace is a new prefix, its subagents share the root's.
- Requests: streamed chat completions with `ignore_eos` and `max_completion_tokens` the recorded reply (1 for warmup
  turns); token counts are the server's usage.
- Timing: a turn is sent the recorded idle gap (start minus the previous turn's start and duration) after the one
  before it ended; a join turn goes as soon as its subagents are done when they end later than that; subagents start
  their recorded offset after their spawn (from the spawning request's start when they overlapped it, else from its
  end). While no request is in flight, every pending wait is cut so the server idles at most IDLE_CAP_S in a row.
- Load: `concurrency` lanes, each a trace (round robin over the files, sorted) cut at an instant t* drawn uniformly
  over its recorded span (aiperf's seeding, so one --seed picks the same t* as aiperf's --random-seed). Warmup sends
  every stream's last turn before t* (one output token), spread so all lanes reach t* together; the profiled phase
  resumes every stream at its first turn at or after t* and, when a lane's whole tree is done, starts the next trace
  from its first turn. Requests sent within `duration` seconds are profiled; those in flight then finish.
Not replayed (what aiperf adds for real corpora): splitting top-level requests into flattened agents by hash-id
prefixes, and a subagent's requests into several chains, with interval barriers between them; tool-shaped messages
(off in aiperf by default); the scenario's submission rules (a 900 s floor, the pinned public corpus).
Figures per level (aiperf's definitions, via serve.level_stats): P90 interactivity = 1 / p90 over requests of
(latency - TTFT) / (output tokens - 1); TTFT p50 / p90; output tokens / the profiled phase (its start to its last
response) per GPU; the server's prefix-cache hit rate (vllm:prefix_cache_hits / _queries over the phase) beside the
traces' own (block_hits).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import random
import re
import string
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import httpx

from .metrics import parse_counters


DURATION_S = 1800          # the scenario's profiled time when not given (it refuses under 900 s)
IDLE_CAP_S = 10.0          # the scenario's system idle cap: a lull with no request in flight lasts at most this
START_RATIOS = (0.0, 1.0)  # the scenario draws each lane's t* over a trace's whole recorded span
WARMUP_TOKENS = 1          # warmup turns only prime the prefix cache
JOIN_EPS_S = 1e-6          # a subagent ending this close after a parent turn's start still joins it (rounding)
MARKER = "[rid:{}]\n\n"    # aiperf's cache-bust marker shape (12 hex digits): same length, other digits
COUNTERS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries")  # the counters aiperf scrapes for the hit rate
# block text: words a large vocabulary has as single tokens (with their leading space); a byte- or character-level
# one gets single characters instead (calibrate)
WORDS = ("the of and to in is it for on with as at by from this that be or an are not was but all can has one new "
         "use code file data time set get run list line name test type value key path main user read call "
         "return string number error model size text node item field table index query event state block page "
         "view form port host link send load save open close start stop find sort push pull merge build check "
         "match parse print write update create delete config server client token cache batch layer shape").split()
MIN_UNITS = 16             # fewer single-token units than this: the text would repeat too visibly, try the next kind


# ---- traces ----
def load_traces(folder) -> list[dict]:
    """The kv-cache-tester traces of a folder (*.json, one session each), sorted by file name as aiperf reads them."""
    from ..config import ConfigError
    files = sorted(Path(folder).glob("*.json"))
    if not files:
        raise ConfigError(f"--traces {folder}: no *.json trace files")
    traces, seen = [], set()
    for p in files:
        try:
            t = json.loads(p.read_text())
            ok = (t["block_size"] > 0 and t.get("hash_id_scope", "local") == "local" and isinstance(t["requests"], list)
                  and all(r["type"] in ("n", "s", "subagent") for r in t["requests"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{p}: not a kv-cache-tester trace ({type(e).__name__}: {e})") from None
        if not ok or t["id"] in seen:
            raise ConfigError(f"{p}: not a kv-cache-tester trace with a local hash-id scope and a new id")
        seen.add(t["id"])
        traces.append(t)
    return traces


def _inner(entry: dict) -> list[tuple[int, dict]]:
    """A subagent's requests (inner index, request) in time order, `t` on the trace's clock (older captures record it
    from the spawn)."""
    rs = [(j, {**r, "t": r["t"] + entry["t"]} if r["t"] + JOIN_EPS_S < entry["t"] else r)
          for j, r in enumerate(entry["requests"])]
    return sorted(rs, key=lambda x: (x[1]["t"], x[0]))


def _kept_subagents(trace: dict) -> list[int]:
    """Outer indices of the subagents replayed: those after at least one top-level request."""
    first = next((i for i, r in enumerate(trace["requests"]) if r["type"] != "subagent"), None)
    return [i for i, r in enumerate(trace["requests"]) if r["type"] == "subagent" and first is not None and i > first]


def block_hits(traces: list[dict]) -> dict[tuple, tuple[dict, int]]:
    """(trace id, outer index, inner index or None) -> (request, its leading blocks that an earlier request of its
    trace sent): a perfect prefix cache's hits in blocks, one seen-set per trace over all its conversations in
    recorded time order (ties: outer, then inner index), aiperf's "theoretical prefix cache hit"."""
    out = {}
    for trace in traces:
        order = [((r["t"], i, 0), (trace["id"], i, None), r) for i, r in enumerate(trace["requests"])
                 if r["type"] != "subagent"]
        for i in _kept_subagents(trace):
            order += [((r["t"], i, 1 + j), (trace["id"], i, j), r) for j, r in _inner(trace["requests"][i])]
        seen: set[int] = set()
        for _, key, r in sorted(order, key=lambda x: x[0]):
            out[key] = (r, next((k for k, h in enumerate(r["hash_ids"]) if h not in seen), len(r["hash_ids"])))
            seen.update(r["hash_ids"])
    return out


# ---- conversations: turns, prompts, branches ----
@dataclass
class Turn:
    key: tuple               # (trace id, outer index, inner index or None), aiperf's source_* fields
    t: float                 # recorded start (s)
    api: float               # recorded duration (s; 0 when missing)
    inp: int
    out: int                 # the recorded reply (max_completion_tokens: at least 1)
    hash_ids: list
    delay: float = 0.0       # s after the previous turn ended (the recorded idle gap)
    messages: tuple = ()     # ((role, pieces), ...): pieces are hash ids, then at most one tail (seed, tokens)
    spawns: list = field(default_factory=list)  # branches this turn starts


@dataclass
class Branch:
    children: list           # Conversations (subagents) started together
    start: float             # recorded spawn (s)
    spawn: int               # the root turn that starts them
    join: int | None         # the root turn that waits for them (None: background)
    overlap: bool            # they started while the spawning request ran: dispatched when it is sent


@dataclass
class Conversation:
    id: str                  # aiperf's conversation id: the trace id, `<trace>::sa:<agent id>` for a subagent
    trace: str
    block: int
    turns: list
    branches: list = field(default_factory=list)
    gates: dict = field(default_factory=dict)  # root turn -> branches it joins

    def tree(self) -> list:
        """This conversation and its subagents'."""
        return [self] + [c for b in self.branches for c in b.children]


def _turn(key, r) -> Turn:
    api = r.get("api_time")
    return Turn(key, r["t"], max(0.0, api) if api is not None and math.isfinite(api) else 0.0, r["in"], r["out"],
                list(r["hash_ids"]))


def _lcp(a: list, b: list) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _assistant_caps(turns: list[Turn], bs: int) -> list[int | None]:
    """Per turn, at most how many of its new blocks may be the assistant's: a later turn that adds nothing and cuts
    back to a block boundary must end on a user block, so the turn that added that block keeps it the user's."""
    caps: list[int | None] = [None] * len(turns)
    owner: list[int] = []   # the turn that appended each block of the conversation
    kept = [0] * len(turns)  # each turn's common prefix with the turn before, in blocks
    for k, t in enumerate(turns):
        covered = min(len(t.hash_ids), t.inp // bs)
        if k == 0:
            owner = [0] * covered
            continue
        kept[k] = cut = min(_lcp(turns[k - 1].hash_ids, t.hash_ids), len(owner))
        new = max(0, covered - cut)
        if new == 0 and t.inp % bs + max(0, (t.inp // bs - len(t.hash_ids)) * bs) == 0 and cut >= 1:
            j = owner[cut - 1]
            if j and cut - 1 - kept[j] >= 0:
                caps[j] = min(cut - 1 - kept[j], caps[j] if caps[j] is not None else cut)
        del owner[cut:]
        owner += [k] * new
    return caps


def _rebuild(conv: Conversation, system_tokens: int) -> None:
    """Every turn's messages: the conversation's segments (role, block count, pieces) after that turn."""
    bs, turns = conv.block, conv.turns
    caps = _assistant_caps(turns, bs)
    segs: list[tuple] = []
    for k, t in enumerate(turns):
        full = t.inp // bs
        covered = min(full, len(t.hash_ids))
        tail = t.inp % bs + (full - covered) * bs  # the partial last block, and blocks the capture did not hash
        seed = f"{conv.id}:{k}"
        if k == 0:
            cut, segs = 0, []
            if system_tokens > 0:
                sys_blocks = -(-system_tokens // bs)
                if sys_blocks > len(t.hash_ids):
                    from ..config import ConfigError
                    raise ConfigError(f"{conv.id}: the first request hashes fewer blocks than its system prefix")
                cut = min(sys_blocks, covered)
                if cut:
                    segs.append(("system", cut, tuple(t.hash_ids[:cut])))
            pieces = tuple(t.hash_ids[cut:covered]) + (((seed, tail),) if tail else ())
            if pieces or not segs:
                segs.append(("user", covered - cut, pieces))
        else:
            prev = turns[k - 1]
            cut = _lcp(prev.hash_ids, t.hash_ids)
            segs = _truncate(segs, cut)
            new = t.hash_ids[cut:covered]
            asst = -(-prev.out // bs) if any(s[0] == "user" for s in segs) else 0
            asst = min(asst, len(new), caps[k] if caps[k] is not None else len(new))
            if not tail and asst == len(new) and asst:
                asst -= 1  # a request may not end on the assistant's message
            if asst:
                segs.append(("assistant", asst, tuple(new[:asst])))
            rest = tuple(new[asst:]) + (((seed, tail),) if tail else ())
            if rest:
                segs.append(("user", len(new) - asst, rest))
        t.messages = tuple((role, pieces) for role, _, pieces in segs)


def _truncate(segs: list[tuple], blocks: int) -> list[tuple]:
    """The segments cut to their first `blocks` blocks: a segment ending there loses its tail, one cut inside keeps
    its first blocks; past every segment nothing changes."""
    if blocks <= 0:
        return []
    at = 0
    for i, (role, n, pieces) in enumerate(segs):
        if at + n < blocks:
            at += n
        elif at + n == blocks:
            return segs[:i] + [(role, n, pieces[:n])]
        elif at == blocks:
            return segs[:i]
        else:
            return segs[:i] + [(role, blocks - at, pieces[:blocks - at])]
    return segs


def conversations(trace: dict) -> Conversation:
    """The trace's root conversation (its subagents in .branches), prompts and timing rebuilt as aiperf replays them."""
    tid, bs, reqs = trace["id"], trace["block_size"], trace["requests"]
    normals = [(i, r) for i, r in enumerate(reqs) if r["type"] != "subagent"]
    root = Conversation(tid, tid, bs, [_turn((tid, i, None), r) for i, r in normals])
    _rebuild(root, trace.get("tool_tokens", 0) + trace.get("system_tokens", 0))
    groups: dict[tuple, list] = {}
    for j in _kept_subagents(trace):
        e = reqs[j]
        child = Conversation(f"{tid}::sa:{e['agent_id']}", tid, bs,
                             [_turn((tid, j, i), r) for i, r in _inner(e)])
        _rebuild(child, e.get("tool_tokens", 0) + e.get("system_tokens", 0))
        _delays(child)
        if e.get("duration_ms") is not None:
            end = e["t"] + max(0.0, e["duration_ms"] / 1000 if math.isfinite(e["duration_ms"]) else 0.0)
        else:
            end = max((t.t + t.api for t in child.turns), default=e["t"])
        spawn = max(k for k, (i, _) in enumerate(normals) if i < j)
        join = next((k for k, (i, r) in enumerate(normals) if i > j and r["t"] + JOIN_EPS_S >= end), None)
        groups.setdefault((spawn, join), []).append((e["t"], child))
    for (spawn, join), items in groups.items():
        b = Branch([c for _, c in items], min(s for s, _ in items), spawn, join, False)
        p = root.turns[spawn]
        b.overlap = p.api > 0 and b.start < p.t + p.api
        root.branches.append(b)
        p.spawns.append(b)
        if join is not None:
            root.gates.setdefault(join, []).append(b)
    _delays(root)
    return root


def _delays(conv: Conversation) -> None:
    for a, b in zip(conv.turns, conv.turns[1:]):
        b.delay = max(0.0, b.t - a.t - a.api)


def _first_at(conv: Conversation, t_ms: float) -> int | None:
    """The first turn starting at or after t_ms (ms, as aiperf compares them)."""
    return next((k for k, x in enumerate(conv.turns) if x.t * 1000.0 >= t_ms), None)


# ---- text ----
class BlockText:
    """Text for the pieces: a block of `bs` single-token units fixed by (trace, hash id), a tail by its seed."""

    def __init__(self, units: list[str], kind: str):
        self.units, self.kind = units, kind
        self.block = lru_cache(maxsize=1 << 16)(self._block)

    def _draw(self, key: str, n: int) -> str:
        rng = random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))
        return "".join(rng.choices(self.units, k=n))

    def _block(self, trace: str, h: int, bs: int) -> str:
        return self._draw(f"block:{trace}:{h}", bs)

    def segment(self, conv: Conversation, pieces: tuple) -> str:
        return "".join(self._draw(f"tail:{p[0]}", p[1]) if isinstance(p, tuple)
                       else self.block(conv.trace, p, conv.block) for p in pieces)

    def messages(self, conv: Conversation, k: int, marker: str) -> list[dict]:
        out, marked = [], False
        for role, pieces in conv.turns[k].messages:
            text = self.segment(conv, pieces)
            if role == "user" and not marked:
                text, marked = marker + text, True
            out.append({"role": role, "content": text})
        return out


async def calibrate(client: httpx.AsyncClient, base_url: str, model: str, log=print) -> tuple[BlockText, dict]:
    """Units the server's tokenizer counts as one token each and adds up (its /tokenize): common words with their
    leading space on a large vocabulary, single characters on a byte- or character-level one."""
    url = base_url.rstrip("/") + "/tokenize"

    async def count(text: str) -> int:
        r = await client.post(url, json={"model": model, "prompt": text}, timeout=60)
        if r.status_code != 200:
            from ..config import ConfigError
            raise ConfigError(f"the agentx workload sizes its text with the server's /tokenize: HTTP {r.status_code}")
        return r.json()["count"]
    base = await count("x")
    for kind, cands in (("words", [" " + w for w in WORDS]), ("chars", list(string.ascii_letters + string.digits))):
        sizes = await asyncio.gather(*(count("x" + u) for u in cands))
        units = [u for u, n in zip(cands, sizes) if n - base == 1]
        if len(units) >= MIN_UNITS:
            break
    else:
        from ..config import ConfigError
        raise ConfigError("the server's tokenizer has too few single-token words or characters for the trace text")
    text = BlockText(units, kind)
    sample = text._draw("calibration", 256)
    got = await count("x" + sample) - base
    if got != 256:
        log(f"the block text is {got / 256:.3f} tokens a unit, not 1: prompts are that much off the traces' sizes")
    return text, {"units": kind, "n_units": len(units), "tokens_per_unit": got / 256}


# ---- the replay ----
def _t_star(seed: int, trace: str, lane: int, lo: float, hi: float) -> float:
    """aiperf's draw of a lane's t* (ms): numpy's default_rng seeded from sha256("seed:trace:lane"), uniform over
    [lo, hi]."""
    import numpy as np
    s = int.from_bytes(hashlib.sha256(f"{seed}:{trace}:{lane}".encode()).digest()[:8], "big")
    return float(lo if hi <= lo else np.random.default_rng(s).uniform(lo, hi))


def snapshot(root: Conversation, t_star: float) -> list[tuple] | None:
    """The streams live at t* (ms): (conversation, next turn, seconds after t* it is due, waits for its subagents);
    None when nothing can be sent (the trace is skipped). A branch counts once it started or its spawning turn was
    sent; the root waits when its next turn joins subagents still running."""
    nxt = _first_at(root, t_star)
    due = lambda x: max(0.0, x.t * 1000.0 - t_star) / 1000.0  # noqa: E731
    states, waits = [], set()
    for b in root.branches:
        sent = t_star >= root.turns[b.spawn].t * 1000.0 and (nxt is None or nxt > b.spawn)
        if t_star < b.start * 1000.0 and not sent:
            continue
        live = [(c, k) for c in b.children if (k := _first_at(c, t_star)) is not None]
        states += [(c, k, due(c.turns[k]), False) for c, k in live]
        if live and b.join is not None:
            waits.add(b.join)
    if nxt is not None:
        states.insert(0, (root, nxt, due(root.turns[nxt]), nxt in waits))
    return states if any(not w for *_, w in states) else None


class _Clock:
    """The replay's waits. While no request is in flight every pending one is pulled forward, so the server idles at
    most `cap` seconds in a row (a lull where every lane thinks at once is cut; recorded gaps stay otherwise)."""

    def __init__(self, cap: float):
        self.cap, self.busy, self.idle_since, self.waits = cap, 0, time.monotonic(), {}

    async def sleep(self, s: float) -> None:
        if s <= 0:
            return
        me, ev = [time.monotonic() + s], asyncio.Event()
        self.waits[id(me)] = (me, ev)
        self._pull()
        try:
            while (left := me[0] - time.monotonic()) > 0:
                ev.clear()
                try:
                    await asyncio.wait_for(ev.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            del self.waits[id(me)]

    def started(self) -> None:
        self.busy += 1

    def ended(self) -> None:
        self.busy -= 1
        if not self.busy:
            self.idle_since = time.monotonic()
            self._pull()

    def _pull(self) -> None:
        if self.busy or not self.waits:
            return
        now = time.monotonic()
        shift = min(me[0] for me, _ in self.waits.values()) - now - max(0.0, self.cap - (now - self.idle_since))
        if shift > 0:
            for me, ev in self.waits.values():
                me[0] -= shift
                ev.set()


@dataclass
class _Tree:
    """One play of a trace on a lane: its root and subagent streams share the marker; done when all have ended."""
    lane: int
    marker: str
    open: int = 0
    gates: dict = field(default_factory=dict)  # root turn -> [subagents still running, event]


def _overflow(err: str) -> bool:
    """A context-length refusal ends the stream (aiperf recycles such a trajectory); other errors go on."""
    return bool(re.search(r"context|max_model_len|too long", err, re.I))


async def chat(client: httpx.AsyncClient, url: str, body: dict, timeout: float) -> dict:
    """One streamed chat completion -> serve.one_request's record (ttft, e2e, n_out, itl, tpot; seconds) with the
    server's usage: TTFT to the first chunk with text, latency to the last line (the usage chunk / [DONE])."""
    t0 = time.perf_counter()
    stamps, usage, err, last = [], None, None, None
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                last = time.perf_counter()
                if line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    err = str(d["error"].get("message", d["error"]))
                    break
                if any((c.get("delta") or {}).get(f) for c in d.get("choices") or ()
                       for f in ("content", "reasoning_content", "reasoning")):
                    stamps.append(last)
                if d.get("usage"):
                    usage = d["usage"]
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, AttributeError) as e:
        err = f"{type(e).__name__}: {e}"
    if err or not stamps or not usage:
        return {"error": err or ("no tokens" if not stamps else "no usage")}
    n, ttft, e2e = usage["completion_tokens"], stamps[0] - t0, last - t0
    return {"ttft": ttft, "e2e": e2e, "n_out": n, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tpot": (e2e - ttft) / (n - 1) if n > 1 else None, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


class Replay:
    """One concurrency level: warmup, then `duration` seconds of profiled replay over `lanes` lanes."""

    def __init__(self, roots: list[Conversation], hits: dict, client, base_url: str, model: str, text: BlockText,
                 lanes: int, duration: float, seed: int, salt: str, timeout: float, log=print):
        self.roots, self.hits, self.client, self.model, self.text = roots, hits, client, model, text
        self.url = base_url.rstrip("/") + "/v1/chat/completions"
        self.lanes, self.duration, self.seed, self.salt = lanes, duration, seed, salt
        self.timeout, self.log = timeout, log
        self.clock, self.records, self.drawn, self.passes = _Clock(IDLE_CAP_S), [], 0, {}
        self.accepting, self.phase, self.t0 = False, "warmup", time.perf_counter()
        self.streams: set[asyncio.Task] = set()
        self.requests: set[asyncio.Task] = set()

    def _draw(self) -> Conversation:
        """The dataset's next root, round robin in file order (aiperf's sequential sampler)."""
        c = self.roots[self.drawn % len(self.roots)]
        self.drawn += 1
        return c

    def _tree(self, lane: int, trace: str) -> _Tree:
        p = self.passes[trace] = self.passes.get(trace, -1) + 1
        digest = hashlib.sha256(f"{self.salt}:{p}:{lane}:{trace}".encode()).hexdigest()[:12]
        return _Tree(lane, MARKER.format(digest))

    async def _send(self, tree: _Tree, conv: Conversation, k: int, max_tokens: int | None = None) -> dict:
        turn = conv.turns[k]
        n = max_tokens or max(1, turn.out)  # a recorded empty reply still asks one token
        body = {"messages": self.text.messages(conv, k, tree.marker), "model": self.model, "stream": True,
                "max_completion_tokens": n, "ignore_eos": True, "stream_options": {"include_usage": True}}
        rec = {"conversation": conv.id, "turn": k, "key": list(turn.key), "phase": self.phase, "lane": tree.lane,
               "sent_s": time.perf_counter() - self.t0, "max_completion_tokens": n, "stream": True, "ignore_eos": True,
               "hit_blocks": self.hits[turn.key][1], "blocks": len(turn.hash_ids)}
        task = asyncio.ensure_future(self._request(rec, body))
        self.requests.add(task)
        return await asyncio.shield(task)  # a request in flight when the phase ends still completes and counts

    async def _request(self, rec: dict, body: dict) -> dict:
        self.clock.started()
        try:
            rec |= await chat(self.client, self.url, body, self.timeout)
        finally:
            self.clock.ended()
        rec["end_s"] = time.perf_counter() - self.t0
        self.records.append(rec)
        return rec

    def _start(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.streams.add(task)
        task.add_done_callback(self.streams.discard)

    def _spawn(self, tree: _Tree, b: Branch, origin: float) -> None:
        """Start a branch's subagents, each its recorded offset from `origin` (s, trace time) later."""
        gate = tree.gates.setdefault(b.join, [0, asyncio.Event()]) if b.join is not None else None
        for c in b.children:
            if gate:
                gate[0] += 1
                gate[1].clear()  # an earlier branch joining the same turn may have ended already
            tree.open += 1
            self._start(self._stream(tree, c, 0, max(0.0, c.turns[0].t - origin), gate=gate, capped=False))

    async def _stream(self, tree: _Tree, conv: Conversation, k: int, wait: float, gated: bool = False, gate=None,
                      capped: bool = True):
        """Send conv's turns from k on, the first after `wait` s (capped: a wait the idle cap may cut; aiperf's
        subagent offsets are not) or, gated, once its subagents are done; gate: the [count, event] this subagent's
        end counts down."""
        try:
            if gated:
                await tree.gates[k][1].wait()
            else:
                await (self.clock.sleep(wait) if capped else asyncio.sleep(wait))
            while self.accepting:
                turn = conv.turns[k]
                for b in turn.spawns:
                    if b.overlap:
                        self._spawn(tree, b, turn.t)
                r = await self._send(tree, conv, k)
                if "error" in r and _overflow(r["error"]) or k + 1 == len(conv.turns) or not self.accepting:
                    break
                for b in turn.spawns:
                    if not b.overlap:
                        self._spawn(tree, b, b.start)
                k += 1
                g = tree.gates.get(k) if conv.gates.get(k) else None
                if g and g[0] > 0:
                    await g[1].wait()  # the join goes as soon as its subagents are done
                else:
                    await self.clock.sleep(conv.turns[k].delay)
        finally:
            if gate is not None:
                gate[0] -= 1
                if gate[0] == 0:
                    gate[1].set()
            tree.open -= 1
            if tree.open == 0 and self.accepting:  # the lane's next play: a trace from its first turn, now
                nxt = self._draw()
                t = self._tree(tree.lane, nxt.id)
                t.open = 1
                self._start(self._stream(t, nxt, 0, 0.0))

    def _trajectories(self) -> list[tuple]:
        """Per lane (tree, root, t*, snapshot), drawing past traces that have nothing to send at their t*."""
        out, tries = [], 0
        while len(out) < self.lanes and tries < self.lanes + 2 * len(self.roots):
            tries += 1
            root = self._draw()
            ms = [t.t * 1000.0 for c in root.tree() for t in c.turns]
            lo, hi = (min(ms) + r * (max(ms) - min(ms)) for r in START_RATIOS)
            ts = _t_star(self.seed, root.id, len(out), lo, hi)
            if (states := snapshot(root, ts)) is not None:
                out.append((self._tree(len(out), root.id), root, ts, states))
        return out

    async def run(self, counters) -> dict:
        """Warmup, then the profiled phase; counters(): the server's COUNTERS now. -> the phase's window and more."""
        lanes = self._trajectories()
        if len(lanes) < self.lanes:
            self.log(f"only {len(lanes)} of {self.lanes} lanes: the traces have too few sendable instants")
        warm = [(tree, c, k - 1, (ts - c.turns[k - 1].t * 1000.0) / 1000.0)
                for tree, _, ts, states in lanes for c, k, _, _ in states if k]
        lead = max((w[3] for w in warm), default=0.0)

        async def warmup(tree, conv, k, ahead):
            await self.clock.sleep(lead - ahead)  # every lane reaches its t* at the warmup's end
            await self._send(tree, conv, k, WARMUP_TOKENS)
        await asyncio.gather(*(warmup(*w) for w in warm))
        before = await counters()
        self.phase, self.accepting, start = "profiling", True, time.perf_counter()
        self.clock.idle_since = time.monotonic()
        for tree, root, _, states in lanes:
            tree.open = len(states)
            joins = {id(c): b.join for b in root.branches for c in b.children}
            for conv, *_ in states:  # the joins of the subagents live at t* wait for them
                if joins.get(id(conv)) is not None:
                    tree.gates.setdefault(joins[id(conv)], [0, asyncio.Event()])[0] += 1
            for conv, k, wait, gated in states:
                gate = tree.gates.get(joins[id(conv)]) if joins.get(id(conv)) is not None else None
                self._start(self._stream(tree, conv, k, wait, gated, gate))
        await asyncio.sleep(self.duration)
        self.accepting = False
        for t in list(self.streams):
            t.cancel()
        await asyncio.gather(*self.streams, return_exceptions=True)
        await asyncio.gather(*self.requests, return_exceptions=True)
        end = max([start] + [self.t0 + r["end_s"] for r in self.records if r["phase"] == "profiling"])
        return {"window_s": end - start, "start_s": start - self.t0, "server": counter_delta(before, await counters()),
                "trajectories": [{"lane": tree.lane, "trace": root.id, "t_star_ms": ts,
                                  "streams": [[c.id, k] for c, k, _, _ in states]} for tree, root, ts, states in lanes]}


# ---- figures and the command ----
async def server_counters(client: httpx.AsyncClient, base_url: str) -> dict:
    """COUNTERS now (summed over labels), from /metrics; {} when it cannot be read."""
    try:
        r = await client.get(base_url.rstrip("/") + "/metrics", timeout=30)
        r.raise_for_status()
    except httpx.HTTPError:
        return {}
    return parse_counters(r.text, COUNTERS)


def counter_delta(before: dict, after: dict) -> dict | None:
    """The phase's prefix-cache hits and queries (tokens) and their ratio; None without the counters."""
    if not all(k in before and k in after for k in COUNTERS):
        return None
    hits, queries = (after[k] - before[k] for k in COUNTERS)
    return {"prefix_cache_hits": hits, "prefix_cache_queries": queries, "hit_rate": hits / queries if queries else None}


def figures(records: list[dict], window_s: float, level_stats, num_gpus: int = 1) -> dict:
    """AgentX's figures of a phase's requests (chat's records: ttft / e2e in s, n_out the server's output tokens) over
    its window (its start to its last response): serve.level_stats' (P90 interactivity, TTFT, output tokens / window;
    passed in, as serve.py drives this module) plus the request count and the throughput per GPU."""
    f = level_stats(records, window_s)
    return {"requests": len(records), **f, "throughput_per_gpu": f["output_tok_s"] / num_gpus}


def traces_hit_rate(records: list[dict]) -> float | None:
    """The share of the requests' blocks a perfect prefix cache serves (block_hits), over the given requests."""
    blocks = sum(r["blocks"] for r in records)
    return sum(r["hit_blocks"] for r in records) / blocks if blocks else None


def run(base_url: str, concurrencies: list[int], traces_dir: str, level_stats, model: str | None = None,
        num_gpus: int = 1, duration: float = DURATION_S, seed: int = 0, salt: str | None = None, timeout: float = 600.0,
        log=print) -> dict:
    """Per concurrency level, one AgentX run (Replay) over the traces of traces_dir; level_stats: serve's."""
    from ..config import ConfigError
    traces = load_traces(traces_dir)
    hits = block_hits(traces)
    roots = [r for r in map(conversations, traces) if r.turns]  # aiperf never samples a trace without top-level turns
    if len(roots) < len(traces):
        log(f"{len(traces) - len(roots)} of the {len(traces)} traces have no top-level request: not replayed")
    if not roots:
        raise ConfigError(f"--traces {traces_dir}: no trace has a top-level request")
    r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30)
    r.raise_for_status()
    card = r.json()["data"][0]  # peregrine's carries max_model_len
    model = model or card["id"]
    longest = max(t.inp + t.out for r in roots for c in r.tree() for t in c.turns)
    if card.get("max_model_len") and longest > card["max_model_len"]:
        log(f"the traces reach {longest} tokens, past the server's max_model_len {card['max_model_len']}: "
            "those requests will fail (aiperf drops such traces with --max-context-length)")
    salt = os.urandom(4).hex() if salt is None else salt

    async def level(c: int) -> dict:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as cl:
            text, calib = await calibrate(cl, base_url, model, log)
            rp = Replay(roots, hits, cl, base_url, model, text, c, duration, seed, f"{salt}:{c}", timeout, log)
            out = await rp.run(lambda: server_counters(cl, base_url))
        prof = [r for r in rp.records if r["phase"] == "profiling"]
        warm = [r for r in rp.records if r["phase"] == "warmup"]
        return {"concurrency": c, "lanes": len(out["trajectories"]),
                **figures(prof, out["window_s"], level_stats, num_gpus),
                "warmup_requests": len(warm), "warmup_errors": sum("error" in r for r in warm),
                "traces_hit_rate": traces_hit_rate(prof), **out, "block_text": calib,
                "records": [{k: v for k, v in r.items() if k not in ("itl",)} for r in rp.records]}
    levels = []
    for c in concurrencies:
        lv = asyncio.run(level(c))
        levels.append(lv)
        srv = (lv["server"] or {}).get("hit_rate")
        log(f"concurrency {c:3d}: {lv['lanes']} lanes, {lv['completed']}/{lv['requests']} profiled requests ok "
            f"({lv['warmup_requests']} warmup); TTFT p50 {lv['ttft_ms']['p50']:.1f} ms, "
            f"p90 {lv['ttft_ms']['p90']:.1f} ms; "
            f"P90 interactivity {lv['interactivity_p90']:.1f} tok/s/user; {lv['throughput_per_gpu']:.1f} tok/s/GPU; "
            f"prefix-cache hit rate {srv if srv is None else f'{srv:.3f}'} (traces' own {lv['traces_hit_rate']:.3f})"
            + (f"; first error: {lv['error_samples'][0]}" if lv["errors"] else ""))
    return {"kind": "serve_agentx", "model": model, "base_url": base_url, "workload": "agentx", "num_gpus": num_gpus,
            "agentx": {"traces": str(traces_dir), "n_traces": len(traces), "duration_s": duration, "seed": seed,
                       "salt": salt, "idle_cap_s": IDLE_CAP_S, "start_ratios": START_RATIOS},
            "levels": levels}
