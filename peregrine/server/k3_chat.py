"""Kimi K3's chat format (XTML), rendered as the model's tokenizer renders it.

K3 ships no Jinja template: its tokenizer builds the prompt in Python (`encoding_k3.py` in the release), as a
list of segments in an XML-like markup whose brackets are special tokens:

    <|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>

A control segment (`<|open|>`, `<|close|>`, `<|sep|>`, `<|end_of_msg|>`) is one special token; every other segment
(a tag name, an attribute, user or tool text) is encoded on its own as ordinary text, so text that spells a
marker cannot forge one, and token boundaries fall where the reference's fall. This module writes the same
segments from the format's rules (tests/test_tools.py holds it to the release's encoder):

- tools, if any: one `system` message of type `tool-declare` with the tools as key-sorted compact JSON;
- with thinking and a thinking_effort: a `system` message of type `thinking-effort`;
- each message in order (`developer` is `system`, as vLLM passes it); an assistant message is its think channel
  (with thinking, always present, filled with its reasoning), its response channel, and a tools channel with one
  `call` per tool call, each argument typed (`string` raw, others JSON), or a `json` block where the arguments
  are not a JSON object string; tool results are numbered within their turn and named by their call;
- tool_choice `required` / `none`, response_format `json_object` / `json_schema`: a `system` message each;
- the generation prompt: an open assistant message and its think (or, without thinking, response) channel.

Tool results are first put in the order of the calls they answer (matched by tool_call_id, or by vLLM's
`NAME:INDEX` alias), as vLLM's K3 renderer and the encoder both do.
"""
from __future__ import annotations

import json

OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
CONTROL = (OPEN, CLOSE, SEP, END)
THINKING_EFFORTS = ("low", "high", "max")  # what the encoder accepts (its note also names medium; it asserts these)
TOOLS_BODY = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
EFFORT_BODY = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
               "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
               "Now the system is invoked with `thinking_effort={}`.")
CHOICE_BODY = {"required": "The system is invoked with `tool_choice=required`.\n"
                           "You MUST call tools in the next message.",
               "none": "The system is invoked with `tool_choice=none`.\n"
                       "You MUST NOT call any tools in the next message."}
RAW_JSON = ("Your response must be raw JSON data without markdown code blocks (```json) or any additional "
            "formatting.")


class K3FormatError(ValueError):
    """A conversation K3's format cannot carry (the server answers a 400 naming `messages`)."""


def compact(v) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def sort_keys(v):
    """Every mapping sorted by key, recursively: the same tools in another key order give the same prompt."""
    if isinstance(v, dict):
        return {k: sort_keys(v[k]) for k in sorted(v)}
    if isinstance(v, list):
        return [sort_keys(x) for x in v]
    return v


def _type(v) -> str:
    if isinstance(v, bool):  # before int: a bool is an int to Python
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    return "object" if isinstance(v, dict) else "array"


class Segments(list):
    """(text, special) pairs; empty text is never added (the encoder drops it too)."""

    def ctl(self, t: str) -> None:
        self.append((t, True))

    def txt(self, t) -> None:
        t = str(t)
        if t:
            self.append((t, False))

    def open(self, tag: str, attrs=()) -> None:
        self.ctl(OPEN)
        self.txt(tag)
        for k, v in attrs:  # four text segments an attribute, as the encoder splits them
            self.txt(f" {k}")
            self.txt('="')
            self.txt(str(v).replace("&", "&amp;").replace('"', "&quot;"))
            self.txt('"')
        self.ctl(SEP)

    def close(self, tag: str) -> None:
        self.ctl(CLOSE)
        self.txt(tag)
        self.ctl(SEP)

    def message(self, attrs, body) -> None:
        self.open("message", attrs)
        self.txt(body)
        self.close("message")
        self.ctl(END)


def _content(c) -> str:
    if c is None:
        return ""
    return c if isinstance(c, str) else "".join(p.get("text", "") for p in c)


def _fn(call: dict) -> dict:
    f = call.get("function")
    return f if isinstance(f, dict) else call


def _arguments(a) -> tuple[dict, str | None]:
    """-> (arguments, raw JSON block): a JSON object string becomes typed arguments; text that is not JSON stays as
    written (the model sees back what it emitted); JSON that is not an object has no XTML form."""
    if a is None:
        return {}, None
    if isinstance(a, dict):
        return a, None
    if isinstance(a, str):
        if not a.strip():
            return {}, None
        try:
            v = json.loads(a)
        except ValueError:
            return {}, a
        if not isinstance(v, dict):
            raise K3FormatError("Kimi K3 tool call arguments must be a JSON object")
        return v, None
    raise K3FormatError("Kimi K3 tool call arguments must be a JSON object string")


def _sorted_run(run: list[dict], targets: dict) -> list[dict]:
    """A run of tool results in call order, each named by its call (targets: result id -> (position, name)); as it
    came if any result has no call."""
    hits = [targets.get(str(t["tool_call_id"])) if t.get("tool_call_id") is not None else None for t in run]
    if not run or any(h is None for h in hits):
        return [dict(t) for t in run]
    ranked = sorted(zip(hits, range(len(run)), run), key=lambda x: (x[0][0], x[1]))
    return [{**t, "tool": h[1], **({"name": h[1]} if "name" in t else {})} for h, _, t in ranked]


def _targets(calls, aliases: bool) -> dict:
    out: dict[str, tuple[int, str]] = {}
    for pos, c in enumerate(calls or ()):
        name = _fn(c).get("name")
        keys = [str(c["id"])] if c.get("id") is not None else []
        if aliases:  # vLLM's renderer: only named calls, and NAME:INDEX (0-based) too
            if not isinstance(name, str) or not name:
                continue
            keys.append(f"{name}:{pos}")
        for k in keys:
            out.setdefault(k, (pos, name))
    return out


def order_tool_results(messages: list[dict]) -> list[dict]:
    """Tool results put in the order of the calls they answer and named by them, in the two passes a K3 prompt
    goes through: vLLM's renderer (the run right after an assistant message with calls, by tool_call_id or
    `NAME:INDEX`), then the encoder (any run, by the latest assistant message's call ids). A run with a result
    that matches no call is left as it came."""
    out: list[dict] = []
    i = 0
    while i < len(messages):  # vLLM's pass
        m = messages[i]
        out.append(dict(m))
        i += 1
        if m.get("role") != "assistant" or not m.get("tool_calls"):
            continue
        start = i
        while i < len(messages) and messages[i].get("role") == "tool":
            i += 1
        out += _sorted_run(messages[start:i], _targets(m["tool_calls"], aliases=True))
    msgs, out, targets, i = out, [], {}, 0
    while i < len(msgs):  # the encoder's pass
        m = msgs[i]
        if m.get("role") != "tool":
            if m.get("role") == "assistant":
                targets = _targets(m.get("tool_calls"), aliases=False)
            out.append(m)
            i += 1
            continue
        start = i
        while i < len(msgs) and msgs[i].get("role") == "tool":
            i += 1
        out += _sorted_run(msgs[start:i], targets)
    return out


def _render_assistant(s: Segments, m: dict, thinking: bool) -> None:
    if thinking:  # the channel is structural: present in every assistant message, empty or not
        s.open("think")
        r = m.get("reasoning_content") or m.get("reasoning")
        if r is not None and str(r).strip():
            s.txt(r)
        s.close("think")
    s.open("response")
    s.txt(_content(m.get("content")))
    s.close("response")
    calls = m.get("tool_calls")
    if not calls:
        return
    s.open("tools")
    for index, c in enumerate(calls, start=1):
        f = _fn(c)
        args, raw = _arguments(f.get("arguments"))
        s.open("call", [("tool", f["name"]), ("index", index)])
        if raw is not None:
            s.open("json", [("type", "object")])
            s.txt(raw)
            s.close("json")
        else:
            for k, v in args.items():
                s.open("argument", [("key", k), ("type", _type(v))])
                s.txt(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
                s.close("argument")
        s.close("call")
    s.close("tools")


def _response_schema(rf):
    js = rf.get("json_schema") if isinstance(rf, dict) else None
    if isinstance(js, dict):
        return js.get("schema", js.get("json_schema", js))
    return js


def render(messages: list[dict], tools: list | None = None, *, thinking: bool = True,
           thinking_effort: str | None = None, tool_choice=None, response_format=None,
           add_generation_prompt: bool = True) -> Segments:
    """The prompt's segments. messages: normalized chat messages (chat.normalize_messages); tool_choice: "required"
    or "none" add their system message (vLLM passes tool_choice only with tools); response_format: the request's."""
    if thinking and thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise K3FormatError(f"Kimi K3 takes thinking_effort {', '.join(THINKING_EFFORTS)}, got {thinking_effort!r}")
    msgs = order_tool_results([{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages])
    s = Segments()
    if tools:
        s.message([("role", "system"), ("type", "tool-declare")], TOOLS_BODY.format(compact(sort_keys(tools))))
    if thinking and thinking_effort is not None:
        s.message([("role", "system"), ("type", "thinking-effort")], EFFORT_BODY.format(thinking_effort))
    calls, n_results = None, 0
    for m in msgs:
        role = m["role"]
        named = [("name", m["name"])] if m.get("name") else []
        if role in ("user", "system"):
            s.message([("role", role)] + named, _content(m.get("content")))
        elif role == "tool":
            n_results += 1
            name = m.get("tool", m.get("name"))
            if name is None and calls is not None and n_results <= len(calls):
                name = _fn(calls[n_results - 1]).get("name")
            if name is None:
                raise K3FormatError("a tool message needs a name K3 can render: a tool_call_id of the assistant "
                                    "message before it, or its name")
            s.message([("role", "tool"), ("tool", name), ("index", n_results)], _content(m.get("content")))
        elif role == "assistant":
            calls, n_results = m.get("tool_calls"), 0
            s.open("message", [("role", "assistant")] + named)
            _render_assistant(s, m, thinking)
            s.close("message")
            s.ctl(END)
    if tool_choice in CHOICE_BODY:
        s.message([("role", "system"), ("type", "tool-choice")], CHOICE_BODY[tool_choice])
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        s.message([("role", "system"), ("type", "response-format")],
                  "The system is invoked with `response_format=json_object`.\n" + RAW_JSON)
    elif kind == "json_schema":
        schema = _response_schema(response_format)
        s.message([("role", "system"), ("type", "response-format")],
                  "The system is invoked with `response_format=json_schema`.\n" + RAW_JSON + "\nThe JSON data must "
                  f"match the following schema:\n```json\n{compact(sort_keys(schema))}\n```")
    if add_generation_prompt:
        s.open("message", [("role", "assistant")])
        s.open("think" if thinking else "response")
    return s
