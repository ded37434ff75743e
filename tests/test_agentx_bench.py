"""`peregrine bench serve --workload agentx` (peregrine/bench/agentx.py) shown equal to aiperf's AgentX scenario on
one CPU run of each over tests/agentx/traces, each against a fresh server of the same model (tests/agentx_helpers.py:
the model, the server, aiperf's command), with the same seed and concurrency:
(a) the metric definitions: aiperf's own per-request export (profile_export.jsonl) through agentx.figures gives
    aiperf's aggregate (profile_export_aiperf.json): P90 interactivity (1000 / its ITL p90), TTFT p50 / p90, output
    token throughput over its phase (start_time to end_time), the request and output-token counts;
(b) the requests: the replay builds aiperf's messages for every request aiperf sent (the same roles, each the same
    number of tokens: the model's tokenizer gives a character a token, and the 20 characters of aiperf's cache-bust
    marker are left out); warms the same streams at the same turns (one --seed, one t* per lane); and for every
    (conversation, turn, phase) both runs sent, the server counted the same prompt tokens (its usage) and both asked
    and got the same output tokens, streamed with ignore_eos. The sharing: the server's prefix-cache hit rate under
    the replay is within HIT_TOLERANCE of the traces' own and of the server's under aiperf.
Without .venv-aiperf only the replay's own checks run; the rest skip, saying why. No assertion depends on machine
speed (how many turns the profiled time covers varies; what each must be does not); the limits only catch hangs.
"""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from datetime import datetime

import httpx
import pytest

from peregrine.bench import agentx
from peregrine.bench.serve import level_stats
from peregrine.server.cli import main as server_cli
from agentx_helpers import AIPERF, LIMIT, NO_AIPERF, NAME, ROOT, TRACES, records, run_aiperf, served, write_model

PROFILE_S = 15          # the profiled phase of both runs: a few plays of each session on a CPU
LANES = 4               # one lane per trace
SEED = 1                # both runs' seed: the same t* per lane
HIT_TOLERANCE = 0.05    # as tests/test_aiperf.py: template and marker tokens, block rounding, a subagent's first turn
MARKER = re.compile(r"^\[rid:[0-9a-f]{12}\]\n\n")  # aiperf's cache-bust marker, as its raw export shows it


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("agentx-model") / "model"
    write_model(folder)
    return folder


@pytest.fixture(scope="module")
def replay(model, tmp_path_factory):
    """The replay's JSON (one level) and its plot."""
    tmp = tmp_path_factory.mktemp("agentx-replay")
    with served(model, tmp / "serve.log") as url:
        r = subprocess.run([sys.executable, "-m", "peregrine", "bench", "serve", "--base-url", url, "--workload",
                            "agentx", "--traces", str(TRACES), "--max-concurrency", str(LANES), "--duration",
                            str(PROFILE_S), "--seed", str(SEED), "--timeout", str(LIMIT), "--results-dir", str(tmp)],
                           cwd=ROOT, capture_output=True, text=True, timeout=LIMIT)
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = tmp.glob("*-serve-agentx.json")
    return json.loads(path.read_text()), path.with_suffix(".png")


@pytest.fixture(scope="module")
def aiperf(model, tmp_path_factory):
    """aiperf's artifact dir."""
    if not AIPERF.exists():
        pytest.skip(NO_AIPERF)
    tmp = tmp_path_factory.mktemp("agentx-aiperf")
    with served(model, tmp / "serve.log") as url:
        art, _ = run_aiperf(url, model, tmp, PROFILE_S, LANES, SEED)
    return art


def _record(r: dict) -> dict:
    """An aiperf export record as agentx.chat's (seconds; output tokens the server's)."""
    m = {k: v["value"] for k, v in r["metrics"].items()}
    n, ttft, e2e = m["output_sequence_length"], m["time_to_first_token"] / 1e3, m["request_latency"] / 1e3
    return {"ttft": ttft, "e2e": e2e, "n_out": n, "itl": [], "tpot": (e2e - ttft) / (n - 1) if n > 1 else None}


def _aiperf_requests(art) -> dict[tuple, set]:
    """(conversation, turn, phase) -> {(prompt tokens, max_completion_tokens, output tokens, stream, ignore_eos)}."""
    asked = {r["metadata"]["x_request_id"]: r["payload"] for r in records(art, "profile_export_raw.jsonl")}
    out: dict[tuple, set] = {}
    for r in records(art, "profile_export.jsonl"):
        md, body = r["metadata"], asked[r["metadata"]["x_request_id"]]
        out.setdefault((md["conversation_id"], md["turn_index"], md["benchmark_phase"]), set()).add(
            (r["metrics"]["usage_prompt_tokens"]["value"], body["max_completion_tokens"],
             r["metrics"]["usage_completion_tokens"]["value"], body["stream"], body["ignore_eos"]))
    return out


def _replay_requests(level: dict) -> dict[tuple, set]:
    out: dict[tuple, set] = {}
    for r in level["records"]:
        out.setdefault((r["conversation"], r["turn"], r["phase"]), set()).add(
            (r["prompt_tokens"], r["max_completion_tokens"], r["n_out"], r["stream"], r["ignore_eos"]))
    return out


def test_replay_answers_every_request_at_its_recorded_length(replay):
    payload, png = replay
    (lv,) = payload["levels"]
    known = agentx.block_hits(agentx.load_traces(TRACES))
    assert [r for r in lv["records"] if "error" in r] == [] and lv["errors"] == 0
    prof = [r for r in lv["records"] if r["phase"] == "profiling"]
    assert {r["key"][0] for r in prof} == {k[0] for k in known}  # every lane was profiled
    assert lv["requests"] == len(prof) and lv["warmup_requests"] == len(lv["records"]) - len(prof) > 0
    for r in lv["records"]:  # warmup turns ask one token, profiled ones the recorded reply
        want = known[tuple(r["key"])][0]["out"] if r["phase"] == "profiling" else 1
        assert (r["max_completion_tokens"], r["n_out"], r["stream"], r["ignore_eos"]) == (want, want, True, True), r
    assert png.exists()


def test_replay_hit_rate_is_the_traces_own(replay):
    (lv,) = replay[0]["levels"]
    print(f"hit rate: traces {lv['traces_hit_rate']:.3f}, server {lv['server']['hit_rate']:.3f} "
          f"({lv['requests']} requests profiled)")
    assert abs(lv["server"]["hit_rate"] - lv["traces_hit_rate"]) <= HIT_TOLERANCE


def test_metric_definitions_are_aiperfs(aiperf):
    summary = json.loads((aiperf / "profile_export_aiperf.json").read_text())
    prof = [r for r in records(aiperf, "profile_export.jsonl") if r["metadata"]["benchmark_phase"] == "profiling"]
    start, end = (datetime.fromisoformat(summary[k]) for k in ("start_time", "end_time"))  # the phase, to the us
    window = (end - start).total_seconds()
    f = agentx.figures([_record(r) for r in prof], window, level_stats)
    assert f["interactivity_p90"] == pytest.approx(1e3 / summary["inter_token_latency"]["p90"], rel=1e-12)
    for p in ("p50", "p90"):
        assert f["ttft_ms"][p] == pytest.approx(summary["time_to_first_token"][p], rel=1e-12)
    assert f["output_tok_s"] == pytest.approx(summary["output_token_throughput"]["avg"], rel=1e-6)  # window: to the us
    assert (f["requests"], f["completed"], f["output_tokens"]) == (
        summary["request_count"]["avg"], summary["completed_request_count"]["avg"], summary["total_osl"]["avg"])


def test_prompts_are_aiperfs(aiperf):
    convs = {c.id: c for t in agentx.load_traces(TRACES) for c in agentx.conversations(t).tree()}
    sent = records(aiperf, "profile_export_raw.jsonl")
    for r in sent:
        conv, k = convs[r["metadata"]["conversation_id"]], r["metadata"]["turn_index"]
        theirs, marked = [], False
        for m in r["payload"]["messages"]:
            text = m["content"]
            if m["role"] == "user" and not marked:
                assert MARKER.match(text), text[:40]
                text, marked = MARKER.sub("", text), True
            theirs.append((m["role"], len(text)))
        mine = [(role, sum(p[1] if isinstance(p, tuple) else conv.block for p in pieces))
                for role, pieces in conv.turns[k].messages]
        assert mine == theirs, (conv.id, k)
    assert len(sent) > 2 * LANES


def test_requests_are_aiperfs(replay, aiperf):
    (lv,) = replay[0]["levels"]
    ours, theirs = _replay_requests(lv), _aiperf_requests(aiperf)
    assert {k for k in ours if k[2] == "warmup"} == {k for k in theirs if k[2] == "warmup"}
    both = sorted(set(ours) & set(theirs))
    assert sum(k[2] == "profiling" for k in both) >= 2 * LANES
    assert {k: ours[k] for k in both} == {k: theirs[k] for k in both}
    counters = json.loads((aiperf / "server_metrics_export.json").read_text())["metrics"]
    total = lambda name: sum(s["stats"]["total"] for s in counters[name]["series"])  # noqa: E731
    server = total("vllm:prefix_cache_hits") / total("vllm:prefix_cache_queries")
    print(f"hit rate: replay's server {lv['server']['hit_rate']:.3f}, aiperf's {server:.3f}")
    assert abs(lv["server"]["hit_rate"] - server) <= HIT_TOLERANCE


def _instant(request: httpx.Request) -> httpx.Response:
    """A chat server that streams the asked tokens at once."""
    n = json.loads(request.content)["max_completion_tokens"]
    chunks = [{"choices": [{"index": 0, "delta": {"content": "a"}}]}] * n + [
        {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})


def test_join_turn_waits_for_its_subagent():
    """agentx_c's subagent starts after root turn 1 and the root's turn 2 joins it: against a server that answers at
    once (so the join is due before the subagent is done), every play sends root turn 2 only after the subagent's
    last turn ended."""
    traces = agentx.load_traces(TRACES)
    root = agentx.conversations(next(t for t in traces if t["id"] == "agentx_c"))
    sub = root.branches[0].children[0]
    assert (root.branches[0].spawn, root.branches[0].join, len(sub.turns)) == (1, 2, 2)

    async def replay():
        async with httpx.AsyncClient(transport=httpx.MockTransport(_instant)) as client:
            rp = agentx.Replay([root], agentx.block_hits(traces), client, "http://agentx", NAME,
                               agentx.BlockText(list("ab"), "chars"), 1, 4.0, 0, "salt", LIMIT)
            await rp.run(lambda: asyncio.sleep(0, result={}))
        return sorted((r for r in rp.records if r["phase"] == "profiling"), key=lambda r: r["sent_s"])
    joins, spawned = 0, None
    for r in asyncio.run(replay()):
        assert "error" not in r, r
        if r["conversation"] == root.id and r["turn"] == 1:
            spawned, last = r["sent_s"], None
        elif r["conversation"] == sub.id and r["turn"] == 1 and spawned is not None:
            last = r["end_s"]
        elif r["conversation"] == root.id and r["turn"] == 2 and spawned is not None:
            assert last is not None and last <= r["sent_s"]
            joins += 1
    assert joins >= 2


@pytest.mark.parametrize("argv", [["--traces", str(TRACES)],  # --traces without the agentx workload
                                  ["--workload", "agentx"],   # the agentx workload without traces
                                  ["--workload", "agentx", "--traces", str(TRACES), "--temperature", "0.6"],
                                  ["--workload", "agentx", "--traces", str(TRACES), "--duration", "0"]])
def test_cli_refuses_what_agentx_does_not_send(argv, capsys):
    assert server_cli(["bench", "serve", "--base-url", "http://127.0.0.1:9", *argv]) == 2
    assert "error:" in capsys.readouterr().err
