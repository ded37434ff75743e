"""Tool calling, reasoning and structured output (#66 items 1, 2, 5).

- Prompts: conversations with tools, tool calls (content null or text), tool results and reasoning, rendered by
  peregrine and by the reference: transformers' apply_chat_template on the same Jinja template (Kimi-Linear's,
  Kimi-K2-Thinking's: tests/fixtures), and for Kimi K3, which ships its format as a Python program, that program
  (its renderings kept as golden data, tests/fixtures/k3_prompts.json), segment for segment and token for token.
- Answers: kimi_k2 / kimi_k3 tool-call sections, K3's think channel, a named function's and "required" JSON, parsed
  into hand-written expected messages; streamed, split at every point, the joined deltas equal the whole message,
  and no marker is ever shown; malformed output comes back as content.
- Requests: tools / tool_choice / parallel_tool_calls / response_format / structured_outputs / logit_bias checked
  (a 400 naming the field), the guided JSON schemas of "required" and a named function as vLLM builds them.
- Served: a Kimi-format model (dummy weights) whose replies are scripted (the engine's forced tokens, planted by the
  test) through the HTTP server and the openai client, streamed and not.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import httpx
import openai
import pytest

from kimi_files import K3_SPECIALS, SPECIALS, TOOL_SPECIALS, ranks, reference_encode, vocab_size, write_tokenizer
from peregrine.server import chat as chat_mod
from peregrine.server import reply as R
from peregrine.server.chat import ChatTemplate
from peregrine.server.protocol import APIError

FIX = Path(__file__).parent / "fixtures"
NO_SPECIALS = {"\x00no special token\x00": -1}  # the reference BPE's split needs one; it never occurs
T = 60  # seconds: bound on any request

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string", "description": "City name"},
                                      "unit": {"type": "string", "enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "now", "description": "The time, ünicode «ok»"}},
]
CALL_A = {"id": "functions.get_weather:0", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
CALL_B = {"id": "functions.now:1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
CONVERSATIONS = {
    "tools, first turn": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}],
    "calls and results": [
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL_A, CALL_B]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "functions.now:1", "content": "12:00"},
        {"role": "assistant", "content": "21 °C at noon."},
        {"role": "user", "content": "Thanks!"}],
    "text, reasoning and a call": [
        {"role": "user", "name": "ann", "content": "Paris?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "the user wants weather",
         "tool_calls": [CALL_A]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}],
    "no tools": [{"role": "user", "content": "hi <|im_end|> there"}],
}


# ---------------------------------------------------------------- prompts: Jinja templates against transformers
def _hf_tokenizer(template: str):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                                  bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]", pad_token="[PAD]")
    tok.chat_template = template
    return tok


def _folder(tmp_path, template: str) -> Path:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]",
         "chat_template": template}))
    return tmp_path


@pytest.mark.parametrize("template", ["kimi_linear.jinja", "kimi_k2_thinking.jinja"])
@pytest.mark.parametrize("conv", list(CONVERSATIONS))
def test_jinja_prompt_equals_transformers(tmp_path, template, conv):
    text = (FIX / template).read_text()
    msgs = CONVERSATIONS[conv]
    tools = None if conv == "no tools" else TOOLS
    want = _hf_tokenizer(text).apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    got = ChatTemplate(_folder(tmp_path, text)).render(msgs, tools)
    assert got == want
    if tools:  # the tools are there, as the template declares them
        assert "<|im_system|>tool_declare<|im_middle|>" in got and '"name":"get_weather"' in got.replace(" ", "")


def test_template_kwargs_reach_the_template_as_in_transformers(tmp_path):
    """chat_template_kwargs (and reasoning_effort's enable_thinking) are template variables, as vLLM passes them."""
    text = "{{ bos_token }}{% if enable_thinking %}T{% endif %}{{ flavour }}{% for m in messages %}{{ m.content }}{% endfor %}"
    msgs = [{"role": "user", "content": "x"}]
    want = _hf_tokenizer(text).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                                   enable_thinking=True, flavour="mint", reasoning_effort="low")
    kw, _ = chat_mod.template_kwargs({"chat_template_kwargs": {"flavour": "mint"}, "reasoning_effort": "low"}, False,
                                     None)
    assert ChatTemplate(_folder(tmp_path, text)).render(msgs, **kw) == want == "[BOS]Tmintx"


# ---------------------------------------------------------------- prompts: Kimi K3 against its encoder
@functools.cache
def _k3_reference() -> dict:
    """K3's own renderings of K3_CONVERSATIONS under each K3_OPTIONS, as (text, special) segments: golden data taken
    once from the model's reference encoder (moonshotai/Kimi-K3's encoding_k3.py; K3 ships its chat format as that
    program, not a Jinja template), keyed "conversation | options" (fixtures/README.md)."""
    return {k: [tuple(s) for s in v] for k, v in json.loads((FIX / "k3_prompts.json").read_text()).items()}


K3_CONVERSATIONS = {
    **CONVERSATIONS,
    "results out of order, args not JSON": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "ok", "reasoning": "two calls",
         "tool_calls": [CALL_A, {**CALL_B, "function": {"name": "now", "arguments": "not json"}},
                        {"id": "c3", "type": "function", "function": {"name": "now", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c3", "content": "third"},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "first", "name": "stale"},
        {"role": "tool", "tool_call_id": "functions.now:1", "content": "second"},
        {"role": "user", "content": 'typed: "q" & <|open|>'}],
    "unmatched result named by order": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {**CALL_A, "function": {"name": "get_weather", "arguments":
                                    '{"city": "Oslo", "n": 2, "ok": true, "x": null, "l": [1, "a"], "o": {"k": 1}}'}}]},
        {"role": "tool", "tool_call_id": "elsewhere", "content": "cold"}],
}
K3_OPTIONS = {
    "thinking": {},
    "no thinking": {"thinking": False},
    "effort high, tool_choice required": {"thinking_effort": "high", "tool_choice": "required"},
    "tool_choice none, json_object": {"tool_choice": "none", "response_format": {"type": "json_object"}},
    "json_schema": {"thinking": False, "response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}}}},
}


@pytest.mark.parametrize("opts", list(K3_OPTIONS))
@pytest.mark.parametrize("conv", list(K3_CONVERSATIONS))
def test_k3_prompt_equals_its_encoder(conv, opts):
    msgs = K3_CONVERSATIONS[conv]
    tools = None if conv == "no tools" else TOOLS
    kw = K3_OPTIONS[opts]
    want = _k3_reference()[f"{conv} | {opts}"]
    t = ChatTemplate(model_type="kimi_k3")
    t.k3 = True
    got = list(t._k3_segments(chat_mod.normalize_messages(msgs), tools, kw))
    assert got == want
    assert t.render(msgs, tools, **kw) == "".join(s for s, _ in want)


def test_k3_prompt_ids_keep_markup_special_and_text_ordinary(tmp_path):
    """Control segments are their special ids; text segments are encoded alone as ordinary text, so a marker a
    user writes stays text, and token boundaries fall where the segments end (independent BPE reference)."""
    from peregrine.kimi_tokenizer import KIMI_PAT_STR, KimiTokenizer
    specials = write_tokenizer(tmp_path, template=False, specials=K3_SPECIALS)
    tok = KimiTokenizer(tmp_path, vocab_size())
    msgs = K3_CONVERSATIONS["results out of order, args not JSON"]
    segs = _k3_reference()["results out of order, args not JSON | thinking"]
    want = []
    for text, special in segs:
        want += [specials[text]] if special else reference_encode(text, KIMI_PAT_STR, NO_SPECIALS)
    t = ChatTemplate(tmp_path, model_type="kimi_k3")
    assert t.k3 and t.prompt_ids(tok, msgs, TOOLS) == want
    assert want.count(specials["<|open|>"]) == sum(text == "<|open|>" for text, _ in segs)  # the user's one is text


def test_k3_is_chosen_by_the_model_type(tmp_path):
    write_tokenizer(tmp_path, specials=K3_SPECIALS)  # a Jinja template in tokenizer_config: K3 does not use it
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))
    assert ChatTemplate(tmp_path).k3
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_linear"}))
    assert not ChatTemplate(tmp_path).k3


# ---------------------------------------------------------------- answers: parsers
K2_OUT = ('Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
          '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|> functions.now:1 <|tool_call_argument_begin|> {} '
          '<|tool_call_end|><|tool_calls_section_end|>')
K3_OUT = ('The user wants weather.<|close|>think<|sep|><|open|>response<|sep|>Sure.<|close|>response<|sep|>'
          '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
          '<|open|>argument key="city" type="string"<|sep|>Paris "15e"<|close|>argument<|sep|>'
          '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
          '<|open|>argument key="opts" type="object"<|sep|>{"a": [1, null]}<|close|>argument<|sep|><|close|>call<|sep|>'
          '<|open|>call tool="a&amp;&quot;b" index="2"<|sep|><|open|>json type="object"<|sep|>{"q": "x"}'
          '<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>')


def _ids():
    n = iter(range(100))
    return lambda: f"call-{next(n)}"


def msg(content, calls=(), reasoning=None):
    return {"reasoning": reasoning, "content": content,
            "tool_calls": [R.Call(i, *c) for i, c in enumerate(calls)]}


CASES = {  # name -> (make_reply arguments, model output, expected message)
    "k2 calls": (("kimi_k2", None, "auto"), K2_OUT,
                 msg("Checking.", [("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
                                   ("functions.now:1", "now", "{}")])),
    "k2 text only": (("kimi_k2", None, "auto"), "No tools <| needed |> here.", msg("No tools <| needed |> here.")),
    "k2 parallel_tool_calls false": (("kimi_k2", None, "auto", False), K2_OUT,
                                     msg("Checking.", [("functions.get_weather:0", "get_weather", '{"city": "Paris"}')])),
    "k2 arguments not JSON": (("kimi_k2", None, "auto"),
                              'a<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>'
                              '{"x": 1<|tool_call_end|><|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{}'
                              '<|tool_call_end|><|tool_calls_section_end|>b',
                              msg('a<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>'
                                  '{"x": 1<|tool_call_end|>b', [("functions.g:1", "g", "{}")])),
    "k2 section never closed": (("kimi_k2", None, "auto"),
                                'a<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>'
                                '{}<|tool_call_end|><|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{"y"',
                                msg('a<|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{"y"',
                                    [("functions.f:0", "f", "{}")])),
    "k2 stray text in the section": (("kimi_k2", None, "auto"),
                                     '<|tool_calls_section_begin|> junk <|tool_call_begin|>functions.f:0'
                                     '<|tool_call_argument_begin|>{}<|tool_call_end|>\n<|tool_calls_section_end|>ok',
                                     msg("<|tool_calls_section_begin|> junkok", [("functions.f:0", "f", "{}")])),
    "k2 empty section never closed": (("kimi_k2", None, "auto"), "a<|tool_calls_section_begin|>junk",
                                      msg("a<|tool_calls_section_begin|>junk")),
    "k3 reasoning, text and calls": (("kimi_k3", "kimi_k3", "auto"), K3_OUT, msg(
        "Sure.", [("call-0", "get_weather", '{"city": "Paris \\"15e\\"", "days": 3, "opts": {"a": [1, null]}}'),
                  ("call-1", 'a&"b', '{"q": "x"}')], reasoning="The user wants weather.")),
    "k3 no tools requested": (("kimi_k3", "kimi_k3", "none"),
                              "hm<|close|>think<|sep|><|open|>response<|sep|>Hello<|close|>response<|sep|>"
                              "<|close|>message<|sep|>", msg("Hello", reasoning="hm")),
    "k3 thinking off": (("kimi_k3", "kimi_k3", "auto", True, None, False),
                        "Hi<|close|>response<|sep|><|close|>message<|sep|>", msg("Hi")),
    "k3 think never closed": (("kimi_k3", "kimi_k3", "auto"), "still <|close|>thi", msg("", reasoning="still <|close|>thi")),
    "k3 bad typed argument": (("kimi_k3", None, "auto", True, None, False),
                              'ok<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
                              '<|open|>argument key="n" type="number"<|sep|>three<|close|>argument<|sep|><|close|>call<|sep|>'
                              '<|close|>tools<|sep|>',
                              msg('ok<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>argument key="n" '
                                  'type="number"<|sep|>three<|close|>argument<|sep|><|close|>call<|sep|>')),
    "k3 stray text between channels": (("kimi_k3", None, "auto", True, None, False),
                                       'a<|close|>response<|sep|> b <|open|>tools<|sep|><|open|>call tool="f" '
                                       'index="1"<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>',
                                       msg("a b", [("call-0", "f", "{}")])),
    "k3 tools never closed": (("kimi_k3", None, "auto", True, None, False),
                              'ok<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>'
                              '<|close|>call<|sep|><|open|>call tool="g"', msg('ok<|open|>call tool="g"', [("call-0", "f", "{}")])),
    "named": ((None, None, "named", True, "get_weather"), '{"city": "Oslo"}',
              msg("", [("call-0", "get_weather", '{"city": "Oslo"}')])),
    "required": ((None, None, "required"), ' [{"name": "now", "parameters": {}}, {"name": "get_weather", '
                 '"parameters": {"city": "Rome", "u": [1, {"v": "}"}]}}] ',
                 msg("", [("call-0", "now", "{}"), ("call-1", "get_weather", '{"city": "Rome", "u": [1, {"v": "}"}]}')])),
    "required cut short": ((None, None, "required"), '[{"name": "now", "parameters": {}}, {"name": "get_w',
                           msg(' {"name": "get_w', [("call-0", "now", "{}")])),
}


def run(args, text: str, cuts) -> tuple[dict, list]:
    """-> (the joined message, the stream's deltas) with the text fed in pieces cut at `cuts`."""
    rep = R.make_reply(*args, new_id=_ids())
    pieces, deltas, at = [], [], 0
    for c in [*cuts, len(text)]:
        new = rep.feed(text[at:c])
        at = c
        pieces += new
        deltas.append(R.delta(new))
    new = rep.finish()
    pieces += new
    deltas.append(R.delta(new))
    return R.join(pieces), [d for d in deltas if d]


@pytest.mark.parametrize("case", list(CASES))
def test_parser_answers_and_every_split_point(case):
    """The expected message (hand-written), whole and with the text split at every point, and one character at a
    time; well-formed answers never show a marker in a content delta."""
    args, text, want = CASES[case]
    assert run(args, text, [])[0] == want
    for i in range(len(text) + 1):
        assert run(args, text, [i])[0] == want, i
    got, deltas = run(args, text, range(1, len(text)))
    assert got == want
    if "<|" not in want["content"] + (want["reasoning"] or ""):
        assert all("<|" not in d.get("content", "") + d.get("reasoning", "") for d in deltas)


FRAGMENTS = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
             "<|tool_call_argument_begin|>", "functions.f:0", '{"a": 1}', "{}", "{", " ", "\n", "x", "<|", "|>", "<|open|>",
             "<|close|>", "<|sep|>", "think", "tools", "<|close|>think<|sep|>", "<|open|>response<|sep|>",
             "<|close|>response<|sep|>", "<|open|>tools<|sep|>", '<|open|>call tool="f" index="1"<|sep|>',
             "<|close|>call<|sep|>", "<|close|>tools<|sep|>", "<|close|>message<|sep|>", "<|close|>argument<|sep|>",
             '<|open|>argument key="k" type="number"<|sep|>', "3", "[", "]", ",", '{"name": "f", "parameters": {}}']
FUZZ_PARSERS = [("kimi_k2", None, "auto"), ("kimi_k2", None, "auto", False), ("kimi_k3", "kimi_k3", "auto"),
                ("kimi_k3", None, "auto", True, None, False), ("kimi_k3", "kimi_k3", "none"), (None, None, "required"),
                (None, None, "named", True, "f")]


def test_any_output_parses_the_same_wherever_it_is_split(caplog):
    """Random well- and ill-formed answers (markers, their pieces, JSON, text; fixed seed): every parser gives the
    same message whole, split at any point, and a character at a time, and never raises."""
    import logging
    import random
    caplog.set_level(logging.ERROR, logger="peregrine.server.reply")  # malformed answers are logged: not here
    rng = random.Random(66)
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))
        for args in FUZZ_PARSERS:
            whole = run(args, text, [])[0]
            assert all(run(args, text, [i])[0] == whole for i in range(len(text) + 1)), (args, text)
            assert run(args, text, range(1, len(text)))[0] == whole, (args, text)


def test_stream_deltas_have_openai_shape():
    """Per call: one delta with its index, id, type and name (and its arguments so far), then argument fragments
    with the index only; the fragments join to the arguments. Reasoning goes out under both names."""
    _, deltas = run(("kimi_k3", "kimi_k3", "auto"), K3_OUT, range(1, len(K3_OUT)))
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    assert [c["index"] for c in calls] == [0, 1] and all(c["type"] == "function" and c["id"] for c in calls)
    assert all(d["reasoning"] == d["reasoning_content"] for d in deltas if "reasoning" in d)
    text = '{"city": "Oslo", "n": 2}'
    _, deltas = run((None, None, "named", True, "f"), text, range(1, len(text)))
    calls = [c for d in deltas for c in d["tool_calls"]]
    assert calls[0] == {"index": 0, "id": "call-0", "type": "function", "function": {"name": "f", "arguments": "{"}}
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == text


# ---------------------------------------------------------------- requests: checks and guided schemas
def _tools(body, auto=True, k3=False):
    from peregrine.server.tools import parse_tools
    return parse_tools(body, auto, k3)


@pytest.mark.parametrize("body,auto,field,needle", [
    ({"tools": []}, True, "tools", "empty"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, True, "tools", "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, True, "tools", "parameters"),
    ({"tools": {"name": "f"}}, True, "tools", "list"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, True, "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, True, "tool_choice", "NAME"),
    ({"tools": TOOLS, "tool_choice": "always"}, True, "tool_choice", "always"),
    ({"tool_choice": "required"}, True, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS}, False, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, False, "tool_choice", "--tool-call-parser"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, True, "parallel_tool_calls", "true or false"),
    ({"functions": [{"name": "f"}]}, True, "functions", "tools"),
])
def test_bad_tools_are_400s_naming_the_field(body, auto, field, needle):
    with pytest.raises(APIError) as e:
        _tools(body, auto)
    assert e.value.status == 400 and e.value.param == field and needle in e.value.message


def test_tool_choice_defaults_and_k3_named():
    assert _tools({"tools": TOOLS}).choice == "auto" and _tools({}).choice == "none"
    assert _tools({"tools": TOOLS, "tool_choice": "none"}, auto=False).choice == "none"  # no parser needed
    r = _tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}}}, auto=False)
    assert (r.choice, r.name) == ("named", "now")
    with pytest.raises(APIError, match="kimi_k3"):
        _tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}}}, k3=True)


def test_guided_schemas_as_vllm_builds_them():
    from peregrine.engine.request import GuidedDecoding
    from peregrine.server.tools import guided, guided_schema
    defs_tool = {"type": "function", "function": {"name": "d", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}}
    req = _tools({"tools": TOOLS + [defs_tool], "tool_choice": "required"})
    assert guided_schema(req) == {
        "type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                            "parameters": TOOLS[0]["function"]["parameters"]}, "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["now"]},
                            "parameters": {"type": "object", "properties": {}}}, "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["d"]},
                            "parameters": {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}}},
             "required": ["name", "parameters"]}]},
        "$defs": {"P": {"type": "integer"}}}
    assert "$defs" in defs_tool["function"]["parameters"]  # the request's tools (rendered in the prompt) untouched
    named = _tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert guided_schema(named) == TOOLS[0]["function"]["parameters"]
    other = GuidedDecoding("json_object", None, "response_format")
    assert guided(named, {}, other) == GuidedDecoding("json", TOOLS[0]["function"]["parameters"], "tool_choice")
    assert guided(_tools({"tools": TOOLS}), {}, other) is other
    assert guided_schema(_tools({"tools": TOOLS, "tool_choice": "required"}, k3=True)) is None  # XTML, not JSON
    with pytest.raises(APIError) as e:
        guided(named, {"structured_outputs": {"regex": "a"}}, None)
    assert e.value.param == "tool_choice"


@pytest.mark.parametrize("body,want", [
    ({"response_format": {"type": "json_object"}}, ("json_object", None, "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                 "strict": True}}},
     ("json", {"type": "object"}, "response_format")),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"json": '{"type": "integer"}', "disable_any_whitespace": True}},
     ("json", {"type": "integer"}, "structured_outputs")),
    ({"structured_outputs": {"regex": "[a-z]+"}}, ("regex", "[a-z]+", "structured_outputs")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", ["yes", "no"], "structured_outputs")),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, ("grammar", 'root ::= "a"', "structured_outputs")),
    ({"structured_outputs": {"json_object": True}}, ("json_object", None, "structured_outputs")),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     ("json_object", None, "response_format")),  # response_format wins, as in vLLM
])
def test_structured_output_fields(body, want):
    from peregrine.engine.request import GuidedDecoding
    from peregrine.server.structured import guided
    assert guided(body) == (None if want is None else GuidedDecoding(*want))


@pytest.mark.parametrize("body,field", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "structural_tag", "format": {}}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs"),
    ({"structured_outputs": {"sql": "x"}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_structured_output_is_a_400_naming_the_field(body, field):
    from peregrine.server.structured import guided
    with pytest.raises(APIError) as e:
        guided(body)
    assert e.value.status == 400 and e.value.param == field


def test_logit_bias_keys_and_values():
    from peregrine.server.structured import logit_bias
    assert logit_bias({"logit_bias": {"65": 5, "66": -100.0}}) == {65: 5.0, 66: -100.0}
    assert logit_bias({"logit_bias": {}}) is None and logit_bias({}) is None
    for bad in ({"a": 1}, {"-1": 1}, {"1": "x"}, {"1": True}, {"1": float("nan")}, {"9" * 30: 1}, [1]):
        with pytest.raises(APIError) as e:
            logit_bias({"logit_bias": bad})
        assert e.value.param == "logit_bias"


@pytest.mark.parametrize("messages,needle", [
    ([{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f",
                                                                                             "arguments": "{}"}}]}],
     "tool_calls[0].id"),
    ([{"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "",
                                                                                      "arguments": "{}"}}]}],
     "function.name"),
    ([{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": {"x": 1}}}]}],
     "arguments must be a string"),
    ([{"role": "assistant", "tool_calls": {"id": "a"}}], "must be a list"),
    ([{"role": "assistant", "tool_calls": ["f"]}], "tool_calls[0]"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL_A]}], "only assistant"),
    ([{"role": "tool", "content": "x"}], "tool_call_id"),
    ([{"role": "user", "content": "x", "name": 5}], "name"),
])
def test_malformed_history_is_a_400_naming_messages(messages, needle):
    with pytest.raises(APIError) as e:
        chat_mod.normalize_messages(messages)
    assert e.value.param == "messages" and needle in e.value.message


# ---------------------------------------------------------------- served
NAME = "kimi"


def _serve(tmp_path, specials, template, **app_kw):
    from conftest import write_dummy_model
    from peregrine.config import PRESET_DIR, EngineConfig
    from peregrine.engine.build import build_engine
    from peregrine.server import BackgroundServer, create_app
    raw = json.loads((PRESET_DIR / "tiny-kimi-linear.json").read_text())
    n = len(ranks())
    end = n + next(k for k, v in specials.items() if v in ("<|im_end|>", "<|end_of_msg|>"))
    raw.update(vocab_size=vocab_size(), bos_token_id=n, eos_token_id=end, pad_token_id=n + 255)
    write_dummy_model(tmp_path, raw, seed=3)
    ids = write_tokenizer(tmp_path, template=template, specials=specials)
    eng, tok = build_engine(str(tmp_path), EngineConfig(max_model_len=2048, max_num_seqs=4, dtype="fp32"),
                            log=lambda *a, **k: None)
    tmpl = ChatTemplate(tmp_path, model_type="kimi_k3" if "<|open|>" in ids else None)
    R.check_tokens(tok, app_kw.get("tool_parser"), app_kw.get("reasoning_parser"), tmpl.k3)
    srv = BackgroundServer(create_app(eng, tok, NAME, chat_template=tmpl, **app_kw))
    srv.tok, srv.ids, srv.end = tok, ids, end
    return srv


def _script(srv, monkeypatch, text: str):
    """Every request of this server answers `text` (then its end id), whatever the dummy model would say: the
    engine's forced tokens, planted under the server."""
    st = srv.server.config.app.state.peregrine
    real = st.aeng.add

    def add(rid, prompt, params, queue=None, forced=None):
        return real(rid, prompt, params, queue=queue, forced=srv.tok.encode(text) + [srv.end])
    monkeypatch.setattr(st.aeng, "add", add)


@pytest.fixture(scope="module")
def k2_srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("k2")
    with _serve(d, SPECIALS | TOOL_SPECIALS, (FIX / "kimi_linear.jinja").read_text(), tool_parser="kimi_k2",
                enable_auto_tool_choice=True) as s:
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=T)
        yield s


def _stream(client, **kw):
    """-> (content, reasoning, tool calls as {index: {id, name, arguments}}, finish_reason, chunks)."""
    content, reasoning, calls, finish, chunks = "", "", {}, None, []
    for ch in client.chat.completions.create(stream=True, **kw):
        chunks.append(ch)
        for c in ch.choices:
            d = c.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or ():
                cur = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert cur["id"] is None  # id and name once per call
                    cur["id"], cur["name"] = tc.id, tc.function.name
                cur["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content, reasoning, calls, finish, chunks


def test_served_kimi_linear_tool_calls(k2_srv, monkeypatch):
    """A chat request with tools renders the template's tool_declare block (prompt tokens as transformers renders
    the prompt, through Kimi's tokenizer); the scripted answer's section becomes message.tool_calls with
    finish_reason "tool_calls", streamed as OpenAI's deltas that join to the same message."""
    from peregrine.kimi_tokenizer import KIMI_PAT_STR
    _script(k2_srv, monkeypatch, K2_OUT)
    msgs = CONVERSATIONS["calls and results"]
    kw = dict(model=NAME, messages=msgs, tools=TOOLS, max_tokens=200, temperature=0)
    r = k2_srv.client.chat.completions.create(**kw)
    prompt = _hf_tokenizer((FIX / "kimi_linear.jinja").read_text()).apply_chat_template(
        msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(reference_encode(prompt, KIMI_PAT_STR, k2_srv.ids))
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Checking."
    assert [(t.id, t.type, t.function.name, t.function.arguments) for t in c.message.tool_calls] == [
        ("functions.get_weather:0", "function", "get_weather", '{"city": "Paris"}'),
        ("functions.now:1", "function", "now", "{}")]
    content, _, calls, finish, _ = _stream(k2_srv.client, **kw)
    assert (content, finish) == ("Checking.", "tool_calls")
    assert calls == {i: {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                     for i, t in enumerate(c.message.tool_calls)}
    # the conversation goes on with the answer's calls and their results: a 200
    more = msgs + [c.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "21"},
                   {"role": "tool", "tool_call_id": "functions.now:1", "content": "noon"}]
    assert k2_srv.client.chat.completions.create(**{**kw, "messages": more}).choices[0].finish_reason == "tool_calls"


def test_served_tool_choice_none_and_no_tools_leave_text_alone(k2_srv, monkeypatch):
    _script(k2_srv, monkeypatch, K2_OUT)
    for extra in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        r = k2_srv.client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],
                                                  max_tokens=200, temperature=0, **extra)
        assert r.choices[0].message.content == K2_OUT and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"


def test_served_malformed_answer_is_content_not_a_500(k2_srv, monkeypatch):
    bad = 'a<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"x":'
    _script(k2_srv, monkeypatch, bad)
    kw = dict(model=NAME, messages=[{"role": "user", "content": "x"}], tools=TOOLS, max_tokens=200, temperature=0)
    r = k2_srv.client.chat.completions.create(**kw)
    assert r.choices[0].message.content == bad and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert _stream(k2_srv.client, **kw)[:4] == (bad, "", {}, "stop")


def test_served_auto_needs_the_flag(tmp_path):
    with _serve(tmp_path, SPECIALS | TOOL_SPECIALS, (FIX / "kimi_linear.jinja").read_text()) as s:
        body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "max_tokens": 2}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=T)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        r = httpx.post(s.url + "/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=T)
        assert r.status_code == 200
        r = httpx.post(s.url + "/tokenize", json={"model": NAME, "messages": body["messages"], "tools": TOOLS},
                       timeout=T)
        assert r.status_code == 200 and r.json()["count"] > 0


def test_served_k3_reasoning_and_tool_calls(tmp_path, monkeypatch):
    with _serve(tmp_path, K3_SPECIALS, False, tool_parser="kimi_k3", reasoning_parser="kimi_k3",
                enable_auto_tool_choice=True) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=T)
        _script(s, monkeypatch, K3_OUT)
        kw = dict(model=NAME, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=600,
                  temperature=0)
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        assert (m.content, m.reasoning_content, m.reasoning) == ("Sure.", "The user wants weather.",
                                                                 "The user wants weather.")
        assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [
            ("get_weather", {"city": 'Paris "15e"', "days": 3, "opts": {"a": [1, None]}}), ('a&"b', {"q": "x"})]
        assert r.choices[0].finish_reason == "tool_calls" and all(t.id.startswith("chatcmpl-tool-") for t in m.tool_calls)
        content, reasoning, calls, finish, _ = _stream(client, **kw)
        assert (content, reasoning, finish) == (m.content, m.reasoning_content, "tool_calls")
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [(t.function.name, t.function.arguments)
                                                                         for t in m.tool_calls]
        # the prompt is K3's format, markers as special tokens (the think channel opened by the prompt)
        ids = httpx.post(s.url + "/tokenize", json={"model": NAME, "messages": kw["messages"], "tools": TOOLS},
                         timeout=T).json()["tokens"]
        tail = [s.ids["<|open|>"], *s.tok.encode("think"), s.ids["<|sep|>"]]
        assert ids[-len(tail):] == tail
        no_think = httpx.post(s.url + "/tokenize", json={"model": NAME, "messages": kw["messages"],
                                                         "reasoning_effort": "none"}, timeout=T).json()["tokens"]
        assert s.tok.decode(no_think).endswith("<|open|>response<|sep|>")


def test_named_tool_choice_needs_the_engine_or_answers_json(k2_srv):
    """tool_choice naming a function is JSON-guided: with the engine's guided decoding (#66 item 3) the answer is
    one call whose arguments are JSON of the tool's schema; an engine that does not serve it yet answers a 400
    naming tool_choice."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "max_tokens": 40,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "temperature": 0}
    r = httpx.post(k2_srv.url + "/v1/chat/completions", json=body, timeout=T)
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "tool_choice"
        pytest.skip("the engine does not serve guided decoding yet (#66 item 3, engine/guided.py)")
    c = r.json()["choices"][0]
    (call,) = c["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and c["finish_reason"] in ("stop", "length")
    if c["finish_reason"] == "stop":
        assert isinstance(json.loads(call["function"]["arguments"]), dict)


def _constrained(srv, path, body):
    r = httpx.post(srv.url + path, json={"model": NAME, **body}, timeout=T)
    if r.status_code == 400 and "not served" in r.json()["error"]["message"]:
        pytest.skip("the engine does not serve guided decoding yet (#66 item 3, engine/guided.py)")
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_grammar_cut_by_max_tokens_ends_with_length(k2_srv):
    """A constrained answer that max_tokens cuts before its grammar ends is finish_reason "length" (its text a
    prefix the grammar allows); one that completes is "stop"."""
    import re
    c = _constrained(k2_srv, "/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0,
                                                 "structured_outputs": {"regex": "[a-z]{60}"}})
    assert c["finish_reason"] == "length" and re.fullmatch("[a-z]+", c["text"])
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 40}}, "required": ["a"]}
    c = _constrained(k2_srv, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 6, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    assert c["finish_reason"] == "length" and c["message"]["content"].lstrip().startswith("{")
    c = _constrained(k2_srv, "/v1/completions", {"prompt": "x", "max_tokens": 50, "temperature": 0,
                                                 "structured_outputs": {"choice": ["yes", "no"]}})
    assert c["finish_reason"] == "stop" and c["text"] in ("yes", "no")


def test_parser_flags_are_checked_at_start(tmp_path, capsys):
    """--enable-auto-tool-choice without a parser stops serve before anything loads; a parser whose markers the
    model's tokenizer lacks is an error naming them; vLLM's parser names outside the Kimi formats are refused."""
    from peregrine.config import ConfigError
    from peregrine.kimi_tokenizer import KimiTokenizer
    from peregrine.server.cli import main
    from peregrine.tokenizer import ByteTokenizer
    assert main(["serve", "--model", "peregrine-tiny", "--enable-auto-tool-choice"]) == 2
    assert "--tool-call-parser" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--model", "peregrine-tiny", "--tool-call-parser", "hermes"])
    with pytest.raises(ConfigError, match="tool_calls_section_begin"):
        R.check_tokens(ByteTokenizer(320), "kimi_k2", None)
    write_tokenizer(tmp_path, specials=SPECIALS | TOOL_SPECIALS)
    tok = KimiTokenizer(tmp_path, vocab_size())
    R.check_tokens(tok, "kimi_k2", None)
    with pytest.raises(ConfigError, match=r"--reasoning-parser kimi_k3 reads the special tokens <\|open\|>"):
        R.check_tokens(tok, "kimi_k2", "kimi_k3")


def test_malformed_output_is_logged(caplog):
    import logging
    caplog.set_level(logging.WARNING, logger="peregrine.server.reply")
    args, text, want = CASES["k2 arguments not JSON"]
    assert run(args, text, [])[0] == want
    assert "arguments are not a JSON object; returned as content" in caplog.text
