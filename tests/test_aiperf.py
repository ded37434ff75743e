"""InferenceX's agentic benchmark on the CPU: aiperf's AgentX scenario (`aiperf profile --scenario
inferencex-agentx-mvp`, aiperf 0.13.0 in .venv-aiperf from requirements-aiperf.txt) replays the coding-agent sessions
of tests/agentx/traces (kv-cache-tester's format, aiperf's weka_trace loader) against a `peregrine serve` process.

The model and the server: tests/agentx_helpers.py. Shown:
- every request (warmup and profiled) is answered, streamed with `ignore_eos`, with exactly the tokens it asked for
  in `max_completion_tokens` (the server's usage, as InferenceX counts): the recorded reply's length (profiled) or
  one (aiperf's warmup turns);
- the server's prefix-cache hit rate, from the `vllm:prefix_cache_hits` / `_queries` counters aiperf scraped over
  the profiled phase (its only source for it), is within HIT_TOLERANCE of the traces' own: the share of each
  profiled request's blocks that lead its prompt and were sent before in its trace (peregrine/bench/agentx.py's
  block_hits, from the hash ids, equal to aiperf's "theoretical prefix cache hit");
- the scenario's rules hold except the two overrides a CPU run needs (below), and the traces are make_traces.py's.

Recorded prompts end inside their last block, as real ones do: aiperf fills the partial last block with tokens the
next turn drops, so consecutive turns share a prefix that ends before the earlier prompt's end. peregrine resumes KDA
from a state snapshot at a block end; it keeps one at a prompt's last block end and one a block before it
(engine.TAIL_SNAPSHOT_BLOCKS) for this. On these sessions: 0.636 with only the last one, 0.660 with both, against
the traces' 0.691 (2026-12-06).

No assertion depends on machine speed: how many turns the fixed profiling time covers varies, what each must be
does not; the limits only catch hangs.
"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from peregrine.bench.agentx import block_hits, load_traces
from agentx_helpers import AIPERF, NO_AIPERF, TRACES, run_aiperf, served, write_model
from agentx_helpers import records as _records

PROFILE_S = 15          # the profiled phase (the scenario asks >= 900 s): a few plays of each session on a CPU
HIT_TOLERANCE = 0.05    # server vs traces: template and cache-bust tokens, block rounding, a subagent's first turn
# the scenario rules a CPU run breaks (--unsafe-override makes them warnings; the result says submission_valid false)
OVERRIDDEN = {"--custom-dataset-type / --input-file",  # a local trace directory, not a pinned public corpus
              "--benchmark-duration"}                  # PROFILE_S, not >= 900 s


def trace_requests() -> dict[tuple[str, int, int | None], tuple[dict, int]]:
    """(trace id, outer index, inner index or None) -> (request, its blocks sent before in the trace, leading)."""
    return block_hits(load_traces(TRACES))


@pytest.fixture(scope="module")
def agentx(tmp_path_factory):
    """Serve the model, run aiperf's AgentX scenario on the traces; -> (artifact dir, aiperf's log)."""
    if not AIPERF.exists():
        pytest.skip(NO_AIPERF)
    tmp = tmp_path_factory.mktemp("agentx")
    write_model(tmp / "model")
    with served(tmp / "model", tmp / "serve.log") as url:
        yield run_aiperf(url, tmp / "model", tmp, PROFILE_S)


def _key(meta: dict) -> tuple[str, int, int | None]:
    return meta["source_trace_id"], meta["source_outer_idx"], meta.get("source_inner_idx")


def _profiled(art: Path) -> list[dict]:
    return [r for r in _records(art, "profile_export.jsonl") if r["metadata"]["benchmark_phase"] == "profiling"]


def test_agentx_answers_every_request_at_its_recorded_length(agentx):
    art, log = agentx
    known = trace_requests()
    records = _records(art, "profile_export.jsonl")
    failed = [(r["metadata"]["conversation_id"], r["metadata"]["turn_index"], r["error"]) for r in records
              if r.get("error")]
    assert not failed, f"requests not answered: {failed}"
    profiled = _profiled(art)
    assert {r["metadata"]["source_trace_id"] for r in profiled} == {k[0] for k in known}  # every lane was profiled
    asked = {r["metadata"]["x_request_id"]: r["payload"] for r in _records(art, "profile_export_raw.jsonl")}
    assert len(asked) == len(records)
    for r in records:  # warmup requests ask one token (aiperf's trajectory warmup), profiled ones the recorded reply
        body, meta = asked[r["metadata"]["x_request_id"]], r["metadata"]
        assert (body["ignore_eos"], body["stream"], body["stream_options"]) == (True, True, {"include_usage": True})
        want = known[_key(meta)][0]["out"] if meta["benchmark_phase"] == "profiling" else 1
        got = {m: r["metrics"][m]["value"] for m in ("output_sequence_length", "usage_completion_tokens")}
        assert body["max_completion_tokens"] == want and got == dict.fromkeys(got, want), (
            meta["conversation_id"], meta["turn_index"], meta["benchmark_phase"], body["max_completion_tokens"], got)
    summary = json.loads((art / "profile_export_aiperf.json").read_text())
    assert summary["metadata"]["scenario"] == "inferencex-agentx-mvp"
    assert summary["metadata"]["submission_invalid_reasons"] == ["unsafe_override"]
    overridden = set(re.findall(r"Scenario violation \(override active\): (.+?): got", log))
    assert overridden == OVERRIDDEN


def test_agentx_server_hit_rate_is_the_traces_own(agentx):
    art, _ = agentx
    known = trace_requests()
    profiled = _profiled(art)
    hits = sum(known[_key(r["metadata"])][1] for r in profiled)
    blocks = sum(len(known[_key(r["metadata"])][0]["hash_ids"]) for r in profiled)
    own = hits / blocks
    summary = json.loads((art / "profile_export_aiperf.json").read_text())
    assert summary["theoretical_prefix_cache_hit"]["avg"] == pytest.approx(100 * own)  # aiperf counts it the same
    counters = json.loads((art / "server_metrics_export.json").read_text())["metrics"]  # the profiled phase
    total = lambda name: sum(s["stats"]["total"] for s in counters[name]["series"])  # noqa: E731
    server = total("vllm:prefix_cache_hits") / total("vllm:prefix_cache_queries")
    cached = sum(r["metrics"]["usage_prompt_cache_read_tokens"]["value"] for r in profiled)
    prompt = sum(r["metrics"]["usage_prompt_tokens"]["value"] for r in profiled)
    print(f"hit rate: traces {own:.3f}, server counters {server:.3f}, usage.cached_tokens {cached / prompt:.3f} "
          f"({len(profiled)} requests profiled)")
    assert abs(server - own) <= HIT_TOLERANCE, (server, own)


def test_traces_are_make_traces_output():
    spec = importlib.util.spec_from_file_location("make_traces", TRACES.parent / "make_traces.py")
    mt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mt)
    assert sorted(p.stem for p in TRACES.glob("*.json")) == sorted(mt.SESSIONS)
    for sid in mt.SESSIONS:
        assert (TRACES / f"{sid}.json").read_text() == mt.render(mt.session(sid)), f"run {mt.__file__}"
