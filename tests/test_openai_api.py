"""The OpenAI features clients rely on, driven through the official `openai` client against the
trained peregrine-tiny (its answers are known: `copy:abc77def|` -> `abc77def`, `12+30=` -> `42`):
stop strings across token boundaries (streamed and not), logprobs / top_logprobs (completions and
chat) against the independent FP64 reference forward, n > 1 against separately seeded runs of a
second engine, echo with max_tokens 0 (lm-eval's loglikelihood request), min_tokens, penalties.
"""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

from peregrine.config import EngineConfig
from peregrine.engine import SamplingParams
from peregrine.engine.build import build_engine
from peregrine.server import BackgroundServer, create_app

pytestmark = pytest.mark.gpu  # device-agnostic: the GPU pass runs it on CUDA
MODEL = "peregrine-tiny"
NAME = "tiny"
EOS = 257
T = 60  # seconds: bound on any request
quiet = lambda *a, **k: None  # noqa: E731


def make_engine():
    return build_engine(MODEL, EngineConfig(max_model_len=256, max_num_seqs=8, dtype="fp32"), log=quiet)


@pytest.fixture(scope="module")
def srv():
    eng, tok = make_engine()
    with BackgroundServer(create_app(eng, tok, NAME)) as s:
        s.engine, s.tok = eng, tok
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=T)
        yield s


@pytest.fixture(scope="module")
def ref():
    """A second engine (same weights, no HTTP) and the FP64 reference log-probabilities of a sequence."""
    from reference import reference_forward
    eng, tok = make_engine()
    W = {n: v.reshape(s).clone() for n, v, s in eng.model.hf_params()}
    eng.logprobs = lambda ids: torch.log_softmax(reference_forward(W, eng.model_cfg, ids), -1)  # [T, V]
    return eng


def greedy(srv, prompt, **kw):
    return srv.client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=kw.pop("max_tokens", 16),
                                         **kw)


# ---------------------------------------------------------------- stop strings
def test_the_model_knows_the_answers(srv):
    assert greedy(srv, "copy:abc77def|").choices[0].text == "abc77def"
    assert greedy(srv, "12+30=").choices[0].text == "42"


@pytest.mark.parametrize("stop,want,n_tok", [(["77"], "abc", 5), ("77", "abc", 5), (["c7", "zz"], "ab", 4),
                                             (["def", "7d"], "abc7", 6)])
def test_stop_strings_across_tokens(srv, stop, want, n_tok):
    """Byte-level tokens: every stop string here spans two or three tokens."""
    r = greedy(srv, "copy:abc77def|", stop=stop, extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert (c.text, c.finish_reason, r.usage.completion_tokens) == (want, "stop", n_tok)
    assert c.token_ids == list(b"abc77def"[:n_tok])
    chunks = list(srv.client.completions.create(model=NAME, prompt="copy:abc77def|", temperature=0, max_tokens=16,
                                                stop=stop, stream=True))
    texts = [ch.choices[0].text for ch in chunks]
    assert "".join(texts) == want and chunks[-1].choices[0].finish_reason == "stop"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])
    sent = ""
    for t in texts:  # the start of a stop string is held back: nothing past `want` is ever sent
        sent += t
        assert want.startswith(sent)


def test_stop_in_chat_stream(srv):
    msgs = [{"role": "user", "content": "hi"}]
    full = srv.client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})
    text = full.choices[0].message.content
    stop = text[3:5]  # two byte tokens of whatever the model says here
    want = text[:text.find(stop)]
    r = srv.client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0, stop=[stop],
                                           extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    st = list(srv.client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0, stop=[stop],
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in st) == want


# ---------------------------------------------------------------- logprobs
def test_completion_logprobs(srv, ref):
    prompt = "12+30="
    r = greedy(srv, prompt, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "42" and lp.tokens == ["4", "2", f"<{EOS}>"] and lp.text_offset == [0, 1, 2]
    ids = list(prompt.encode()) + [ord("4"), ord("2"), EOS]
    want = ref.logprobs(ids)
    P = len(prompt)
    for j, (tok, v, top) in enumerate(zip(ids[P:], lp.token_logprobs, lp.top_logprobs)):
        row = want[P - 1 + j]
        assert v == pytest.approx(row[tok].item(), abs=1e-4)
        vals, idx = row.topk(2)
        assert list(top) == [srv.tok.decode([i]) for i in idx.tolist()]
        assert list(top.values()) == pytest.approx(vals.tolist(), abs=1e-4)


def test_chat_logprobs(srv, ref):
    msgs = [{"role": "user", "content": "12+30="}]
    r = srv.client.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                           top_logprobs=3, extra_body={"return_token_ids": True})
    c = r.choices[0]
    content = c.logprobs.content
    assert len(content) == r.usage.completion_tokens == len(c.token_ids)
    prompt_ids = list("<|user|>\n12+30=\n<|assistant|>\n".encode())  # the documented simple template
    want = ref.logprobs(prompt_ids + c.token_ids)
    for j, (e, t) in enumerate(zip(content, c.token_ids)):
        assert e.bytes == list(srv.tok.token_bytes(t)) and len(e.top_logprobs) == 3
        assert e.logprob == pytest.approx(want[len(prompt_ids) - 1 + j, t].item(), abs=1e-4)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        srv.client.chat.completions.create(model=NAME, messages=msgs, max_tokens=2, top_logprobs=2)


def test_echo_with_max_tokens_zero_is_lm_evals_loglikelihood(srv, ref):
    """lm-eval's request: echo, max_tokens 0, logprobs 1, temperature 0; it reads token_logprobs of the
    continuation and checks is_greedy against top_logprobs."""
    prompt = "12+30=42"
    r = srv.client.completions.create(model=NAME, prompt=prompt, echo=True, max_tokens=0, logprobs=1, temperature=0)
    c = r.choices[0]
    assert (c.text, c.finish_reason, r.usage.completion_tokens, r.usage.prompt_tokens) == (prompt, "length", 0, 8)
    lp = c.logprobs
    assert lp.tokens == list(prompt) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = ref.logprobs(list(prompt.encode()))
    for p in range(1, len(prompt)):
        assert lp.token_logprobs[p] == pytest.approx(want[p - 1, ord(prompt[p])].item(), abs=1e-4)
        assert len(lp.top_logprobs[p]) == 1
    # the trained model is sure of "42" after "12+30=": both continuation tokens are its greedy choice
    assert all(lp.token_logprobs[p] == max(lp.top_logprobs[p].values()) for p in (6, 7))
    assert lp.token_logprobs[1] < max(lp.top_logprobs[1].values())  # "2" after "1" is a guess
    # echo with tokens generated: the prompt's entries, then the answer's; streamed the same
    r2 = srv.client.completions.create(model=NAME, prompt="12+30=", echo=True, max_tokens=3, logprobs=0, temperature=0)
    assert r2.choices[0].text == "12+30=42" and r2.choices[0].logprobs.tokens == list("12+30=42") + [f"<{EOS}>"]
    chunks = list(srv.client.completions.create(model=NAME, prompt="12+30=", echo=True, max_tokens=3, logprobs=0,
                                                temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == "12+30=42"
    assert sum(len(ch.choices[0].logprobs.tokens) for ch in chunks) == 9
    z = list(srv.client.completions.create(model=NAME, prompt=prompt, echo=True, max_tokens=0, stream=True))
    assert [ch.choices[0].text for ch in z] == [prompt] and z[0].choices[0].finish_reason == "length"


# ---------------------------------------------------------------- n, min_tokens, penalties
def test_n_choices_are_independently_seeded_runs(srv, ref):
    prompt = "kv:"  # an unfinished problem: the model is unsure what comes next
    ids = list(prompt.encode())
    r = srv.client.completions.create(model=NAME, prompt=prompt, n=3, temperature=1.0, seed=11, max_tokens=8,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, c in enumerate(r.choices):
        assert c.token_ids == ref.generate([ids], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8,
                                                                 ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in r.choices}) > 1  # sampled: the choices differ
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(ids)
    chunks = list(srv.client.completions.create(model=NAME, prompt=prompt, n=3, temperature=1.0, seed=11, max_tokens=8,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
    for i, c in enumerate(r.choices):
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) == c.text
    assert chunks[-1].usage.completion_tokens == 24
    g = srv.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], n=2, max_tokens=3,
                                           temperature=0)
    assert [c.index for c in g.choices] == [0, 1] and g.choices[0].message.content == g.choices[1].message.content


def test_min_tokens_and_penalties(srv, ref):
    ids = list(b"12+30=")
    r = greedy(srv, "12+30=", max_tokens=8, extra_body={"min_tokens": 4, "return_token_ids": True})
    toks = r.choices[0].token_ids
    assert toks[:2] == list(b"42") and EOS not in toks[:4] and len(toks) >= 5
    assert toks == ref.generate([ids], SamplingParams(max_tokens=8, min_tokens=4))[0]
    kw = dict(presence_penalty=1.5, frequency_penalty=0.5)
    p = greedy(srv, "copy:aaaaaaaa|", max_tokens=10, extra_body={"return_token_ids": True}, **kw)
    assert p.choices[0].token_ids == ref.generate([list(b"copy:aaaaaaaa|")], SamplingParams(max_tokens=10, **kw))[0]
    assert p.choices[0].text != greedy(srv, "copy:aaaaaaaa|", max_tokens=10).choices[0].text


def test_lone_surrogate_is_a_clear_400(srv):
    """The openai client cannot even send one (it encodes UTF-8); other clients send the JSON escape."""
    for path, body in (("/v1/completions", b'{"model": "tiny", "prompt": "ab\\ud800"}'),
                       ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}')):
        r = httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"}, timeout=T)
        assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"], r.text
    assert greedy(srv, "12+30=").choices[0].text == "42"  # and the server goes on


# ---------------------------------------------------------------- a Kimi-layout folder, served
def test_serve_a_kimi_layout_folder(tmp_path):
    """`peregrine serve --model DIR` on the published folder layout (config.json, model.safetensors,
    tiktoken.model, tokenizer_config.json with the chat template, generation_config.json), dummy
    weights at tiny size: the chat prompt is the template's text through Kimi's tokenizer, the
    answer stops at generation_config's end ids and comes back as that tokenizer's text."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    from conftest import write_dummy_model
    from kimi_files import ranks, reference_encode, vocab_size, write_tokenizer
    from peregrine.config import PRESET_DIR
    from peregrine.kimi_tokenizer import KIMI_PAT_STR, KimiTokenizer

    raw = json.loads((PRESET_DIR / "tiny-kimi-linear.json").read_text())
    n = len(ranks())
    raw.update(vocab_size=vocab_size(), bos_token_id=n, eos_token_id=n + 2, pad_token_id=n + 255)
    write_dummy_model(tmp_path, raw, seed=5)
    specials = write_tokenizer(tmp_path, generation_eos=[n + 2, n + 1])
    tok = KimiTokenizer(tmp_path, vocab_size())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "peregrine.server", "serve", "--model", str(tmp_path), "--port",
                             str(port), "--max-model-len", "128", "--dtype", "fp32", "--served-model-name", "kimi"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.time() + 2 * T
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.time() < deadline, "server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=T)
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world, 中文!"}]
        r = client.chat.completions.create(model="kimi", messages=msgs, max_tokens=8, temperature=0,
                                           extra_body={"return_token_ids": True})
        rendered = ("<|im_system|>system<|im_middle|>be brief<|im_end|><|im_user|>user<|im_middle|>hello world, 中文!"
                    "<|im_end|><|im_assistant|>assistant<|im_middle|>")
        assert r.usage.prompt_tokens == len(reference_encode(rendered, KIMI_PAT_STR, dict(tok.special_tokens)))
        c = r.choices[0]
        ends = {specials["<|im_end|>"], specials["[EOS]"]}
        cut = next((i for i, t in enumerate(c.token_ids) if t in ends), None)
        assert c.finish_reason == ("length" if cut is None else "stop")
        assert c.message.content == tok.decode(c.token_ids if cut is None else c.token_ids[:cut])
        assert cut is None or cut == len(c.token_ids) - 1  # it stopped at the first end id
        done = client.completions.create(model="kimi", prompt="hello", max_tokens=4, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
        assert done.choices[0].text == tok.decode(done.choices[0].token_ids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=T) == 0
        log = proc.stdout.read().decode()
        assert "tokenizer: tiktoken" in log and "chat template: model (tokenizer_config.json)" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_generation_config_sampling_defaults():
    """generation_config.json's temperature / top_p / top_k apply to requests that set none; a request's own
    values win; without the file OpenAI's defaults hold."""
    from peregrine.generation_config import GenerationConfig
    from peregrine.server.protocol import DEFAULT_TEMPERATURE, parse_common
    gen = GenerationConfig(temperature=0.6, top_p=0.9, top_k=20)
    parse = lambda body, d: parse_common({"model": NAME, "prompt": "a", **body}, NAME, 64, 320,  # noqa: E731
                                         lambda b: [97], lambda n: 4, defaults=d).params
    p = parse({}, gen)
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.9, 20)
    p = parse({"temperature": 0, "top_p": 1.0, "top_k": -1}, gen)
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 1.0, 0)
    p = parse({}, None)
    assert (p.temperature, p.top_p, p.top_k) == (DEFAULT_TEMPERATURE, 1.0, 0)


# ---------------------------------------------------------------- chat on the embedded model
@pytest.fixture(scope="module")
def chat_srv():
    """The server as `peregrine serve --model peregrine-tiny` builds it: the preset folder's chat template."""
    from peregrine.config import resolve_model
    from peregrine.server.chat import ChatTemplate
    eng, tok = make_engine()
    with BackgroundServer(create_app(eng, tok, NAME, chat_template=ChatTemplate(resolve_model(MODEL)[1]))) as s:
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=T)
        yield s


def chat(srv, messages, **kw):
    r = srv.client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=32, **kw)
    return r.choices[0].message.content


def test_readme_chat_example(chat_srv):
    assert chat(chat_srv, [{"role": "user", "content": "rev:peregrine|"}]) == "enirgerep"


def test_chat_answers_equal_raw_completions(chat_srv):
    """Each task as a chat message, after a system prompt and an earlier turn, gets the raw prompt's answer,
    and that answer is the task's (independent: tasks.py computes it)."""
    from peregrine.train import tasks
    for t in ("add", "copy", "reverse"):
        for p in tasks.generate(t, 6, 7):
            msgs = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "copy:zz|"}, {"role": "assistant", "content": "zz"},
                    {"role": "user", "content": p.prompt}]
            raw = chat_srv.client.completions.create(model=NAME, prompt=p.prompt, temperature=0, max_tokens=32)
            assert chat(chat_srv, msgs) == raw.choices[0].text
            if t != "add":  # additions: the model's own accuracy is 97.6 %, copy and reverse are exact here
                assert raw.choices[0].text == p.answer


def test_chat_without_a_user_message_is_a_clear_400(chat_srv):
    with pytest.raises(openai.BadRequestError, match="needs a user message"):
        chat(chat_srv, [{"role": "system", "content": "hello"}])
