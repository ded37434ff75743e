"""One bad request never fails the others.

Two defences, tested apart:

- Admission (server/protocol.py, SamplingParams.validate): every request field with a value the engine's
  tensors or arithmetic cannot carry (integers past int64 / int32, floats that are NaN, infinite, 1e308 or an
  integer too large for a float, lists past their caps, bodies nested too deep or too large) is refused
  before the engine sees it, with a 400 that names the field, while a good request sent at the same
  moment is answered as if alone, and the server stays healthy. The same holds for chat's tools (an empty list, a
  tool without a name, a tool_choice naming no tool, "auto" on a server without a tool parser, a malformed
  tool_calls history) and for constraints the engine cannot compile (a JSON schema, regex or grammar): each a 400
  naming its field.
- Isolation (engine.py: _drop_faulty, _sample_each, _accept_all): a fault while preparing, drawing or
  stopping one request's row fails that request alone. Validation keeps such values out, so to reach this
  code the tests plant the faults themselves, after admission: they set a sequence's seed past int64 or
  its top_k past int32 (what the batched tensor builds raise on), make its penalty a string, or make its
  stop matching raise. That is deliberate fault injection, not a path a client can take. The other
  requests of the batch (greedy and seeded sampling) must answer exactly what they answer run alone.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

import peregrine.engine.engine as engine_mod
from fake_runner import FakeRunner
from peregrine.cache import ModelCache
from peregrine.config import EngineConfig, resolve_model
from peregrine.engine import SamplingParams
from peregrine.engine.build import build_engine
from peregrine.engine.engine import LLMEngine
from peregrine.engine.request import MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, Sequence
from peregrine.engine.stops import TextState
from peregrine.server import BackgroundServer, create_app
from peregrine.tokenizer import ByteTokenizer

pytestmark = pytest.mark.gpu  # device-agnostic
CFG, _ = resolve_model("tiny-kimi-linear")
V = CFG.vocab_size
T = 60  # seconds: bound on any request


# ---------------------------------------------------------------- engine: isolation
def fake_engine(device: bool):
    """device: the runner draws sampled rows inside its step from StepInput.sampling (the specialized runner's
    way), so a row's settings go through the batch's sampling tensors (_sampling_for) before the forward."""
    cache = ModelCache(CFG, num_blocks=256, block_size=4, num_slots=12, dtype=torch.float32, device="cpu")
    eng = LLMEngine(FakeRunner(cache, V, greedy=device), CFG,
                    EngineConfig(block_size=4, max_model_len=128, max_num_seqs=12), cache, tokenizer=ByteTokenizer(V))
    return eng


GOOD = {  # name -> (prompt, params): greedy, seeded sampling with every filter, penalties + logprobs + a stop string
    "greedy": ([5, 6, 7], dict(max_tokens=12, ignore_eos=True)),
    "sampled": ([9, 1], dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.01, seed=11, max_tokens=12, ignore_eos=True)),
    "penalised": ([3, 3, 4], dict(temperature=0.7, seed=5, repetition_penalty=1.3, presence_penalty=0.5,
                                  frequency_penalty=0.3, logprobs=2, stop=["\x00\x00\x00"], max_tokens=12, ignore_eos=True)),
    "late": ([8], dict(temperature=1.1, seed=23, max_tokens=6, ignore_eos=True)),  # joins after the bad ones
}


def _seed(seq):
    seq.seed = 2**64  # past int64: the batch's seed tensor cannot hold it


def _top_k(seq):
    seq.params.top_k = -2**40  # past int32: the batch's top_k tensor cannot hold it


def _penalty(seq):
    seq.params.repetition_penalty = "high"  # not a number: penalties (host or device) raise on it


def _stops(seq):
    def add(tok, may_stop=True):
        raise RuntimeError("injected stop-matching fault")
    seq.text.add = add


BAD = {  # name -> (prompt, params, fault, when: "admitted" = before its first token, "running" = after 2 tokens)
    "seed at admission": ([2, 2], dict(temperature=0.8, seed=1, max_tokens=12), _seed, "admitted"),
    "seed mid-run": ([4, 4], dict(temperature=0.8, seed=2, max_tokens=12, ignore_eos=True), _seed, "running"),
    "top_k mid-run": ([6], dict(temperature=0.8, top_k=5, seed=3, max_tokens=12, ignore_eos=True), _top_k, "running"),
    "penalty mid-run": ([7], dict(temperature=0.8, seed=4, repetition_penalty=1.2, max_tokens=12, ignore_eos=True),
                        _penalty, "running"),
    "stops at admission": ([1, 1], dict(max_tokens=12, stop=["!"]), _stops, "admitted"),
}
ERRORS = {  # what each one's error says (host sampler: the draw's own error; device sampler: its row's check)
    "seed at admission": ("Overflow",), "seed mid-run": ("Overflow",), "top_k mid-run": ("overflow", "top_k must be an int"),
    "penalty mid-run": ("unsupported operand", "repetition_penalty must be a number"),
    "stops at admission": ("injected stop-matching fault",)}


def run_alone(device: bool, prompt, kw) -> list[int]:
    eng = fake_engine(device)
    outs = []
    eng.add_request(prompt, SamplingParams(**kw), on_token=outs.append)
    while eng.has_unfinished():
        eng.step()
    assert outs[-1].finished and outs[-1].finish_reason != "error"
    return outs[-1].output_token_ids


@pytest.mark.parametrize("device", [False, True], ids=["host-sampler", "device-sampler"])
def test_faults_fail_their_own_request_only(device):
    """Good requests run; bad ones join the running batch (faults planted after admission, some before their
    first token, some mid-generation); a last good one joins after them. Each bad one finishes with
    finish_reason "error" naming its fault, every good one answers exactly what it answers alone, and the
    engine gives every slot and block back."""
    alone = {k: run_alone(device, p, kw) for k, (p, kw) in GOOD.items()}
    eng = fake_engine(device)
    free0 = eng.prefix_cache.num_free
    final, failed_steps = {}, []

    def add(name, prompt, kw):
        def on(out, name=name):
            if out.finished:
                final[name] = out
        eng.add_request(prompt, SamplingParams(**kw), request_id=name, on_token=on)
        return eng._live[name]

    for k in ("greedy", "sampled", "penalised"):
        add(k, *GOOD[k])
    for _ in range(3):  # the good ones are decoding
        eng.step()
    bad = {k: add(k, p, kw) for k, (p, kw, fault, when) in BAD.items()}
    for k, (_, _, fault, when) in BAD.items():
        if when == "admitted":
            fault(bad[k])
    planted = set()
    while eng.has_unfinished():
        for k, (_, _, fault, when) in BAD.items():
            if when == "running" and k not in planted and len(bad[k].output_token_ids) >= 2:
                fault(bad[k])
                planted.add(k)
        outs = eng.step()
        if any(o.finish_reason == "error" for o in outs):
            failed_steps.append({o.request_id for o in outs})
        if "late" not in eng._live and "late" not in final and planted:
            add("late", *GOOD["late"])
    assert planted == {k for k, b in BAD.items() if b[3] == "running"}
    for k in BAD:
        assert final[k].finish_reason == "error" and any(e in final[k].error for e in ERRORS[k]), (k, final[k])
    for k in GOOD:
        assert final[k].finish_reason == "length" and final[k].output_token_ids == alone[k], k
    assert eng.stats["failed_requests"] == len(BAD)
    # the faults failed while good requests were in the same steps (their outputs came back with the error)
    assert all(s & set(GOOD) for s in failed_steps)
    assert eng.prefix_cache.num_free == free0 and eng.cache.num_free_slots == eng.cache.num_slots
    assert eng.num_running == 0 and not eng._live


def test_generate_raises_for_a_failed_request(monkeypatch):
    """The offline API does not hand back a failed request's partial output as if it were complete."""
    eng = fake_engine(False)
    real = engine_mod.Sequence

    def planted(rid, prompt, params, on_token, seed):
        seq = real(rid, prompt, params, on_token, seed)
        if params.seed == 99:
            seq.seed = 2**64
        return seq
    monkeypatch.setattr(engine_mod, "Sequence", planted)
    with pytest.raises(RuntimeError, match="request 1 of 2 failed: ValueError: Overflow"):
        eng.generate([[1], [2]], [SamplingParams(max_tokens=3), SamplingParams(temperature=1.0, seed=99, max_tokens=3)])
    assert not eng.has_unfinished()


def test_a_batch_error_nobody_explains_still_fails_the_step():
    """A fault no single row explains (here the forward itself) is not pinned on anybody: step() raises, as
    before, and the server fails the requests in flight (tests/test_server.py checks that side)."""
    eng = fake_engine(False)
    eng.add_request([1, 2], SamplingParams(max_tokens=3))

    def boom(step):
        raise RuntimeError("forward failed")
    eng.runner.forward = boom
    with pytest.raises(RuntimeError, match="forward failed"):
        eng.step()
    assert eng.stats["failed_requests"] == 0


# ---------------------------------------------------------------- server: admission
NAME = "tiny"
MAX_LEN = 256
BODY_LIMIT = 1 << 20  # the fixture's --max-body-bytes: above the 200 KB of a body nested 100 000 deep


def make_engine(**kw):
    return build_engine("tiny-kimi-linear", EngineConfig(max_model_len=MAX_LEN, dtype="fp32", **kw), dummy_weights=True,
                        log=lambda *a, **k: None)


@pytest.fixture(scope="module")
def srv():
    eng, tok = make_engine(max_num_seqs=12)
    app = create_app(eng, tok, NAME, max_body_bytes=BODY_LIMIT)
    with BackgroundServer(app) as s:
        s.engine, s.tok = eng, tok
        yield s


def post(s, path, data, timeout=T):
    if not isinstance(data, (bytes, str)):
        data = json.dumps(data)
    return httpx.post(s.url + path, content=data, headers={"content-type": "application/json"}, timeout=timeout)


PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
BASE = {"completions": '"prompt": "a"', "chat": '"messages": [{"role": "user", "content": "a"}]'}
HUGE = "9" * 5000  # an integer literal past Python's int conversion limit (4300 digits)
TOOLS_JSON = json.dumps([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
# (field, the value as JSON text, other fields as JSON text, endpoints): each must be a 400 naming the field
FIELD_CASES = [
    *[("seed", v, "", "both") for v in (str(2**64), str(-2**63 - 1), HUGE, '"7"', "1.5")],
    ("seed", str(2**63 - 1), '"n": 2, "temperature": 1', "both"),  # seed + 1 overflows
    ("seed", str(2**63 - 15), '"n": 16, "temperature": 1', "both"),
    *[("top_k", v, "", "both") for v in ("-2", str(-2**70), "1.5", '"x"', HUGE)],
    *[(f, v, "", "both") for f in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty")
      for v in ("NaN", "Infinity", "-Infinity", "1e308", "-1e308", "1e400", str(10**400), HUGE, '"1"')],
    ("temperature", "1e7", "", "both"), ("repetition_penalty", "1e-308", "", "both"), ("top_p", "0", "", "both"),
    *[("max_tokens", v, "", "both") for v in (str(2**64), "-1", "1e400", "2.5", HUGE)],
    ("max_completion_tokens", str(2**64), "", "chat"),
    *[("n", v, "", "both") for v in (str(2**64), "0", "17", "-1", HUGE)],
    *[("min_tokens", v, "", "both") for v in (str(2**64), "-1", HUGE)],
    *[("stop_token_ids", v, "", "both") for v in (f"[{2**64}]", "[-1]", f"[{V}]", "[1.5]", "7",
                                                   json.dumps(list(range(MAX_STOP_TOKEN_IDS + 1))))],
    *[("stop", v, "", "both") for v in (json.dumps(["x"] * 17), json.dumps("y" * (MAX_STOP_CHARS + 1)), '[""]', "5")],
    *[("logit_bias", v, "", "both") for v in ('{"1": 1e308}', '{"1": NaN}', '{"%s": 1}' % (2**64), '{"1": %s}' % HUGE)],
    *[("logprobs", v, "", "completions") for v in (str(2**64), "-1", "21", "true", HUGE)],
    *[("top_logprobs", v, '"logprobs": true', "chat") for v in (str(2**64), "-1", "21", HUGE)],
    ("best_of", str(2**64), "", "both"),
    ("echo", '"yes"', "", "completions"),
    *[("prompt", v, "", "completions") for v in (f"[{2**64}]", "[-1]", f"[{HUGE}]", json.dumps([1] * MAX_LEN),
                                                   json.dumps(["a"] * 1000))],
    ("messages", json.dumps([{"role": "user", "content": "a"}] * 500), "", "chat"),
    # tools and constraints (#66 item 5)
    *[("tools", v, "", "chat") for v in ("[]", json.dumps([{"type": "function", "function": {"description": "x"}}]),
                                         '{"name": "f"}')],
    ("tools", TOOLS_JSON, "", "completions"),
    *[("tool_choice", v, f'"tools": {TOOLS_JSON}', "chat")
      for v in ('{"type": "function", "function": {"name": "nope"}}', '"sometimes"',
                '"auto"')],  # auto: this server runs no --tool-call-parser
    ("tool_choice", '"required"', "", "chat"),  # no tools to choose
    ("parallel_tool_calls", '"no"', f'"tools": {TOOLS_JSON}, "tool_choice": "none"', "chat"),
    *[("messages", json.dumps([{"role": "user", "content": "a"}, m]), "", "chat") for m in (
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f",
                                                                                              "arguments": "{}"}}]},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": 1}}]},
        {"role": "tool", "content": "result without its call id"})],
    ("response_format", '{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}', "",
     "both"),
    ("response_format", '{"type": "json_schema", "json_schema": {"name": "x"}}', "", "both"),
    *[("structured_outputs", v, "", "both") for v in ('{"regex": "([a-"}', '{"grammar": "root ::= "}',
                                                      '{"choice": []}', '{"json": "{", "regex": "a"}')],
    ("guided_json", '{"type": "object"}', "", "both"),
]
CASES = [(ep, *c[:3]) for c in FIELD_CASES for ep in (("completions", "chat") if c[3] == "both" else (c[3],))]


def good_request(s, i: int):
    """A seeded sampled request whose answer is known (the same request run alone, memoised per i)."""
    body = {"model": NAME, "prompt": f"good {i}", "max_tokens": 6, "temperature": 0.8, "seed": i, "ignore_eos": True}
    return post(s, "/v1/completions", body)


@pytest.fixture(scope="module")
def good_alone(srv):
    r = good_request(srv, 0)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("endpoint,field,value,extra", CASES, ids=[f"{c[0]}-{c[1]}-{c[2][:12]}" for c in CASES])
def test_bad_field_is_a_400_naming_it(srv, good_alone, endpoint, field, value, extra):
    parts = [f'"model": "{NAME}"', f'"{field}": {value}']  # JSON text: NaN, 1e400 and 5000-digit literals as sent
    parts += [] if field in ("prompt", "messages") else [BASE[endpoint]]
    parts += [] if field in ("max_tokens", "max_completion_tokens") else ['"max_tokens": 2']
    parts += [extra] if extra else []
    body = "{" + ", ".join(parts) + "}"
    with ThreadPoolExecutor(2) as ex:
        good = ex.submit(good_request, srv, 0)
        r = post(srv, PATHS[endpoint], body)
        g = good.result(timeout=T)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"] and err["param"] == field and err["type"] == "invalid_request_error", err
    assert g.status_code == 200 and g.json()["choices"][0]["text"] == good_alone


@pytest.mark.parametrize("kw", [{"seed": 2**63 - 1}, {"seed": -2**63}, {"seed": 2**63 - 2, "n": 2},
                                {"top_k": 2**63}, {"top_k": 10**400}, {"temperature": 1e-308}, {"temperature": 1e-6},
                                {"min_p": 1e-308}, {"top_p": 1e-300}])
def test_edge_values_that_are_valid_answer(srv, kw):
    """The edges of the ranges are served: the largest and smallest seeds (seed + n - 1 inside int64), a top_k
    past the vocabulary (every token: as top_k off, the same answer), a temperature below 1e-5 (greedy, as
    vLLM takes it), min_p and top_p too small for FP32."""
    body = {"model": NAME, "prompt": "edge", "max_tokens": 4, "temperature": 0.9, "seed": 3, "ignore_eos": True, **kw}
    r = post(srv, "/v1/completions", body)
    assert r.status_code == 200, r.text
    if "top_k" in kw:
        off = post(srv, "/v1/completions", {**body, "top_k": 0}).json()
        assert r.json()["choices"][0]["text"] == off["choices"][0]["text"]
    if kw.get("temperature", 1) < 1e-5:
        greedy = post(srv, "/v1/completions", {**body, "temperature": 0}).json()
        assert r.json()["choices"][0]["text"] == greedy["choices"][0]["text"]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_deep_and_huge_bodies(srv, endpoint):
    """A body nested 100 000 deep is a 400 (the parser's limit, not a 500); one nested a few hundred deep in a
    field the server ignores is served (its Unicode check walks without recursion); a body over
    --max-body-bytes is a 413, with or without a Content-Length; the server answers after each."""
    deep = "[" * 100_000 + "]" * 100_000
    for raw in ('{"model": "%s", %s, "metadata": %s}' % (NAME, BASE[endpoint], deep), deep):
        r = post(srv, PATHS[endpoint], raw)
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text
    ok = '{"model": "%s", %s, "max_tokens": 1, "metadata": %s}' % (NAME, BASE[endpoint], "[" * 300 + "]" * 300)
    assert post(srv, PATHS[endpoint], ok).status_code == 200
    big = '{"model": "%s", %s, "user": "%s"}' % (NAME, BASE[endpoint], "x" * BODY_LIMIT)
    r = post(srv, PATHS[endpoint], big)
    assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"], r.text

    def chunks():  # no Content-Length: chunked transfer
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)].encode()
    r = httpx.post(srv.url + PATHS[endpoint], content=chunks(), timeout=T, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert httpx.get(srv.url + "/health", timeout=T).status_code == 200
    assert good_request(srv, 1).status_code == 200


# ---------------------------------------------------------------- server: isolation
MARK_STOP = "\x01fault"  # a request with this stop string gets a stop matcher that raises (planted)
MARK_SEED = 4242         # a request (choice) with this seed gets a sequence seed past int64 (planted)


class FaultyText(TextState):
    def add(self, tok, may_stop=True):
        if MARK_STOP in self.stops:
            raise RuntimeError("injected stop-matching fault")
        return super().add(tok, may_stop)


class FaultySequence(Sequence):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        if self.params.seed in (MARK_SEED, MARK_SEED + 1):
            self.seed = 2**64


GOOD_HTTP = [  # (endpoint, body, stream): greedy and seeded sampling, completions and chat
    ("completions", {"prompt": "alpha", "max_tokens": 100, "temperature": 0, "ignore_eos": True}, False),
    ("completions", {"prompt": "beta", "max_tokens": 100, "temperature": 0.9, "seed": 8, "ignore_eos": True}, True),
    ("chat", {"messages": [{"role": "user", "content": "gamma"}], "max_tokens": 100, "temperature": 0,
              "ignore_eos": True}, True),
    ("chat", {"messages": [{"role": "user", "content": "delta"}], "max_tokens": 100, "temperature": 0.7, "top_k": 30,
              "seed": 9, "ignore_eos": True}, False),
    # a constrained row and a biased one in the same batch (#66)
    ("completions", {"prompt": "eta", "max_tokens": 60, "temperature": 0, "structured_outputs": {"regex": "[a-z ]{0,200}"},
                     "ignore_eos": True}, True),
    ("chat", {"messages": [{"role": "user", "content": "theta"}], "max_tokens": 60, "temperature": 0.8, "seed": 4,
              "logit_bias": {"97": 8, "98": -100}, "ignore_eos": True}, False),
]
BAD_HTTP = [
    ("completions", {"prompt": "bad one", "max_tokens": 8, "stop": [MARK_STOP]}, False, "stop-matching"),
    ("chat", {"messages": [{"role": "user", "content": "bad two"}], "max_tokens": 8, "temperature": 1,
              "seed": MARK_SEED}, True, "Overflow"),
    ("completions", {"prompt": "bad three", "max_tokens": 8, "temperature": 1, "seed": MARK_SEED, "n": 2}, False,
     "Overflow"),
    ("chat", {"messages": [{"role": "user", "content": "bad four"}], "max_tokens": 8, "stop": [MARK_STOP]}, False,
     "stop-matching"),
]


def ask(s, endpoint, body, stream):
    """-> (status, the answer's text or the error message)."""
    body = {"model": NAME, **body, "stream": stream}
    if not stream:
        r = post(s, PATHS[endpoint], body)
        j = r.json()
        if r.status_code != 200:
            return r.status_code, j["error"]["message"]
        c = j["choices"][0]
        return 200, c["text"] if endpoint == "completions" else c["message"]["content"]
    text = []
    with httpx.stream("POST", s.url + PATHS[endpoint], json=body, timeout=T) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            j = json.loads(line[6:])
            if "error" in j:
                return 500, j["error"]["message"]
            for c in j["choices"]:
                text.append(c["text"] if endpoint == "completions" else (c["delta"].get("content") or ""))
    return r.status_code, "".join(text)


def test_injected_faults_fail_only_their_requests(srv, monkeypatch):
    """Good requests (greedy and seeded sampling, completions and chat, streamed and not) are running when bad
    ones arrive whose faults are planted after validation (a stop matcher that raises, a sequence seed past
    int64: see the module docstring). Each bad request gets a 500 naming its fault (n = 2: the whole request);
    each good one gets exactly its answer alone; the server keeps serving."""
    alone = [ask(srv, ep, b, st) for ep, b, st in GOOD_HTTP]
    assert all(code == 200 for code, _ in alone)
    eng = srv.engine
    monkeypatch.setattr(engine_mod, "TextState", FaultyText)
    monkeypatch.setattr(engine_mod, "Sequence", FaultySequence)
    seen = []  # the requests running beside each failure
    real_fail = eng._fail

    def fail(seq, exc):
        seen.append({s.request_id for s in eng.scheduler.running} - {seq.request_id})
        return real_fail(seq, exc)
    monkeypatch.setattr(eng, "_fail", fail)
    failed0 = eng.stats["failed_requests"]
    with ThreadPoolExecutor(len(GOOD_HTTP) + len(BAD_HTTP)) as ex:
        goods = [ex.submit(ask, srv, ep, b, st) for ep, b, st in GOOD_HTTP]
        deadline = time.time() + T  # every good request decoding before the bad ones arrive
        while sum(len(q.output_token_ids) > 0 for q in list(eng.scheduler.running)) < len(GOOD_HTTP):
            assert time.time() < deadline
            time.sleep(0.001)
        bads = [ex.submit(ask, srv, ep, b, st) for ep, b, st, _ in BAD_HTTP]
        got_bad = [b.result(timeout=T) for b in bads]
        got_good = [g.result(timeout=T) for g in goods]
    for (code, msg), (_, _, _, why) in zip(got_bad, BAD_HTTP):
        assert code == 500 and "request failed in the engine" in msg and why in msg, msg
    assert got_good == alone
    assert eng.stats["failed_requests"] - failed0 == 5  # n = 2 counts two
    assert seen and all(seen)  # every failure happened beside running requests
    monkeypatch.undo()
    deadline = time.time() + T
    while eng.has_unfinished() and time.time() < deadline:
        time.sleep(0.05)
    assert eng.num_running == 0 and eng.cache.num_free_slots == eng.cache.num_slots
    assert httpx.get(srv.url + "/health", timeout=T).status_code == 200
    assert ask(srv, *GOOD_HTTP[0][:2], False) == alone[0]
