"""The offline API (peregrine/llm.py, vLLM's `LLM`): the server's answers for the same prompts and seeds (text and token
ids, n > 1 choices, chat through the model's template), vLLM's SamplingParams defaults, both decode paths, structured
output, and a bad request a ValueError naming its field with nothing left running."""
from __future__ import annotations

import json

import openai
import pytest

from conftest import dummy_model_dir
from peregrine import LLM, SamplingParams, StructuredOutputsParams
from peregrine.config import PRESET_DIR
from peregrine.server import BackgroundServer, create_app

NAME = "tiny"
PROMPTS = ["rev:falcon|", "12+30=", "copy:agent7|"]


@pytest.fixture(scope="module")
def llm():
    return LLM("peregrine-tiny", quiet=True, max_model_len=256, max_num_seqs=8, dtype="fp32")


@pytest.fixture(scope="module")
def server():
    """The same model served (its own engine: the two answer independently)."""
    other = LLM("peregrine-tiny", quiet=True, max_model_len=256, max_num_seqs=8, dtype="fp32")
    with BackgroundServer(create_app(other.engine, other.tokenizer, NAME, chat_template=other._template())) as s:
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        yield s


def test_vllms_sampling_defaults():
    """vLLM's documented defaults (a temperature of 1: sampling unless asked otherwise)."""
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.max_tokens, sp.seed, sp.stop, sp.ignore_eos,
            sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.logprobs) == \
        (1, 1.0, 1.0, 0, 0.0, 16, None, None, False, 0.0, 0.0, 1.0, None)


def test_generate_answers_what_the_server_answers(llm, server):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for p, out in zip(PROMPTS, greedy):
        r = server.client.completions.create(model=NAME, prompt=p, temperature=0, max_tokens=12,
                                             extra_body={"return_token_ids": True})
        assert out.prompt == p and out.outputs[0].text == r.choices[0].text
        assert out.outputs[0].token_ids == r.choices[0].token_ids and out.outputs[0].finish_reason == r.choices[0].finish_reason
    assert [o.outputs[0].text for o in greedy[:2]] == ["noclaf", "42"]  # the tiny model's tasks (README)
    sampled = llm.generate("copy:agent7|", SamplingParams(temperature=1.3, seed=11, n=3, max_tokens=10), use_tqdm=False)
    r = server.client.completions.create(model=NAME, prompt="copy:agent7|", temperature=1.3, seed=11, n=3, max_tokens=10)
    assert sorted(c.text for c in sampled[0].outputs) == sorted(c.text for c in r.choices)
    ids = llm.tokenizer.encode("rev:falcon|")
    assert llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0), use_tqdm=False)[0].outputs[0].text == "noclaf"


def test_chat_renders_with_the_template_as_the_server_does(llm, server):
    msgs = [{"role": "user", "content": "12+30="}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    r = server.client.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=8)
    assert out.text == r.choices[0].message.content == "42"
    two = llm.chat([msgs, [{"role": "user", "content": "rev:abc|"}]], SamplingParams(temperature=0), use_tqdm=False)
    assert [o.outputs[0].text for o in two] == ["42", "cba"]


def test_structured_output_and_a_bad_request(llm):
    out = llm.generate("12+30=", SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"])), use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no")
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(PROMPTS, [SamplingParams(temperature=0), SamplingParams(top_p=7.0), SamplingParams()], use_tqdm=False)
    assert not llm.engine.has_unfinished()  # the batch's accepted requests were withdrawn
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate("x", SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]}), use_tqdm=False)
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM("peregrine-tiny", quiet=True, max_model_length=5)


def test_both_decode_paths_give_the_same_tokens(tmp_path_factory):
    from test_specialized import MICRO
    raw = json.loads((PRESET_DIR / "tiny-kimi-linear.json").read_text())
    raw.update(MICRO)
    d = dummy_model_dir(tmp_path_factory, raw, "llm", seed=2)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9]]
    std = LLM(d, quiet=True, max_model_len=128).generate(prompts, sp, use_tqdm=False)
    fast = LLM(d, quiet=True, max_model_len=128, additional_config={"decode_backend": "latency_specialized"})
    got = fast.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in std]
    assert fast.engine.stats["steps_by_path"]["latency_specialized"] > 0
