"""Forced replies (benchmarks only): `serve --allow-forced-replies` lets a /v1/completions request carry
`forced_tokens`, the reply the engine emits whatever the model says (engine.forced), and `bench serve --workload
agent` drives such a server with agent sessions whose every turn re-sends the conversation.

- The engine: a forced row keeps decode lookahead, and the model then reads the forced token (not its own) as
  the next input, token for token as without lookahead (the FakeRunner's logits depend on everything it read);
  the forced entry is dropped however the request ends (finished, aborted, failed, refused).
- The server: exactly the forced tokens come back; without the flag, and for every bad value, a 400 whose
  message and `param` name the field; no forced entry is left behind, a disconnected stream included.
- The workload: every turn's prompt is the last turn's prompt + its reply + new text, all turns answered, and
  with suffix speculation on the server accepts drafts on the forced agent text.
"""
from __future__ import annotations

import argparse
import json
import time

import httpx
import pytest

from peregrine.config import EngineConfig
from peregrine.engine import SamplingParams
from peregrine.engine.build import build_engine
from peregrine.engine.request import RequestError
from peregrine.server import BackgroundServer, create_app
from fake_runner import ref_logits
from test_engine import V, check_clean, prompts, ref_generate
from test_lookahead import make_engine

pytestmark = pytest.mark.gpu  # device-agnostic: the GPU pass runs it on CUDA
MODEL, NAME, MAX_LEN = "tiny-kimi-linear", "tiny", 4096
T = 60  # seconds: bound on any request or wait
quiet = lambda *a, **k: None  # noqa: E731


# ---------------------------------------------------------------- engine
def forced_run(lookahead: bool):
    """Forced rows (greedy, greedy with a penalty, sampled; forced shorter than max_tokens, so the model's own
    tokens follow) beside an unforced one. -> (outputs by request, the inputs every step fed the runner, engine)."""
    ps = prompts([5, 3, 7, 4], seed=3)
    forced = {"g": [11, 12, 13, 14, 15, 16], "pen": [7, 7, 8, 9], "s": [30, 31, 32, 33, 34]}
    params = {"g": SamplingParams(max_tokens=10, ignore_eos=True),
              "pen": SamplingParams(max_tokens=9, ignore_eos=True, repetition_penalty=1.3),
              "s": SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.8, seed=5),
              "free": SamplingParams(max_tokens=8, ignore_eos=True)}
    eng, runner, cache = make_engine(lookahead, max_num_seqs=4)
    fed = []
    fwd = runner.forward

    def record(step):
        fed.append(sorted(zip(step.positions.tolist(), step.input_ids.tolist())))
        return fwd(step)
    runner.forward = record
    for name, p in zip(params, ps):
        eng.add_request(p, params[name], name, forced=forced.get(name))
    assert set(eng.forced) == set(forced)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.output_token_ids
    check_clean(eng, runner, cache)
    assert eng.forced == {}
    return outs, fed, eng, ps, forced


def test_forced_rows_keep_lookahead_and_the_model_reads_the_forced_tokens():
    on, fed_on, eng_on, ps, forced = forced_run(True)
    off, fed_off, eng_off, _, _ = forced_run(False)
    assert eng_on.stats["lookahead_steps"] > 0 and eng_off.stats["lookahead_steps"] == 0
    assert on == off and fed_on == fed_off  # the same tokens in, step by step, with and without lookahead
    for name in forced:
        assert on[name][:len(forced[name])] == forced[name]
    g = ps[0] + forced["g"]  # after its forced tokens the model continues from them, not from its own
    assert on["g"] == forced["g"] + ref_generate(g, 4, ignore_eos=True)[0]
    assert on["g"][:6] != ref_generate(ps[0], 6, ignore_eos=True)[0]
    assert on["free"] == ref_generate(ps[3], 8, ignore_eos=True)[0]
    assert int(ref_logits(g, V).argmax()) == on["g"][6]


def test_forced_entry_dropped_however_the_request_ends():
    eng, runner, cache = make_engine(True, max_num_seqs=4)
    p = prompts([4, 4, 4, 4], seed=9)
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    eng.add_request(p[0], sp, "done", forced=[1, 2, 3])
    eng.add_request(p[1], sp, "abort-running", forced=[4] * 30)
    eng.add_request(p[2], sp, "fail", forced=[5] * 30)
    for _ in range(3):
        eng.step()
    eng.abort("abort-running")
    seq = eng._live["fail"]

    def fault(tok, may_stop=True):
        raise RuntimeError("injected stop-matching fault")
    seq.text = type("T", (), {"add": staticmethod(fault)})()
    eng.add_request(p[3], sp, "abort-waiting", forced=[6, 7])
    eng.abort("abort-waiting")  # before it ever ran
    while eng.has_unfinished():
        eng.step()
    assert eng.forced == {} and eng.stats["failed_requests"] == 1 and eng.stats["aborted_requests"] == 2
    check_clean(eng, runner, cache)
    for bad, why in (([], "non-empty"), ([V], "ints in"), ([-1], "ints in"), ([1.0], "ints in"), ([True], "ints in"),
                     ([1] * 31, "max_tokens")):
        with pytest.raises(RequestError, match=why) as ei:
            eng.add_request(p[0], sp, "bad", forced=bad)
        assert ei.value.param == "forced_tokens"
    assert eng.forced == {} and not eng.has_unfinished()


# ---------------------------------------------------------------- server
def make_server_engine(spec=None):
    return build_engine(MODEL, EngineConfig(max_model_len=MAX_LEN, dtype="fp32", max_num_seqs=4,
                                            speculative_config=spec), dummy_weights=True, log=quiet)


@pytest.fixture(scope="module")
def srv():
    """A server with --allow-forced-replies; every request the engine takes is recorded (prompt, forced)."""
    eng, tok = make_server_engine()
    calls = []
    add = eng.add_request

    def record(prompt, params, request_id=None, on_token=None, forced=None):
        calls.append((list(prompt), forced))
        return add(prompt, params, request_id=request_id, on_token=on_token, forced=forced)
    eng.add_request = record
    app = create_app(eng, tok, NAME, allow_forced_replies=True)
    with BackgroundServer(app) as s:
        s.engine, s.calls = eng, calls
        yield s


@pytest.fixture(scope="module")
def off():
    """The same server without the flag."""
    eng, tok = make_server_engine()
    with BackgroundServer(create_app(eng, tok, NAME)) as s:
        s.engine = eng
        yield s


def wait_idle(s):
    deadline = time.time() + T
    while s.engine.has_unfinished() and time.time() < deadline:
        time.sleep(0.05)
    assert not s.engine.has_unfinished()


def post(s, body, path="/v1/completions"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(s.url + path, content=data, headers={"content-type": "application/json"}, timeout=T)


def test_forced_reply_is_exactly_the_forced_tokens(srv):
    forced = [72, 105, 33, 300, 5, 5, 5]
    body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 7, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "forced_tokens": forced}
    for extra in ({}, {"temperature": 0.7, "top_p": 0.9}, {"n": 2}):
        r = post(srv, body | extra)
        assert r.status_code == 200, r.text
        assert [c["token_ids"] for c in r.json()["choices"]] == [forced] * extra.get("n", 1)
        assert r.json()["usage"]["completion_tokens"] == 7 * extra.get("n", 1)
    got = []
    with httpx.stream("POST", srv.url + "/v1/completions", json=body | {"stream": True}, timeout=T) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += json.loads(line[6:])["choices"][0]["token_ids"]
    assert got == forced
    # fewer forced tokens than max_tokens: the model's own tokens follow, read after the forced ones
    r = post(srv, body | {"max_tokens": 10})
    ids = r.json()["choices"][0]["token_ids"]
    ref, _ = make_server_engine()
    assert ids[:7] == forced and ids[7:] == ref.generate([[1, 2, 3] + forced], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    wait_idle(srv)
    assert srv.engine.forced == {}


def _field_error(r, needle: str = "forced_tokens"):
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["param"] == "forced_tokens" and "'forced_tokens'" in e["message"] and needle in e["message"], e
    return e


def test_forced_tokens_refused_without_the_flag(off):
    body = {"model": NAME, "prompt": [1, 2], "max_tokens": 2, "forced_tokens": [3, 4]}
    _field_error(post(off, body), "--allow-forced-replies")
    _field_error(post(off, body | {"forced_tokens": "junk"}), "--allow-forced-replies")  # refused before it is read
    assert post(off, body | {"forced_tokens": None}).status_code == 200  # null: absent, as any other field
    wait_idle(off)
    assert off.engine.forced == {}


BAD = [
    ([V], f"[0, {V})"),
    ([1, -1], f"[0, {V})"),
    ([2**70], f"[0, {V})"),
    ([1] * 5, "max_tokens is 4"),
    (["a"], "integer token ids"),
    ([1.5], "integer token ids"),
    ([True], "integer token ids"),
    ([[1]], "integer token ids"),
    ([], "non-empty"),
    ("1 2", "list"),
    ({"0": 1}, "list"),
    (7, "list"),
]


@pytest.mark.parametrize("forced,needle", BAD)
def test_bad_forced_tokens_are_a_400_naming_the_field(srv, forced, needle):
    _field_error(post(srv, {"model": NAME, "prompt": [1, 2], "max_tokens": 4, "forced_tokens": forced}), needle)


def test_forced_tokens_other_refusals(srv):
    base = {"model": NAME, "prompt": [1, 2], "max_tokens": 4}
    huge = b'{"model": "tiny", "prompt": [1, 2], "max_tokens": 4, "forced_tokens": [1' + b"9" * 5000 + b"]}"
    _field_error(post(srv, huge), "5001 digits")
    _field_error(post(srv, base | {"forced_tokens": [1], "logprobs": 2}), "logprobs")
    _field_error(post(srv, base | {"forced_tokens": [1], "echo": True, "max_tokens": 0}), "max_tokens is 0")
    chat = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "forced_tokens": [1]}
    _field_error(post(srv, chat, "/v1/chat/completions"), "/v1/completions")
    wait_idle(srv)
    assert srv.engine.forced == {}


def test_no_forced_entry_left_after_a_disconnected_stream(srv):
    body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": True,
            "forced_tokens": [9] * 400}
    for _ in range(2):
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=T) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data: ")
                if n == 3:
                    assert srv.engine.forced  # mid-stream: still forced
                    break  # leave: closing the response drops the connection
    wait_idle(srv)
    assert srv.engine.forced == {} and srv.engine.stats["aborted_requests"] >= 2


def test_models_card_gives_the_vocabulary(srv):
    card = httpx.get(srv.url + "/v1/models", timeout=T).json()["data"][0]
    assert card["vocab_size"] == V and card["max_model_len"] == MAX_LEN


# ---------------------------------------------------------------- bench serve --workload agent
def bench_args(url, tmp_path, *extra):
    from peregrine.server.cli import add_bench_serve_parser
    p = argparse.ArgumentParser()
    add_bench_serve_parser(p.add_subparsers())
    return p.parse_args(["serve", "--base-url", url, "--workload", "agent", "--max-concurrency", "2", "--turns", "2",
                         "--context-chars", "1600", "--max-reply-tokens", "48", "--warmup", "0", "--timeout", str(T),
                         "--results-dir", str(tmp_path), "--no-plot", *extra])


def test_agent_turns_resend_the_conversation():
    from peregrine.bench.serve import agent_turns
    for vocab, kind in ((320, "bytes"), (163840, "pieces")):
        work, got = agent_turns(3, 3, 9000, vocab, seed=4, salt="ab12")
        assert got == kind and len(work) == 3 and all(len(rows) == 3 for rows in work)
        for rows in work:
            for (p0, r0), (p1, _) in zip(rows, rows[1:]):
                assert p1[:len(p0) + len(r0)] == p0 + r0 and len(p1) > len(p0) + len(r0)
            assert all(0 <= t < vocab for p, r in rows for t in p + r)
        other, _ = agent_turns(3, 3, 9000, vocab, seed=4, salt="cd34")
        plain, _ = agent_turns(3, 3, 9000, vocab, seed=4, salt="")
        for a, b, c in zip(work, other, plain):  # a salt is a first line of its own; the same tokens after it
            ha, hb = len(a[0][0]) - len(c[0][0]), len(b[0][0]) - len(c[0][0])
            assert ha > 0 and hb > 0 and a[0][0][:ha] != b[0][0][:hb]
            assert [(p[ha:], r) for p, r in a] == [(p[hb:], r) for p, r in b] == c
    short, _ = agent_turns(2, 2, 3000, 320, seed=1, max_reply_tokens=10)
    assert all(len(r) <= 10 for rows in short for _, r in rows)
    assert short[0][1][0][:len(short[0][0][0]) + 10] == short[0][0][0] + short[0][0][1]


def test_agent_workload_completes_every_turn_resending_the_conversation(srv, tmp_path):
    from peregrine.bench.serve import run_cli
    srv.calls.clear()
    assert run_cli(bench_args(srv.url, tmp_path, "--salt", "s1", "--temperature", "0.6", "--top-p", "0.95")) == 0
    (js,) = tmp_path.glob("*-serve-agent.json")
    data = json.loads(js.read_text())
    (lv,) = data["levels"]
    assert data["workload"] == "agent" and data["agent"]["tokens"] == "bytes" and data["agent"]["forced"]
    assert lv["errors"] == 0 and lv["completed"] == 4 and lv["sessions"] == 2 and len(lv["turns"]) == 2
    assert lv["tpot_ms"]["p50"] > 0 and lv["ttft_ms"]["p50"] > 0 and lv["itl_ms"]["p99"] > 0
    assert lv["turns"][1]["input_tokens"]["p50"] > lv["turns"][0]["input_tokens"]["p50"]
    assert lv["server"]["acceptance_length"] is None  # no speculation on this server
    import numpy as np  # InferenceX's P90 interactivity from the requests' own records
    per_tok = [(r["e2e"] - r["ttft"]) / (r["n_out"] - 1) for r in lv["requests"] if r["n_out"] > 1]
    assert lv["interactivity_p90"] == pytest.approx(1 / np.percentile(per_tok, 90))
    pc = lv["prefix_cache"]  # the server's hits against a perfect cache's on the requests as sent
    assert pc["perfect_hit_tokens"] > 0 and pc["of_perfect"] >= 0.97, pc
    # what the engine received: per session, each prompt = the last prompt + its (forced) reply + new text
    assert len(srv.calls) == 4 and all(f is not None for _, f in srv.calls)
    def follows(a, b):  # b's prompt is a's prompt + a's reply + new text
        return len(b[0]) > len(a[0]) + len(a[1]) and b[0][:len(a[0]) + len(a[1])] == a[0] + a[1]
    seconds = [b for b in srv.calls if any(follows(a, b) for a in srv.calls)]
    firsts = [a for a in srv.calls if any(follows(a, b) for b in srv.calls)]
    assert len(seconds) == len(firsts) == 2 and all(sum(follows(a, b) for b in srv.calls) == 1 for a in firsts)
    assert sorted(r["output_tokens"] for r in lv["requests"]) == sorted(len(f) for _, f in srv.calls)
    wait_idle(srv)
    assert srv.engine.forced == {}


def test_agent_workload_unforced_and_against_a_server_without_the_flag(off, tmp_path):
    from peregrine.bench.serve import run_cli
    assert run_cli(bench_args(off.url, tmp_path, "--unforced", "--label", "u")) == 0
    (lv,) = json.loads(next(tmp_path.glob("*-serve-agent-u.json")).read_text())["levels"]
    assert lv["errors"] == 0 and lv["completed"] == 4
    assert run_cli(bench_args(off.url, tmp_path, "--label", "f")) == 1  # forced replies refused: every turn an error
    (lv,) = json.loads(next(tmp_path.glob("*-serve-agent-f.json")).read_text())["levels"]
    assert lv["errors"] == 4 and "--allow-forced-replies" in lv["error_samples"][0]
    from peregrine.config import ConfigError
    with pytest.raises(ConfigError, match="--num-prompts"):
        run_cli(bench_args(off.url, tmp_path, "--num-prompts", "3"))
    wait_idle(off)


def test_agent_workload_with_suffix_speculation_accepts_drafts(tmp_path):
    from peregrine.bench.serve import run_cli
    eng, tok = make_server_engine({"method": "suffix", "num_speculative_tokens": 5})
    with BackgroundServer(create_app(eng, tok, NAME, allow_forced_replies=True)) as s:
        assert run_cli(bench_args(s.url, tmp_path)) == 0
        s.engine = eng
        wait_idle(s)
    (lv,) = json.loads(next(tmp_path.glob("*-serve-agent.json")).read_text())["levels"]
    assert lv["errors"] == 0 and lv["completed"] == 4
    sv = lv["server"]
    assert sv["drafts"] > 0 and sv["accepted_tokens"] > 0 and sv["acceptance_length"] > 1.0, sv
    assert lv["prefix_cache"]["of_perfect"] >= 0.97, lv["prefix_cache"]  # speculation keeps the reuse
    assert eng.forced == {}
