"""OpenAI-compatible server end to end: the tiny preset with dummy weights behind
uvicorn on loopback, driven by the official `openai` client and raw httpx.

Greedy outputs are checked against a second engine's `generate` (same seeded
weights, no HTTP), streams against non-stream answers, usage and /metrics
against the requests sent, and disconnects against the engine's free cache.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from peregrine.config import EngineConfig
from peregrine.engine import SamplingParams
from peregrine.engine.build import build_engine
from peregrine.server import BackgroundServer, create_app

pytestmark = pytest.mark.gpu  # device-agnostic: the GPU pass runs it on CUDA
MODEL = "tiny-kimi-linear"
NAME = "tiny"
MAX_LEN = 256       # small cache: a long-request test reserves few blocks
EOS = 257           # tiny preset's eos_token_id
LONG = 4096         # tokens: a request that outlives the 429 test even on a fast GPU
T = 60              # seconds: bound on any single request / wait in this file
quiet = lambda *a, **k: None  # noqa: E731


def make_engine(**kw):
    ecfg = EngineConfig(max_model_len=MAX_LEN, dtype="fp32", **kw)
    return build_engine(MODEL, ecfg, dummy_weights=True, log=quiet)


@pytest.fixture(scope="module")
def ref():
    """Independent path: a second engine with the same seeded weights, memoised."""
    eng, tok = make_engine()
    memo = {}

    def gen(ids, max_tokens, ignore_eos=False):
        key = (tuple(ids), max_tokens, ignore_eos)
        if key not in memo:
            memo[key] = eng.generate([list(ids)], SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))[0]
        return memo[key]
    gen.tok = tok
    return gen


@pytest.fixture(scope="module")
def srv():
    eng, tok = make_engine(max_num_seqs=8)
    app = create_app(eng, tok, NAME)
    with BackgroundServer(app) as s:
        s.engine, s.tok, s.state = eng, tok, app.state.peregrine
        s.free0 = eng.prefix_cache.num_free
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=T)
        yield s


def wait_idle(s, timeout=T):
    """Engine has nothing running and every block and slot is back."""
    deadline = time.time() + timeout
    e = s.engine
    while time.time() < deadline:
        if (not e.has_unfinished() and e.num_running == 0 and e.prefix_cache.num_free == s.free0
                and e.cache.num_free_slots == e.cache.num_slots):
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: running {e.num_running}, free blocks {e.prefix_cache.num_free}/{s.free0}")


def expected_text(tok, ids, finish):
    return tok.decode(ids[:-1] if finish == "stop" else ids)


def scrape(s) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(s.url + "/metrics", timeout=T).text):
        for smp in fam.samples:
            labels = tuple(sorted((k, v) for k, v in smp.labels.items() if k != "model_name"))
            out[(smp.name, labels)] = smp.value
    return out


# ---------------------------------------------------------------- basics
def test_models_and_health(srv):
    assert httpx.get(srv.url + "/health", timeout=T).json() == {"status": "ok"}
    ids = [m.id for m in srv.client.models.list().data]
    assert ids == [NAME]


@pytest.mark.parametrize("prompt", ["Hello, world", [72, 105, 33]])
def test_completion_matches_engine(srv, ref, prompt):
    r = srv.client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0,
                                      extra_body={"return_token_ids": True})
    ids = srv.tok.encode(prompt) if isinstance(prompt, str) else prompt
    want = ref(ids, 6)
    c = r.choices[0]
    assert c.token_ids == want
    assert c.finish_reason == ("stop" if want[-1] == EOS else "length")
    assert c.text == expected_text(srv.tok, want, c.finish_reason)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), len(want), len(ids) + len(want))


def test_stream_equals_non_stream(srv, ref):
    kw = dict(model=NAME, prompt="abc", max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    full = srv.client.completions.create(**kw)
    chunks = list(srv.client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == 7  # one chunk per token
    assert "".join(c.choices[0].text for c in token_chunks) == full.choices[0].text
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 7 and chunks[-1].usage.prompt_tokens == 3
    assert full.choices[0].text == srv.tok.decode(ref(srv.tok.encode("abc"), 7, ignore_eos=True))


def test_chat_simple_template(srv, ref):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = srv.tok.encode("<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n")  # documented simple template
    want = ref(ids, 5)
    r = srv.client.chat.completions.create(model=NAME, messages=msgs, max_tokens=5, temperature=0)
    finish = r.choices[0].finish_reason
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected_text(srv.tok, want, finish)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
    st = list(srv.client.chat.completions.create(model=NAME, messages=msgs, max_tokens=5, temperature=0, stream=True))
    assert st[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in st) == r.choices[0].message.content
    assert st[-1].choices[0].finish_reason == finish


def test_many_concurrent_clients(srv, ref):
    prompts = [f"q{i}" * (1 + i % 3) for i in range(12)]

    def one(i):
        kw = dict(model=NAME, prompt=prompts[i], max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
        if i % 2:
            return "".join(c.choices[0].text for c in srv.client.completions.create(stream=True, **kw) if c.choices)
        return srv.client.completions.create(**kw).choices[0].text
    with ThreadPoolExecutor(12) as ex:
        got = list(ex.map(one, range(12), timeout=3 * T))
    for p, g in zip(prompts, got):
        assert g == srv.tok.decode(ref(srv.tok.encode(p), 4, ignore_eos=True))
    wait_idle(srv)


# ---------------------------------------------------------------- disconnects
def test_stream_disconnect_aborts_and_frees(srv):
    before = scrape(srv).get(("peregrine:request_success_total", (("finished_reason", "abort"),)), 0)
    with httpx.Client(timeout=T) as c:
        for _ in range(3):
            body = {"model": NAME, "prompt": "long one", "max_tokens": MAX_LEN - 16, "ignore_eos": True, "stream": True}
            with c.stream("POST", srv.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                n = 0
                for line in r.iter_lines():
                    n += line.startswith("data: ")
                    if n == 2:
                        break  # leave mid-stream: closing the response drops the connection
    wait_idle(srv)
    after = scrape(srv)[("peregrine:request_success_total", (("finished_reason", "abort"),))]
    assert after - before == 3


def test_non_stream_disconnect_aborts(srv):
    body = {"model": NAME, "prompt": "x", "max_tokens": MAX_LEN - 16, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(T, read=0.5))
    wait_idle(srv)


# ---------------------------------------------------------------- malformed
BAD = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    ({"model": NAME, "prompt": 5}, "prompt"),
    ({"model": NAME, "prompt": ""}, "empty"),
    ({"model": NAME, "prompt": ["a", "b"]}, "one prompt"),
    ({"model": NAME, "prompt": [1, 99999]}, "token ids"),
    ({"model": NAME, "prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"model": NAME, "prompt": "a", "max_tokens": -3}, "max_tokens"),
    ({"model": NAME, "prompt": "a", "max_tokens": "5"}, "max_tokens"),
    ({"model": NAME, "prompt": "a", "temperature": "hot"}, "temperature"),
    ({"model": NAME, "prompt": "a", "top_p": 0}, "top_p"),
    ({"model": NAME, "prompt": "a", "stream": "yes"}, "stream"),
    ({"model": NAME, "prompt": "a", "n": 0}, "'n'"),
    ({"model": NAME, "prompt": "a", "n": 2, "best_of": 3}, "best_of"),
    ({"model": NAME, "prompt": "a", "logprobs": 21}, "logprobs"),
    ({"model": NAME, "prompt": "a", "logprobs": True}, "logprobs"),
    ({"model": NAME, "prompt": "a", "stop": ["\n", ""]}, "stop"),
    ({"model": NAME, "prompt": "a", "stop": 5}, "stop"),
    ({"model": NAME, "prompt": "a", "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": NAME, "prompt": "a", "frequency_penalty": "x"}, "frequency_penalty"),
    ({"model": NAME, "prompt": "a", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"model": NAME, "prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": NAME, "prompt": "a", "min_p": 1.5}, "min_p"),
    ({"model": NAME, "prompt": "a", "top_k": -2}, "top_k"),
    ({"model": NAME, "prompt": "a", "temperature": -0.5}, "temperature"),
    ({"model": NAME, "prompt": "a", "top_p": 1.2}, "top_p"),
    ({"model": NAME, "prompt": "a", "logit_bias": {"65": 500}}, "logit_bias"),  # OpenAI's range is [-100, 100]
    ({"model": NAME, "prompt": "a\ud800b"}, "lone surrogate"),
    ({"model": NAME, "prompt": "a", "stop": ["\udfff"]}, "stop[0]"),
    ({"model": NAME, "prompt": "x" * MAX_LEN}, "limit"),
    ({"model": NAME, "prompt": "abc", "max_tokens": MAX_LEN}, "limit"),
    ({"model": NAME, "prompt": "a", "stop_token_ids": [1000]}, "stop_token_ids"),
]
BAD_CHAT = [
    ({"model": NAME}, "messages"),
    ({"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x\ud83d"}]}, "messages[0].content"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
]


def _post(srv, path, body):
    # json.dumps escapes non-ASCII (as many clients do): a lone surrogate travels as "\\ud800", which
    # httpx's own encoder (UTF-8) could not send at all
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.url + path, timeout=T, headers={"content-type": "application/json"}, content=data)


@pytest.mark.parametrize("body,needle", BAD)
def test_malformed_completions_400(srv, body, needle):
    r = _post(srv, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,needle", BAD_CHAT)
def test_malformed_chat_400(srv, body, needle):
    r = _post(srv, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_openai_client_sees_bad_request(srv):
    with pytest.raises(openai.BadRequestError) as ei:
        srv.client.completions.create(model=NAME, prompt="a", max_tokens=0)
    assert "max_tokens" in str(ei.value)
    with pytest.raises(openai.NotFoundError):
        srv.client.completions.create(model="nope", prompt="a", max_tokens=1)


@pytest.mark.parametrize("path,body", [("/v1/completions", {"model": "other", "prompt": "a"}),
                                       ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "a"}]})])
def test_unknown_model_is_404_model_not_found(srv, path, body):
    """As OpenAI and vLLM answer it: 404, code model_not_found, OpenAI's error body."""
    r = _post(srv, path, body)
    assert r.status_code == 404, r.text
    assert r.json() == {"error": {"message": "The model `other` does not exist: this server serves `tiny`",
                                  "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}


# ---------------------------------------------------------------- metrics
def test_metrics_counters_move(srv):
    wait_idle(srv)
    a = scrape(srv)
    reqs = [("ab", 3), ("cdef", 5), ("g", 2)]
    for p, n in reqs:
        srv.client.completions.create(model=NAME, prompt=p, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):
        srv.client.completions.create(model=NAME, prompt="a", max_tokens=0)
    b = scrape(srv)
    d = lambda name, labels=(): b.get((name, labels), 0) - a.get((name, labels), 0)  # noqa: E731
    assert d("peregrine:prompt_tokens_total") == sum(len(p) for p, _ in reqs)
    assert d("peregrine:generation_tokens_total") == sum(n for _, n in reqs)
    assert d("peregrine:time_to_first_token_seconds_count") == 3
    assert d("peregrine:inter_token_latency_seconds_count") == sum(n - 1 for _, n in reqs)
    assert d("peregrine:e2e_request_latency_seconds_count") == 3
    assert d("peregrine:request_success_total", (("finished_reason", "length"),)) == 3
    assert d("peregrine:request_errors_total", (("status", "400"),)) == 1
    steps = sum(v - a.get(k, 0) for k, v in b.items() if k[0] == "peregrine:decode_steps_total")
    assert steps >= max(n for _, n in reqs)  # at least one step per generated token of the longest
    assert ("peregrine:decode_steps_total", (("path", "standard"),)) in b
    assert ("peregrine:decode_lookahead_steps_total", ()) in b  # 0 here: the standard runner does not look ahead
    assert b[("peregrine:num_requests_running", ())] == 0 and b[("peregrine:num_requests_waiting", ())] == 0
    assert b[("peregrine:cache_usage_perc", ())] == 0.0


def test_cached_tokens_in_usage_and_vllms_prefix_cache_series(srv):
    """A prompt sent again: usage.prompt_tokens_details.cached_tokens (the answer's and the stream's usage chunk) says
    what its admission reused, equal to the engine's own count; vLLM's prefix-cache counters and request gauges
    move with peregrine's (aiperf computes its server hit rate from them); HEAD /metrics answers as GET does."""
    wait_idle(srv)
    bs = srv.engine.cache.block_size
    ids = list(range(40, 40 + 2 * bs + 9))  # two whole blocks and more, different from other tests' prompts
    kw = dict(model=NAME, prompt=ids, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    first = srv.client.completions.create(**kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    a, h0 = scrape(srv), srv.engine.prefix_cache.stats["hit_tokens"]
    again = srv.client.completions.create(**kw)
    got = again.usage.prompt_tokens_details.cached_tokens
    assert got == srv.engine.prefix_cache.stats["hit_tokens"] - h0 == 2 * bs  # whole blocks before the last token
    chunks = list(srv.client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 2 * bs
    wait_idle(srv)
    b = scrape(srv)
    vl = (("engine", "0"),)
    d = lambda name, labels=(): b.get((name, labels), 0) - a.get((name, labels), 0)  # noqa: E731
    assert d("vllm:prefix_cache_hits_total", vl) == d("peregrine:prefix_cache_hits_total") == 4 * bs
    assert d("vllm:prefix_cache_queries_total", vl) == d("peregrine:prefix_cache_queries_total") == 2 * len(ids)
    for name in ("num_requests_running", "num_requests_waiting"):
        assert b[(f"vllm:{name}", vl)] == b[(f"peregrine:{name}", ())] == 0
    assert b[("vllm:kv_cache_usage_perc", vl)] == b[("peregrine:cache_usage_perc", ())]
    head = httpx.head(srv.url + "/metrics", timeout=T)
    assert head.status_code == 200 and head.text == "" and head.headers["content-type"].startswith("text/plain")


# ---------------------------------------------------------------- failures
def test_engine_error_fails_requests_and_keeps_serving(srv):
    runner = srv.engine.runner
    orig = runner.forward
    calls = {"n": 0}

    def boom(step):
        calls["n"] += 1
        raise RuntimeError("injected failure")
    runner.forward = boom
    try:
        r = _post(srv, "/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": 3})
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=T,
                          json={"model": NAME, "prompt": "a", "max_tokens": 3, "stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert "injected failure" in json.loads(lines[0][6:])["error"]["message"] and lines[-1] == "data: [DONE]"
    finally:
        runner.forward = orig
    assert calls["n"] >= 2
    wait_idle(srv)
    r = srv.client.completions.create(model=NAME, prompt="a", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1
    assert scrape(srv)[("peregrine:engine_step_errors_total", ())] >= 2


def test_unexpected_error_answers_500(srv, monkeypatch):
    def broken(text):
        raise ValueError("tokenizer exploded")
    monkeypatch.setattr(srv.tok, "encode", broken)
    r = _post(srv, "/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": 1})
    assert r.status_code == 500 and "tokenizer exploded" in r.json()["error"]["message"]
    monkeypatch.undo()
    assert _post(srv, "/v1/completions", {"model": NAME, "prompt": "a", "max_tokens": 1}).status_code == 200


def test_queue_full_answers_429():
    eng, tok = build_engine(MODEL, EngineConfig(max_model_len=LONG, max_num_seqs=1, dtype="fp32"), dummy_weights=True,
                            log=quiet)
    with BackgroundServer(create_app(eng, tok, NAME, max_queue=1)) as s, httpx.Client(timeout=T) as c:
        body = {"model": NAME, "prompt": "zz", "max_tokens": LONG - 8, "ignore_eos": True, "stream": True}
        with c.stream("POST", s.url + "/v1/completions", json=body) as r1:
            lines1 = r1.iter_lines()  # kept referenced: a dropped iterator closes the connection
            next(lines1)  # r1 is running
            with c.stream("POST", s.url + "/v1/completions", json=body) as r2:
                assert r2.status_code == 200  # queued behind r1
                deadline = time.time() + T
                while eng.num_waiting < 1 and time.time() < deadline:
                    time.sleep(0.02)
                assert eng.num_running == 1 and eng.num_waiting == 1
                r3 = c.post(s.url + "/v1/completions", json={"model": NAME, "prompt": "a", "max_tokens": 1})
                assert r3.status_code == 429
                assert "busy" in r3.json()["error"]["message"]
                with pytest.raises(openai.RateLimitError):
                    openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=T).completions.create(
                        model=NAME, prompt="a", max_tokens=1)
        deadline = time.time() + T
        while eng.has_unfinished() and time.time() < deadline:
            time.sleep(0.05)
        assert not eng.has_unfinished() and eng.prefix_cache.num_free == eng.cache.num_blocks
        assert c.get(s.url + "/health").status_code == 200


# ---------------------------------------------------------------- bench + CLI
def test_bench_serve_against_server(srv, tmp_path):
    from peregrine.bench.serve import run_cli
    from peregrine.server.cli import add_bench_serve_parser
    p = argparse.ArgumentParser()
    add_bench_serve_parser(p.add_subparsers())
    args = p.parse_args(["serve", "--base-url", srv.url, "--max-concurrency", "1,2", "--num-prompts", "2",
                         "--input-len", "6", "--output-len", "3", "--warmup", "0", "--timeout", str(T),
                         "--results-dir", str(tmp_path)])
    assert run_cli(args) == 0
    (js,) = tmp_path.glob("*-serve.json")
    data = json.loads(js.read_text())
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2]
    for lv in data["levels"]:
        assert lv["errors"] == 0 and lv["completed"] == 2 and lv["output_tokens"] == 6
        assert 0 < lv["ttft_ms"]["p50"] <= lv["ttft_ms"]["p99"] and lv["tpot_ms"]["p50"] > 0
        assert lv["tok_s_user"] > 0 and lv["throughput_per_gpu"] > 0
    if importlib.util.find_spec("matplotlib"):
        assert js.with_suffix(".png").stat().st_size > 1000
    wait_idle(srv)


def test_bench_serve_sampled_requests(srv, tmp_path):
    from peregrine.bench.serve import run_cli
    from peregrine.server.cli import add_bench_serve_parser
    p = argparse.ArgumentParser()
    add_bench_serve_parser(p.add_subparsers())
    base = ["serve", "--base-url", srv.url, "--max-concurrency", "2", "--num-prompts", "2", "--input-len", "6",
            "--output-len", "3", "--warmup", "0", "--timeout", str(T), "--results-dir", str(tmp_path), "--no-plot"]
    args = p.parse_args(base + ["--temperature", "0.6", "--top-p", "0.95", "--logprobs", "2"])
    assert run_cli(args) == 0
    (js,) = tmp_path.glob("*-serve.json")
    data = json.loads(js.read_text())
    assert data["sampling"] == {"temperature": 0.6, "top_p": 0.95, "logprobs": 2}
    assert data["levels"][0]["errors"] == 0 and data["levels"][0]["output_tokens"] == 6
    from peregrine.config import ConfigError
    with pytest.raises(ConfigError, match="--temperature"):
        run_cli(p.parse_args(base + ["--top-p", "0.9"]))
    wait_idle(srv)


def test_bench_serve_poisson_arrivals(srv, tmp_path):
    """--request-rate: requests are sent no earlier than their seeded Poisson arrival times."""
    from peregrine.bench.serve import arrivals, run_cli
    from peregrine.server.cli import add_bench_serve_parser
    p = argparse.ArgumentParser()
    add_bench_serve_parser(p.add_subparsers())
    args = p.parse_args(["serve", "--base-url", srv.url, "--max-concurrency", "4", "--num-prompts", "4",
                         "--input-len", "5", "--output-len", "2", "--warmup", "0", "--timeout", str(T),
                         "--request-rate", "20", "--results-dir", str(tmp_path), "--no-plot"])
    assert run_cli(args) == 0
    (lv,) = json.loads(next(tmp_path.glob("*-serve.json")).read_text())["levels"]
    sched = arrivals(4, 20.0, 0)
    assert lv["arrivals_s"] == sched and sched[0] == 0 and all(b > a for a, b in zip(sched, sched[1:]))
    assert all(s >= a - 1e-3 for s, a in zip(lv["sent_s"], sched)) and lv["completed"] == 4
    assert arrivals(3, None, 0) == [0.0, 0.0, 0.0]
    wait_idle(srv)


def test_serve_parser_options():
    from peregrine.server.cli import add_serve_parser
    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    a = p.parse_args(["serve", "--model", MODEL, "--dummy-weights", "--port", "0", "--max-queue", "3",
                      "--kv-cache-dtype", "fp8", "--additional-config", '{"cuda_graphs": false}'])
    assert (a.max_queue, a.kv_cache_dtype, a.served_model_name, a.host) == (3, "fp8", None, "127.0.0.1")


def test_sigterm_drains_in_flight(tmp_path):
    from conftest import start_server
    proc, url = start_server(["--model", MODEL, "--dummy-weights", "--max-model-len", str(MAX_LEN), "--dtype", "fp32",
                              "--log-level", "warning"], timeout=2 * T)
    try:
        body = {"model": MODEL, "prompt": "drain", "max_tokens": 12, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        chunks = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=T) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
                    if len(chunks) == 1:
                        proc.send_signal(signal.SIGTERM)  # mid-stream
        assert chunks[-1]["usage"]["completion_tokens"] == 12
        assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=T) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_zz_still_healthy(srv):
    assert httpx.get(srv.url + "/health", timeout=T).status_code == 200
    r = srv.client.completions.create(model=NAME, prompt="end", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    wait_idle(srv)


def test_itl_counts_each_token_of_a_multi_token_step():
    """A speculative step delivers several tokens at once; the inter-token histogram gets one sample
    per token (the step's gap shared out), not one per step."""
    from types import SimpleNamespace
    from peregrine.server.app import Tracker
    from peregrine.server.metrics import Metrics
    from peregrine.tokenizer import ByteTokenizer
    fake_engine = SimpleNamespace(stats={}, scheduler=None)
    try:
        m = Metrics(fake_engine, "t")
    except Exception as e:  # Metrics reads more of the engine only lazily; fail loudly if that changes
        raise AssertionError(f"Metrics needs a fuller engine: {e}")
    st = SimpleNamespace(metrics=m, tokenizer=ByteTokenizer(320))
    tr = Tracker(st, arrival=0.0, stop_ids={257})
    out = lambda new, allids, fin=False: SimpleNamespace(new_token_ids=new, output_token_ids=allids,  # noqa: E731
                                                        finished=fin, finish_reason="length" if fin else None)
    tr.update(1.0, out([65], [65]))
    tr.update(1.3, out([66, 67, 68], [65, 66, 67, 68]))
    assert m.itl._sum.get() == pytest.approx(0.3) and sum(b.get() for b in m.itl._buckets) == 3
    assert m.generation_tokens._value.get() == 4
