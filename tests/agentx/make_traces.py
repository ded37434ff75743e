"""Writes tests/agentx/traces/: four small coding-agent sessions in kv-cache-tester's trace format, the format
aiperf's `weka_trace` loader replays for InferenceX's AgentX benchmark, sized for a tiny model on the CPU.

One JSON object per session: `id`, `models`, `block_size`, `hash_id_scope` ("local": a hash id names one block of
`block_size` tokens within its own file), `tool_tokens` / `system_tokens` (a system prefix; none here: aiperf's
per-replay cache-bust marker opens the first user message, so a server would reuse a system prefix across replays of
a session, which the traces' own hit rate does not count), and
`requests` in time order. A request: `t` (start, seconds), `type` ("s" streamed, "n" not), `model`, `in` / `out`
(prompt and reply tokens), `hash_ids` (the prompt's blocks), `input_types`, `output_types`, `stop`, `api_time`
(seconds the call took). A `{"type": "subagent", ...}` entry holds its own `requests`: a second conversation,
started after the parent request before it and joined before the parent's next one.

Shape: every turn re-sends the conversation so far (the earlier hash ids), then a block per 64 tokens of the last
reply and the blocks of the new input, so a perfect prefix cache serves most of each prompt. Session c's subagent
opens with the parent's first blocks (two conversations sharing a prefix); session b sends one prompt twice, an
"s" then an "n", as real captures do. Every `in` ends inside its last block, as real prompts do (`tail`): aiperf
fills the partial last block with tokens the next turn drops, so the prefix two turns share ends before the first
one's end (why that matters to peregrine: tests/test_aiperf.py).

    python tests/agentx/make_traces.py      # tests/test_aiperf.py checks the files are its output
"""
from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "traces"
BLOCK = 64                     # kv-cache-tester's block size, also peregrine's
MODEL = "claude-opus-4-5-20251101"  # a recorded model name: aiperf maps it to the served one
API_S = 1.0                    # recorded call time; a turn starts THINK_S after the previous one ended
THINK_S = 0.3                  # short, so a replay takes seconds (aiperf replays these gaps)
SUB_API_S = 0.6

# session -> turns of (new input blocks, reply tokens); ("dup", out) sends the previous prompt again
SESSIONS = {
    "agentx_a": [(6, 40), (3, 24), (4, 64), (2, 32)],
    "agentx_b": [(9, 32), (2, 48), (5, 40), ("dup", 24), (3, 24), (2, 16)],
    "agentx_c": [(8, 48), (4, 32), (3, 40), (2, 24)],
    "agentx_d": [(4, 24), (6, 40), (2, 56)],
}
# session -> (the parent turn after which it spawns, parent blocks it opens with, its turns)
SUBAGENTS = {"agentx_c": (1, 8, [(4, 32), (2, 24)])}


def _blocks(n: int, ids: list[int]) -> list[int]:
    start = max(ids, default=0) + 1
    return list(range(start, start + n))


def tail(hash_ids: list[int]) -> int:
    """Tokens the prompt's last block lacks (a partial block, as real prompts end), 0-63, fixed by its blocks."""
    return (sum(hash_ids) * 37 + len(hash_ids) * 11) % BLOCK


def _request(t: float, hash_ids: list[int], out: int, first: bool, kind: str = "s", api: float = API_S) -> dict:
    return {"t": round(t, 3), "type": kind, "model": MODEL, "in": len(hash_ids) * BLOCK - tail(hash_ids), "out": out,
            "hash_ids": hash_ids, "input_types": ["text"] if first else ["tool_result"],
            "output_types": ["text", "tool_use"], "stop": "tool_use", "api_time": api}


def _conversation(turns, t: float, ids: list[int], used: list[int], kind: str, api: float) -> list[dict]:
    """Requests for `turns` from `ids` (the shared opening blocks), new block ids past every id in `used`."""
    reqs: list[dict] = []
    for new, out in turns:
        if new == "dup":
            reqs.append({**_request(t, ids, out, False, "n", api), "input_types": []})
        else:
            if reqs:  # the last reply's blocks, then the new input's
                ids = ids + _blocks(-(-reqs[-1]["out"] // BLOCK), used + ids)
            ids = ids + _blocks(new, used + ids)
            reqs.append(_request(t, ids, out, not reqs, kind, api))
        used = used + ids
        t += api + THINK_S
    return reqs


def session(sid: str) -> dict:
    reqs = _conversation(SESSIONS[sid], 0.0, [], [], "s", API_S)
    if sid in SUBAGENTS:
        after, shared, turns = SUBAGENTS[sid]
        start = reqs[after]["t"] + API_S + THINK_S
        used = sorted({h for r in reqs for h in r["hash_ids"]})
        inner = _conversation(turns, start, reqs[0]["hash_ids"][:shared], used, "n", SUB_API_S)
        end = inner[-1]["t"] + SUB_API_S
        for r in reqs[after + 1:]:  # the parent resumes once the subagent is done
            r["t"] = round(r["t"] + end - start + THINK_S, 3)
        reqs.insert(after + 1, {
            "t": round(start, 3), "type": "subagent", "agent_id": "agent_001", "subagent_type": "Explore",
            "duration_ms": round((end - start) * 1000), "total_tokens": sum(r["in"] + r["out"] for r in inner),
            "tool_use_count": len(inner), "status": "completed", "requests": inner, "models": [MODEL],
            "tool_tokens": 0, "system_tokens": 0})
    return {"id": sid, "models": [MODEL], "block_size": BLOCK, "hash_id_scope": "local", "tool_tokens": 0,
            "system_tokens": 0, "requests": reqs}


def render(trace: dict) -> str:
    """JSON with one request a line (a subagent's inner requests too), for readable diffs."""
    def req(r: dict, pad: str) -> str:
        if r["type"] != "subagent":
            return pad + json.dumps(r)
        head = json.dumps({k: v for k, v in r.items() if k != "requests"})[:-1]
        inner = ",\n".join(req(x, pad + "  ") for x in r["requests"])
        return f'{pad}{head}, "requests": [\n{inner}\n{pad}]}}'
    head = json.dumps({k: v for k, v in trace.items() if k != "requests"})[:-1]
    return head + ', "requests": [\n' + ",\n".join(req(r, "  ") for r in trace["requests"]) + "\n]}\n"


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for sid in SESSIONS:
        (OUT / f"{sid}.json").write_text(render(session(sid)))


if __name__ == "__main__":
    main()
