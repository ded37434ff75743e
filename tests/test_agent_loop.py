"""An agent loop on the CPU with real clients (#66 item 4): `peregrine serve --model peregrine-tiny-tools
--enable-auto-tool-choice --tool-call-parser kimi_k2`, in-process, built as serve builds it; the embedded model
trained to call an `add` tool in Kimi's format (peregrine/train/tools.py), read its result and answer with it.

- The openai SDK: tools=[add], the call read back (non-streamed, and streamed: accumulated from its deltas), the
  tool run here, its result sent back, the final answer holding the sum (computed here) and nothing else numeric.
- pydantic-ai (an agent framework from PyPI, test-only): its own `add` tool, its own run loop; the tool called once
  with the question's numbers, the final answer holding their sum; a greeting answered without a call.
- The README's loop, run as written against this server, prints what the README says it prints.
- The preset's chat template: every turn's prompt is the last one's plus the model's answer and what followed.
- The task's training data scores exactly the answers the model writes (read back by the server's parser); the
  trainer writes a model folder the engine loads, with its greedy eval; the shipped weights stay a few MB.
Greedy decoding on fixed problems: deterministic. Timeouts only bound hangs, never speed.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path

import openai
import pytest

from peregrine.train import tools as task

NAME = "peregrine-tiny-tools"
T = 120          # seconds: bound on any one request (a hang, never a speed check)
MAX_TOKENS = 96  # an answer's bound: a call with two 5-digit operands is ~60 tokens
ROOT = Path(__file__).resolve().parent.parent
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def _problems(n: int, seed: int) -> list[tuple[int, int]]:
    """Operands of 1..5 digits (the trained range), uniform over lengths; drawn here, not by the task's code."""
    r = random.Random(seed)
    return [tuple(r.randrange(10 ** (d - 1) if d > 1 else 0, 10 ** d) for d in (r.randint(1, 5), r.randint(1, 5)))
            for _ in range(n)]


PROBLEMS = _problems(6, 66)


def numbers(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


@pytest.fixture(scope="module")
def srv():
    from peregrine.config import EngineConfig, resolve_model
    from peregrine.engine.build import build_engine
    from peregrine.server import BackgroundServer, create_app
    from peregrine.server.chat import ChatTemplate
    from peregrine.server.reply import check_tokens
    _, folder = resolve_model(NAME)
    eng, tok = build_engine(NAME, EngineConfig(max_num_seqs=4, max_model_len=1024), log=lambda *a, **k: None)
    tmpl = ChatTemplate(folder, model_type=eng.model_cfg.model_type)
    check_tokens(tok, "kimi_k2", None, tmpl.k3)  # the parser's markers are special tokens of the preset's tokenizer
    app = create_app(eng, tok, NAME, chat_template=tmpl, tool_parser="kimi_k2", enable_auto_tool_choice=True)
    with BackgroundServer(app) as s:
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=T)
        yield s


def ask(client, messages: list[dict], **kw):
    return client.chat.completions.create(model=NAME, messages=messages, tools=[ADD], temperature=0,
                                          max_tokens=MAX_TOKENS, **kw)


def stream(client, messages: list[dict]) -> tuple[str, dict, str | None]:
    """-> (content, calls {index: {id, name, arguments}} accumulated from the deltas, finish_reason)."""
    content, calls, finish = "", {}, None
    for chunk in ask(client, messages, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or ():
                cur = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                cur["id"] = tc.id or cur["id"]
                cur["name"] = (tc.function.name if tc.function else None) or cur["name"]
                cur["arguments"] += (tc.function.arguments if tc.function else None) or ""
            finish = c.finish_reason or finish
    return content, calls, finish


def run_add(args: dict) -> str:
    return str(args["a"] + args["b"])


@pytest.mark.parametrize("a,b", PROBLEMS)
def test_openai_sdk_loop(srv, a, b):
    msgs = [{"role": "user", "content": f"What is {a} plus {b}?"}]
    c = ask(srv.client, msgs).choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content, c.message
    (call,) = c.message.tool_calls
    assert (call.type, call.function.name) == ("function", "add")
    args = json.loads(call.function.arguments)
    assert args == {"a": a, "b": b}
    msgs += [c.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": run_add(args)}]
    c = ask(srv.client, msgs).choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls
    assert numbers(c.message.content) == [a + b], c.message.content


@pytest.mark.parametrize("a,b", PROBLEMS[:3])
def test_openai_sdk_loop_streamed(srv, a, b):
    """The call accumulated from the stream's deltas is the non-streamed answer's call; a client that keeps it
    as it came (as streaming clients do) gets the same final answer, streamed too."""
    msgs = [{"role": "user", "content": f"Add {a} and {b}."}]
    whole = ask(srv.client, msgs).choices[0].message
    content, calls, finish = stream(srv.client, msgs)
    assert (content, finish) == ("", "tool_calls")
    (first,) = whole.tool_calls
    assert calls == {0: {"id": first.id, "name": "add", "arguments": first.function.arguments}}
    call = calls[0]
    args = json.loads(call["arguments"])
    assert args == {"a": a, "b": b}
    sent = {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
    msgs += [{"role": "assistant", "content": None, "tool_calls": [sent]},
             {"role": "tool", "tool_call_id": call["id"], "content": run_add(args)}]
    content, calls, finish = stream(srv.client, msgs)
    assert (calls, finish) == ({}, "stop")
    assert numbers(content) == [a + b], content


def test_a_conversation_goes_on(srv):
    """A second question after the first answer, in the same conversation: its call is functions.add:1 (Kimi
    numbers calls over the conversation), and its answer holds the second sum."""
    msgs: list[dict] = []
    for i, (a, b) in enumerate(PROBLEMS[3:5]):
        msgs.append({"role": "user", "content": f"What is {a} + {b}?"})
        m = ask(srv.client, msgs).choices[0].message
        (call,) = m.tool_calls
        assert call.id == f"functions.add:{i}" and json.loads(call.function.arguments) == {"a": a, "b": b}
        msgs += [m.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": run_add(json.loads(call.function.arguments))}]
        m = ask(srv.client, msgs).choices[0].message
        assert numbers(m.content) == [a + b] and not m.tool_calls
        msgs.append(m.model_dump(exclude_none=True))


# ---------------------------------------------------------------- an agent framework: pydantic-ai
def _agent(srv, instructions: str | None = None):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=T)
    model = OpenAIChatModel(NAME, provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, instructions=instructions, model_settings={"temperature": 0.0, "max_tokens": MAX_TOKENS})
    calls = []

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b
    return agent, calls


@pytest.mark.parametrize("a,b", PROBLEMS[:3])
def test_pydantic_ai_agent(srv, a, b):
    """pydantic-ai's loop: it sends the conversation back with the call's arguments re-serialised (compact JSON)
    and its own rendering of the tool's result; one call with the question's numbers, then the sum."""
    agent, calls = _agent(srv, instructions="Use the add tool for sums.")
    out = agent.run_sync(f"What is {a} plus {b}?").output
    assert calls == [(a, b)]
    assert numbers(out) == [a + b], out


def test_pydantic_ai_agent_streamed(srv):
    """The same loop streamed: pydantic-ai reads the call from the stream's deltas and streams the final text."""
    (a, b), = PROBLEMS[5:6]
    agent, calls = _agent(srv)

    async def go() -> str:
        async with agent.run_stream(f"What is {a} plus {b}?") as run:
            return "".join([piece async for piece in run.stream_text(delta=True, debounce_by=None)])
    out = asyncio.run(go())
    assert calls == [(a, b)]
    assert numbers(out) == [a + b], out


def test_pydantic_ai_greeting_is_answered_without_a_call(srv):
    agent, calls = _agent(srv)
    out = agent.run_sync("Hello").output
    assert calls == [] and out == task.DIRECT


# ---------------------------------------------------------------- the README's loop and the template
def test_readme_loop_prints_what_it_says(srv, capsys):
    """The README's code block for this preset, run as written with its `client` (the README's, defined above the
    block) pointing at this server."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S) if NAME in b]
    assert len(blocks) == 1, "README.md shows the agent loop in one python block naming " + NAME
    claims = re.findall(r"^print\(.*\)\s+# (.+)$", blocks[0], re.M)
    assert claims, "the block states what it prints"
    capsys.readouterr()
    exec(compile(blocks[0], "README.md", "exec"), {"client": srv.client})
    assert capsys.readouterr().out.splitlines() == claims


def test_each_turn_extends_the_last():
    """The preset's template renders every turn's prompt as the last prompt + the model's answer (as it wrote it)
    + <|im_end|> + what followed: a client that keeps the answer as it came reuses the whole prefix."""
    tmpl, _ = task.load()
    said = task.call_text("functions.add:0", '{"a": 12, "b": 30}')
    call = {"id": "functions.add:0", "type": "function", "function": {"name": "add", "arguments": '{"a": 12, "b": 30}'}}
    turns = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 plus 30?"}],
             [{"role": "assistant", "content": None, "tool_calls": [call]},
              {"role": "tool", "tool_call_id": "functions.add:0", "content": "42"}],
             [{"role": "assistant", "content": "The sum is 42."}, {"role": "user", "content": "Thanks!"}]]
    answers = [said, "The sum is 42."]
    msgs: list[dict] = []
    prompts = []
    for turn in turns:
        msgs += turn
        prompts.append(tmpl.render(msgs, [ADD]))
    for p, answer, nxt in zip(prompts, answers, prompts[1:]):
        assert nxt.startswith(p + answer + "<|im_end|>")
    assert prompts[0] == ("<|im_system|>tool_declare<|im_middle|>add(a, b)<|im_end|>"
                          "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
                          "<|im_user|>user<|im_middle|>What is 12 plus 30?<|im_end|>"
                          "<|im_assistant|>assistant<|im_middle|>")
    assert prompts[1].endswith("<|im_system|>tool<|im_middle|>## Return of functions.add:0\n42<|im_end|>"
                               "<|im_assistant|>assistant<|im_middle|>")


# ---------------------------------------------------------------- the task's training data and trainer
def test_training_scores_exactly_the_answers_the_model_writes():
    """Each scored run of a training conversation is one assistant answer and its <|im_end|>: read by the server's
    kimi_k2 parser it is add called with that question's numbers, or the final answer with their sum (computed
    here), or the greeting's reply; a call a client re-sent in another form is context, not scored."""
    from peregrine.server.reply import join, make_reply
    tmpl, tok = task.load()
    end = tok.token_id("<|im_end|>")
    convs = task.generate(60, seed=7)
    resent = 0
    for conv in convs:
        ids, scored = task.encode(conv, tmpl, tok)
        runs, cur = [], []
        for t, s in zip(ids, scored):
            if s:
                cur.append(t)
            elif cur:
                runs, cur = runs + [cur], []
        runs += [cur] if cur else []
        assert all(r[-1] == end and end not in r[:-1] for r in runs)
        want = []
        questions = [m["content"] for m in conv.messages if m["role"] == "user"]
        for q, ab in zip(questions, conv.sums):
            if ab is None:
                want.append(("content", task.DIRECT))
                continue
            a, b = ab
            assert numbers(q) == [a, b]
            (call,) = next(m["tool_calls"] for m in conv.messages
                           if m.get("tool_calls") and numbers(m["tool_calls"][0]["function"]["arguments"]) == [a, b])
            if call["id"].startswith("functions.add:") and call["function"]["arguments"] == f'{{"a": {a}, "b": {b}}}':
                want.append(("call", {"a": a, "b": b}))  # the history holds the call as the model writes it
            else:
                resent += 1
            want.append(("content", f"The sum is {a + b}."))
        got = []
        for r in runs:
            reply = make_reply("kimi_k2", None, "auto")
            msg = join(reply.feed(tok.decode(r[:-1])) + reply.finish())
            got.append(("call", json.loads(msg["tool_calls"][0].arguments)) if msg["tool_calls"] else
                       ("content", msg["content"]))
            assert not (msg["tool_calls"] and msg["content"])
        assert got == want
    assert resent  # the set holds re-sent calls, so the rule was exercised


def test_trainer_writes_a_model_folder_the_server_path_loads(tmp_path):
    """Two steps of the trainer (CPU): a model folder with the preset's tokenizer and template, its log holding the
    greedy eval through the engine (random-ish weights: the accuracy is whatever it is, the path must run)."""
    from peregrine.config import EngineConfig
    from peregrine.engine.build import build_engine
    out = tmp_path / "tools"
    assert task.main(["--out", str(out), "--steps", "2", "--batch", "2", "--eval-n", "2", "--n", "2",
                      "--device", "cpu", "--log-every", "1"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 2 and log["greedy_eval"]["n"] == 2
    for f in ("config.json", "model.safetensors", "tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / f).is_file(), f
    _, tok = build_engine(str(out), EngineConfig(max_num_seqs=1), log=lambda *a, **k: None)
    assert tok.kind == "tiktoken" and tok.encode("<|tool_call_begin|>") == [tok.token_id("<|tool_call_begin|>")]


def test_shipped_weights_stay_light():
    assert (task.FOLDER / "model.safetensors").stat().st_size < 4e6  # a few MB: the repository keeps checkpoints light
