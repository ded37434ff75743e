"""InferenceX's agentic benchmark on the CPU: aiperf's AgentX scenario (`aiperf profile --scenario
inferencex-agentx-mvp`, aiperf 0.13.0 in .venv-aiperf from requirements-aiperf.txt) replays the coding-agent sessions
of tests/agentx/traces (kv-cache-tester's format, aiperf's weka_trace loader) against a `peregrine serve` process.

The model: tiny-kimi-linear with dummy weights in a folder the test writes, whose chat template renders the whole
conversation (peregrine-tiny's keeps only the last user message), so each turn's prompt extends the last one token
for token; its tokenizer gives every id one character (ASCII keeps its byte value), so any reply of random weights
is text and aiperf and the server count the same tokens. Shown:
- every request (warmup and profiled) is answered, streamed with `ignore_eos`, with exactly the tokens it asked for
  in `max_completion_tokens` (the server's usage, as InferenceX counts): the recorded reply's length (profiled) or
  one (aiperf's warmup turns);
- the server's prefix-cache hit rate, from the `vllm:prefix_cache_hits` / `_queries` counters aiperf scraped over
  the profiled phase (its only source for it), is within HIT_TOLERANCE of the traces' own: the share of each
  profiled request's blocks that lead its prompt and were sent before in its trace (computed here from the hash ids,
  and equal to aiperf's "theoretical prefix cache hit");
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
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"
TRACES = ROOT / "tests" / "agentx" / "traces"
PRESET = ROOT / "peregrine" / "presets" / "tiny-kimi-linear.json"
NAME = "tiny-kimi-linear-chat"
PROFILE_S = 15          # the profiled phase (the scenario asks >= 900 s): a few plays of each session on a CPU
LIMIT = 600.0           # generous bound on the server's start and on the whole aiperf run
HIT_TOLERANCE = 0.05    # server vs traces: template and cache-bust tokens, block rounding, a subagent's first turn
# the scenario rules a CPU run breaks (--unsafe-override makes them warnings; the result says submission_valid false)
OVERRIDDEN = {"--custom-dataset-type / --input-file",  # a local trace directory, not a pinned public corpus
              "--benchmark-duration"}                  # PROFILE_S, not >= 900 s

# ---- the model folder: the preset's config, a one-character-per-id tokenizer, a whole-conversation template ----
SPECIALS = {256: "[BOS]", 257: "[EOS]", 258: "[PAD]",  # the preset's bos / eos / pad ids
            259: "<|im_system|>", 260: "<|im_user|>", 261: "<|im_assistant|>", 262: "<|im_tool|>", 263: "<|im_end|>"}
TEMPLATE = ("{%- for m in messages -%}<|im_{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{%- endfor -%}"
            "{%- if add_generation_prompt -%}<|im_assistant|>{%- endif -%}")


def _char(i: int) -> str:
    """Token i's text: itself for printable ASCII and tab / newline / CR, else a Latin letter from U+0100 on (so no
    id decodes to nothing or to half a character); id 0 is the em dash aiperf's coding corpus uses."""
    if i == 0:
        return "\u2014"
    return chr(i) if 32 <= i < 127 or chr(i) in "\t\n\r" else chr(0x100 + i)


def write_model(folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models
    raw = json.loads(PRESET.read_text())
    vocab = {_char(i): i for i in range(raw["vocab_size"]) if i not in SPECIALS} | {s: i for i, s in SPECIALS.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: a character a token, text concatenates
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for _, s in sorted(SPECIALS.items())])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({  # what transformers' AutoTokenizer (aiperf) reads
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "[BOS]", "eos_token": "[EOS]",
        "pad_token": "[PAD]"}))
    (folder / "chat_template.jinja").write_text(TEMPLATE)


# ---- the traces' own hit rate ----
def trace_requests() -> dict[tuple[str, int, int | None], tuple[dict, int]]:
    """(trace id, outer index, inner index or None) -> (request, its blocks sent before in the trace, leading): one
    seen-set per trace over every conversation's requests in time order, as aiperf's weka loader counts."""
    out = {}
    for path in sorted(TRACES.glob("*.json")):
        trace = json.loads(path.read_text())
        reqs = []
        for i, r in enumerate(trace["requests"]):
            if r["type"] == "subagent":
                reqs += [(x["t"], (trace["id"], i, j), x) for j, x in enumerate(r["requests"])]
            else:
                reqs.append((r["t"], (trace["id"], i, None), r))
        seen: set[int] = set()
        for _, key, r in sorted(reqs, key=lambda x: x[0]):
            hits = next((k for k, h in enumerate(r["hash_ids"]) if h not in seen), len(r["hash_ids"]))
            out[key] = (r, hits)
            seen.update(r["hash_ids"])
    return out


# ---- the run ----
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def agentx(tmp_path_factory):
    """Serve the model, run aiperf's AgentX scenario on the traces; -> (artifact dir, aiperf's log)."""
    if not AIPERF.exists():
        pytest.skip(f"{AIPERF.relative_to(ROOT)} is missing: bash scripts/setup.sh installs aiperf there "
                    "(requirements-aiperf.txt)")
    tmp = tmp_path_factory.mktemp("agentx")
    model, art, port, server_log = tmp / "model", tmp / "artifacts", _free_port(), tmp / "serve.log"
    write_model(model)
    with server_log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "peregrine", "serve", "--model", str(model), "--dummy-weights", "--port", str(port),
             "--served-model-name", NAME, "--max-num-seqs", "4", "--log-level", "warning"],
            stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"})  # one thread beside the other test worker (CI has 2 cores)
    try:
        deadline = time.monotonic() + LIMIT
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, f"peregrine serve exited: {server_log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "peregrine serve did not come up"
            time.sleep(0.1)
        cmd = [str(AIPERF), "profile", "--scenario", "inferencex-agentx-mvp",
               "--unsafe-override",  # OVERRIDDEN's rules become warnings (checked below)
               "--url", f"http://127.0.0.1:{port}", "--endpoint-type", "chat", "--model", NAME,
               "--tokenizer", str(model),  # aiperf rebuilds every prompt from the traces' blocks with it
               "--input-file", str(TRACES), "--custom-dataset-type", "weka_trace",
               "--concurrency", "4",  # one lane per session
               "--use-server-token-count",  # as InferenceX: output lengths from the server's usage
               "--benchmark-duration", str(PROFILE_S),
               "--benchmark-grace-period", str(int(LIMIT)),  # requests in flight at the end finish (default 30 s)
               "--random-seed", "1",  # the lanes' start turns; the scenario would draw a seed
               "--workers-max", "1", "--record-processor-service-count", "1",  # 2 cores, shared
               "--no-gpu-telemetry", "--ui", "none",
               "--export-level", "raw",  # request bodies too, to check what was asked
               "--artifact-dir", str(art)]
        env = {**os.environ,
               "AIPERF_DATASET_MMAP_CACHE_ENABLED": "false",  # no dataset left in ~/.cache or reused from one
               "AIPERF_DATASET_MMAP_BASE_PATH": str(tmp)}
        for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # with either, aiperf 0.13.0 looks even a local
            env.pop(k, None)                                   # tokenizer folder up in the hub's cache, and fails
        r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=LIMIT)
        log = (art / "logs" / "aiperf.log").read_text() if (art / "logs" / "aiperf.log").exists() else ""
        assert r.returncode == 0, (f"aiperf failed ({r.returncode}): {r.stdout[-2000:]}\n{r.stderr[-2000:]}\n"
                                   f"{log[-3000:]}")
        yield art, log
    finally:
        server.kill()
        server.wait(30)


def _records(art: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (art / name).read_text().splitlines() if line.strip()]


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
