"""What a chat answer's text becomes: reasoning, content and tool calls (vLLM's parsers, in their spelling).

One Reply per choice reads the text as it streams, in stages: the reasoning parser (kimi_k3: the think channel),
then the tool stage (kimi_k2 or kimi_k3 for "auto", JSON for a named function or "required"). feed(text) returns
the pieces the new text completes, finish() the rest; the non-streamed message is the same pieces joined, so a
stream and a whole answer always agree, wherever the text was split. Pieces are ("reasoning", str),
("content", str), ("call", Call) (a tool call's index, id, name and its first argument text) and ("args", index,
str) (more of a call's arguments). A marker is never shown as text: a tail that may be the start of one is held
back until it is known.

Formats (facts of the models' templates and of vLLM's kimi_k2 / kimi_k3 parsers):

- kimi_k2 (Kimi-Linear, Kimi-K2): content, then a section
  `<|tool_calls_section_begin|>` + per call `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}
  <|tool_call_end|>` + `<|tool_calls_section_end|>` (`<|tool_call_section_...|>` too). The id is the model's
  `functions.NAME:IDX`, the name its part between `.` and `:`.
- kimi_k3: think channel `...<|close|>think<|sep|>` (thinking on: the prompt opened it), then
  `[<|open|>response<|sep|>]TEXT<|close|>response<|sep|>`, optionally `<|open|>tools<|sep|>` + per call
  `<|open|>call tool="NAME" index="N"<|sep|>` + per argument `<|open|>argument key="K" type="T"<|sep|>VALUE
  <|close|>argument<|sep|>` (a string raw, any other type JSON) or one `<|open|>json type="object"<|sep|>{JSON}
  <|close|>json<|sep|>` + `<|close|>call<|sep|>`, then `<|close|>tools<|sep|>`, and `<|close|>message<|sep|>`.
  Attribute values escape `&` and `"`. Ids are vLLM's random `chatcmpl-tool-...`.

A call is emitted whole once it is complete and its arguments are a JSON object (auto formats). Malformed output
(a call whose arguments are not a JSON object, a call or section never closed, stray text inside a section) comes
back as content, as written, and is logged; calls that were complete stay calls. A named function's arguments
stream as they come (the grammar holds them to its schema); "required" answers are a JSON array of
{"name", "parameters"}, each call emitted when its object is complete.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass

log = logging.getLogger(__name__)

TOOL_PARSERS = ("kimi_k2", "kimi_k3")
REASONING_PARSERS = ("kimi_k3",)
K2_SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
K2_SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
K2_CALL_BEGIN, K2_ARG_BEGIN, K2_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
K2_ID = re.compile(r"\s*([^<]+:\d+)\s*$")  # vLLM's id shape: functions.NAME:IDX (or NAME:IDX)
K3_THINK_OPEN, K3_THINK_CLOSE = "<|open|>think<|sep|>", "<|close|>think<|sep|>"
K3_RESPONSE_OPEN, K3_RESPONSE_CLOSE = "<|open|>response<|sep|>", "<|close|>response<|sep|>"
K3_TOOLS_OPEN, K3_TOOLS_CLOSE = "<|open|>tools<|sep|>", "<|close|>tools<|sep|>"
K3_MESSAGE_CLOSE = "<|close|>message<|sep|>"
K3_CALL_OPEN, K3_CALL_CLOSE = "<|open|>call", "<|close|>call<|sep|>"
K3_SEP, K3_OPEN = "<|sep|>", "<|open|>"
K3_ATTR = re.compile(r'(\w+)="([^"]*)"')
# the special tokens each parser reads: a tokenizer without them cannot be served with it
PARSER_TOKENS = {"kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", K2_CALL_BEGIN, K2_ARG_BEGIN,
                             K2_CALL_END),
                 "kimi_k3": ("<|open|>", "<|close|>", "<|sep|>")}


@dataclass
class Call:
    index: int
    id: str
    name: str
    arguments: str


def random_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's id for calls whose format carries none


def held(buf: str, markers) -> int:
    """Length of the longest tail of buf that is a proper prefix of a marker: it may become one."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:n]):
                best = n
                break
    return best


def first(buf: str, markers, start: int = 0) -> tuple[int, str | None]:
    """The earliest marker in buf[start:] -> (position, marker), or (-1, None)."""
    best = (-1, None)
    for m in markers:
        i = buf.find(m, start)
        if i != -1 and (best[0] == -1 or i < best[0]):
            best = (i, m)
    return best


def _stray(s: str, marks) -> str:
    """The text of s before its next marker, or all of it but a marker's possible start; whitespace before a
    marker is the format's own (dropped), so a trailing run waits to see what follows it."""
    j, _ = first(s, marks)
    return (s[:j] if j != -1 else s[:len(s) - held(s, marks)]).rstrip()


def _json_object(text: str) -> dict | None:
    try:
        v = json.loads(text)
    except ValueError:
        return None
    return v if isinstance(v, dict) else None


class _Calls:
    """Numbering of a stage's calls; parallel_tool_calls false keeps only the first (vLLM's filter)."""

    def __init__(self, parallel: bool):
        self.n, self.parallel = 0, parallel

    def emit(self, id_: str, name: str, arguments: str) -> list:
        if self.n and not self.parallel:
            log.info("parallel_tool_calls is false: dropped the answer's call %d (%s)", self.n, name)
            self.n += 1
            return []
        self.n += 1
        return [("call", Call(self.n - 1, id_, name, arguments))]


class K2Tools:
    """kimi_k2: content around one tool-call section."""

    def __init__(self, parallel: bool = True):
        self.buf, self.in_section = "", False
        self.pending = ""  # the section's begin marker until a call shows it was structure (content if not)
        self.calls = _Calls(parallel)

    def feed(self, text: str) -> list:
        self.buf += text
        out = []
        while True:
            if not self.in_section:
                i, m = first(self.buf, K2_SECTION_BEGIN)
                if m is None:
                    keep = held(self.buf, K2_SECTION_BEGIN)
                    out.append(("content", self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                out.append(("content", self.buf[:i]))
                self.buf, self.in_section, self.pending = self.buf[i + len(m):], True, m
                continue
            body = self.buf.lstrip()
            lead = len(self.buf) - len(body)
            end = next((m for m in K2_SECTION_END if body.startswith(m)), None)
            if end is not None:
                self.buf, self.in_section, self.pending = body[len(end):], False, ""
                continue
            if body.startswith(K2_CALL_BEGIN):
                j, m = first(body, (K2_CALL_END, K2_CALL_BEGIN, *K2_SECTION_END), len(K2_CALL_BEGIN))
                if m is None:
                    return out  # the call is still arriving
                if m != K2_CALL_END:  # another call or the section's end before this one closed
                    out += self._bad(body[:j], "a tool call without <|tool_call_end|>")
                    self.buf = body[j:]
                    continue
                out += self._call(body[:j + len(m)])
                self.buf = body[j + len(m):]
                continue
            marks = (K2_CALL_BEGIN, *K2_SECTION_END)
            if not body or held(body, marks) == len(body):
                return out  # whitespace, or the start of a marker
            stray = _stray(body, marks)
            out += self._bad(self.buf[:lead] + stray, "text inside the tool-call section")
            self.buf = body[len(stray):]

    def _call(self, raw: str) -> list:
        head, sep, rest = raw[len(K2_CALL_BEGIN):].partition(K2_ARG_BEGIN)
        idm = K2_ID.match(head) if sep else None
        args = rest[:-len(K2_CALL_END)].strip()
        if idm is None or _json_object(args) is None:
            return self._bad(raw, "a tool call whose id is not NAME:IDX" if idm is None else
                             "a tool call whose arguments are not a JSON object")
        self.pending = ""
        fid = idm.group(1).strip()
        return self.calls.emit(fid, fid.split(":")[0].split(".")[-1], args)

    def _bad(self, raw: str, what: str) -> list:
        raw, self.pending = self.pending + raw, ""
        log.warning("kimi_k2 tool parser: %s; returned as content: %r", what, raw[:200])
        return [("content", raw)]

    def finish(self) -> list:
        out, buf = [], self.buf
        self.buf = ""
        if self.in_section:
            if (self.pending + buf).strip():
                out += self._bad(buf, "a tool-call section never closed")
            else:
                log.warning("kimi_k2 tool parser: the tool-call section was never closed (its calls were whole)")
        elif buf:
            out.append(("content", buf))
        return out


def _attrs(s: str) -> dict[str, str]:
    return {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in K3_ATTR.findall(s)}


def k3_arguments(body: str) -> dict | None:
    """A call's body (its argument elements, or one json block) -> its arguments, None if malformed."""
    args, i = {}, 0
    while True:
        while i < len(body) and body[i].isspace():
            i += 1
        if i == len(body):
            return args
        for tag in ("argument", "json"):
            if body.startswith(f"{K3_OPEN}{tag}", i):
                break
        else:
            return None
        head_end = body.find(K3_SEP, i)
        close = f"<|close|>{tag}{K3_SEP}"
        val_end = body.find(close, head_end + len(K3_SEP)) if head_end != -1 else -1
        if val_end == -1:
            return None
        attrs, value = _attrs(body[i + len(K3_OPEN) + len(tag):head_end]), body[head_end + len(K3_SEP):val_end]
        i = val_end + len(close)
        if tag == "json":
            obj = _json_object(value)
            if obj is None or args:
                return None
            args.update(obj)
            continue
        if "key" not in attrs:
            return None
        if attrs.get("type", "string") == "string":
            args[attrs["key"]] = value
        else:
            try:
                args[attrs["key"]] = json.loads(value)
            except ValueError:
                return None


class K3Channels:
    """kimi_k3 after the think channel: the response channel's text as content, the tools channel's calls."""
    BODY_ENDS = (K3_RESPONSE_CLOSE, K3_TOOLS_OPEN, K3_MESSAGE_CLOSE)

    def __init__(self, parse_tools: bool = True, parallel: bool = True, new_id=random_id):
        self.buf, self.state, self.parse_tools, self.new_id = "", "start", parse_tools, new_id
        self.calls, self.pending = _Calls(parallel), ""  # pending: the tools channel's open marker (as in K2Tools)

    def feed(self, text: str) -> list:
        self.buf += text
        out = []
        while True:
            b = self.buf
            if self.state == "start":  # the response channel's open marker, if the model wrote it
                s = b.lstrip()
                if s.startswith(K3_RESPONSE_OPEN):
                    self.buf, self.state = s[len(K3_RESPONSE_OPEN):], "body"
                elif not s or (K3_RESPONSE_OPEN.startswith(s)):
                    return out
                else:
                    self.state = "body"
                continue
            if self.state == "body":
                ends = self.BODY_ENDS if self.parse_tools else (K3_RESPONSE_CLOSE, K3_MESSAGE_CLOSE)
                i, m = first(b, ends)
                if m is None:
                    keep = held(b, ends)
                    out.append(("content", b[:len(b) - keep]))
                    self.buf = b[len(b) - keep:]
                    return out
                out.append(("content", b[:i]))
                self.buf = b[i + len(m):]
                self.state = {K3_RESPONSE_CLOSE: "between", K3_TOOLS_OPEN: "tools", K3_MESSAGE_CLOSE: "end"}[m]
                self.pending = m if m == K3_TOOLS_OPEN else ""
                continue
            if self.state in ("between", "end"):
                marks = (K3_TOOLS_OPEN, K3_MESSAGE_CLOSE) if self.state == "between" and self.parse_tools else (
                    K3_MESSAGE_CLOSE,)
                s = b.lstrip()
                m = next((x for x in marks if s.startswith(x)), None)
                if m is not None:
                    self.buf, self.pending = s[len(m):], m if m == K3_TOOLS_OPEN else ""
                    self.state = "tools" if m == K3_TOOLS_OPEN else "end"
                    continue
                if not s or held(s, marks) == len(s):
                    return out
                out += self._stray(b, s, marks, "text after the response channel")
                continue
            # tools channel
            s = b.lstrip()
            if s.startswith(K3_TOOLS_CLOSE):
                self.buf, self.state, self.pending = s[len(K3_TOOLS_CLOSE):], "between", ""
                continue
            if s.startswith(K3_MESSAGE_CLOSE):  # the channel ended with its message: lenient
                log.warning("kimi_k3 tool parser: the tools channel ended without <|close|>tools<|sep|>")
                self.buf, self.state, self.pending = s[len(K3_MESSAGE_CLOSE):], "end", ""
                continue
            if s.startswith(K3_CALL_OPEN):
                j = s.find(K3_CALL_CLOSE)
                nxt, _ = first(s, (K3_CALL_OPEN, K3_TOOLS_CLOSE, K3_MESSAGE_CLOSE), len(K3_CALL_OPEN))
                if nxt != -1 and (j == -1 or nxt < j):
                    out += self._bad(s[:nxt], "a tool call without <|close|>call<|sep|>")
                    self.buf = s[nxt:]
                    continue
                if j == -1:
                    return out
                out += self._call(s[:j + len(K3_CALL_CLOSE)])
                self.buf = s[j + len(K3_CALL_CLOSE):]
                continue
            marks = (K3_CALL_OPEN, K3_TOOLS_CLOSE, K3_MESSAGE_CLOSE)
            if not s or held(s, marks) == len(s):
                return out
            out += self._stray(b, s, marks, "text inside the tools channel")

    def _stray(self, b: str, s: str, marks, what: str) -> list:
        """Stray text (s: b without its leading whitespace) as content, logged; the buffer goes on after it."""
        stray = _stray(s, marks)
        self.buf = s[len(stray):]
        return self._bad(b[:len(b) - len(s)] + stray, what)

    def _call(self, raw: str) -> list:
        head_end = raw.find(K3_SEP)
        attrs = _attrs(raw[len(K3_CALL_OPEN):head_end])
        args = k3_arguments(raw[head_end + len(K3_SEP):-len(K3_CALL_CLOSE)])
        if not attrs.get("tool") or args is None:
            return self._bad(raw, "a tool call without a tool name" if not attrs.get("tool") else
                             "a tool call whose arguments do not parse")
        self.pending = ""
        return self.calls.emit(self.new_id(), attrs["tool"], json.dumps(args, ensure_ascii=False))

    def _bad(self, raw: str, what: str) -> list:
        raw, self.pending = self.pending + raw, ""
        log.warning("kimi_k3 tool parser: %s; returned as content: %r", what, raw[:200])
        return [("content", raw)]

    def finish(self) -> list:
        buf, self.buf = self.buf, ""
        if self.state in ("start", "body"):
            return [("content", buf)] if buf else []
        if self.state == "tools":
            if (self.pending + buf).strip():
                return self._bad(buf, "a tools channel never closed")
            log.warning("kimi_k3 tool parser: the tools channel was never closed (its calls were whole)")
            return []
        return self._bad(buf, "text after the response channel") if buf.strip() else []


class K3Reasoning:
    """kimi_k3 reasoning: with thinking, the answer starts inside the think channel (its prompt opened it); the
    reasoning runs to <|close|>think<|sep|>, the rest goes on. A think channel never closed is all reasoning."""

    def __init__(self, thinking: bool = True):
        self.buf, self.state = "", "think" if thinking else "rest"
        self.started = False

    def feed(self, text: str) -> list:
        if self.state == "rest":
            return [("text", text)]
        self.buf += text
        if not self.started:  # a repeated open marker at the start is not reasoning
            s = self.buf
            if K3_THINK_OPEN.startswith(s):
                return []
            if s.startswith(K3_THINK_OPEN):
                self.buf = s[len(K3_THINK_OPEN):]
            self.started = True
        i = self.buf.find(K3_THINK_CLOSE)
        if i == -1:
            keep = held(self.buf, (K3_THINK_CLOSE,))
            out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            return [("reasoning", out)]
        out = [("reasoning", self.buf[:i]), ("text", self.buf[i + len(K3_THINK_CLOSE):])]
        self.buf, self.state = "", "rest"
        return out

    def finish(self) -> list:
        buf, self.buf = self.buf, ""
        return [("reasoning", buf)] if buf else []


class NamedCall:
    """tool_choice naming a function: the whole answer is its arguments (JSON, held to its schema)."""

    def __init__(self, name: str, new_id=random_id):
        self.name, self.new_id, self.started = name, new_id, False

    def feed(self, text: str) -> list:
        if not text:
            return []
        if not self.started:
            self.started = True
            return [("call", Call(0, self.new_id(), self.name, text))]
        return [("args", 0, text)]

    def finish(self) -> list:
        return []


class RequiredCalls:
    """tool_choice "required": a JSON array of {"name", "parameters"}; each call emitted when its object is whole."""

    def __init__(self, parallel: bool = True, new_id=random_id):
        self.buf, self.state, self.new_id = "", "open", new_id
        self.calls = _Calls(parallel)
        self.dec = json.JSONDecoder()

    def feed(self, text: str) -> list:
        self.buf += text
        closed = "}" in text  # an object can only have become whole if its closing brace just came
        out = []
        while True:
            s = self.buf.lstrip()
            if self.state == "bad" or not s:
                return out
            if self.state == "open":
                if s[0] != "[":
                    return self._bad(out)
                self.buf, self.state = s[1:], "item"
            elif self.state == "item":
                if s[0] == "]" and not self.calls.n:
                    return self._bad(out)
                if s[0] != "{":
                    return self._bad(out)
                if not closed:
                    return out
                try:
                    obj, end = self.dec.raw_decode(s)
                except ValueError:
                    return out  # not whole yet (or never: finish() says so)
                name, params = obj.get("name"), obj.get("parameters")
                if not isinstance(name, str) or not isinstance(params, dict):
                    return self._bad(out)
                out += self.calls.emit(self.new_id(), name, json.dumps(params, ensure_ascii=False))
                self.buf, self.state = s[end:], "next"
            elif self.state == "next":
                if s[0] not in ",]":
                    return self._bad(out)
                self.buf, self.state = s[1:], "item" if s[0] == "," else "done"
            else:  # after the array: only whitespace
                return self._bad(out)

    def _bad(self, out: list) -> list:
        self.state = "bad"
        return out

    def finish(self) -> list:
        buf, self.buf = self.buf, ""
        if self.state == "done" and not buf.strip():
            return []
        log.warning("tool_choice \"required\": the answer is not a whole JSON array of calls; the rest is returned "
                    "as content: %r", buf[:200])
        return [("content", buf)] if buf else []


class Reply:
    """One choice's parser: reasoning stage (or none), then a tool stage (or none)."""

    def __init__(self, reasoning=None, tools=None):
        self.reasoning, self.tools = reasoning, tools

    def _tools(self, pieces: list, final: bool) -> list:
        out = []
        for p in pieces:
            if p[0] != "text":
                out.append(p)
            elif self.tools is not None:
                out += self.tools.feed(p[1])
            else:
                out.append(("content", p[1]))
        if final and self.tools is not None:
            out += self.tools.finish()
        return [p for p in out if not (p[0] in ("content", "reasoning") and p[1] == "")]

    def feed(self, text: str) -> list:
        return self._tools(self.reasoning.feed(text) if self.reasoning else [("text", text)], False)

    def finish(self) -> list:
        return self._tools(self.reasoning.finish() if self.reasoning else [], True)


def make_reply(tool_parser: str | None, reasoning_parser: str | None, tool_choice: str, parallel: bool = True,
               name: str | None = None, thinking: bool = True, new_id=random_id) -> Reply | None:
    """The parser one choice needs, None when its text goes out as it is. tool_choice: "none" | "auto" | "required"
    | "named" (as tools.ToolRequest.choice); "required" with the kimi_k3 parser is read as auto; "none" reads no
    calls (kimi_k2: the text as it is, as vLLM; K3: its channel markers still come off)."""
    k3 = tool_parser == "kimi_k3" or reasoning_parser == "kimi_k3"
    reasoning = K3Reasoning(thinking) if reasoning_parser == "kimi_k3" else None
    if tool_choice == "named":
        tools = NamedCall(name, new_id)
    elif tool_choice == "required" and tool_parser != "kimi_k3":
        tools = RequiredCalls(parallel, new_id)
    elif tool_choice in ("auto", "required") and tool_parser == "kimi_k2":
        tools = K2Tools(parallel)
    elif k3:  # calls read with the kimi_k3 parser; without, the channel markers still come off the content
        tools = K3Channels(tool_choice in ("auto", "required") and tool_parser == "kimi_k3", parallel, new_id)
    else:
        tools = None
    if reasoning is None and tools is None:
        return None
    return Reply(reasoning, tools)


def join(pieces: list) -> dict:
    """The whole message from its pieces: {"reasoning": str | None, "content": str, "tool_calls": [...]}."""
    reasoning, content, calls = [], [], {}
    for p in pieces:
        if p[0] == "reasoning":
            reasoning.append(p[1])
        elif p[0] == "content":
            content.append(p[1])
        elif p[0] == "call":
            calls[p[1].index] = Call(p[1].index, p[1].id, p[1].name, p[1].arguments)
        else:
            calls[p[1]].arguments += p[2]
    return {"reasoning": "".join(reasoning) if reasoning else None, "content": "".join(content),
            "tool_calls": [calls[i] for i in sorted(calls)]}


def delta(pieces: list) -> dict:
    """One stream chunk's delta from its pieces (OpenAI's shape; reasoning under vLLM's old and new names)."""
    d: dict = {}
    r = "".join(p[1] for p in pieces if p[0] == "reasoning")
    c = "".join(p[1] for p in pieces if p[0] == "content")
    if r:
        d["reasoning_content"] = d["reasoning"] = r
    if c:
        d["content"] = c
    calls = []
    for p in pieces:
        if p[0] == "call":
            calls.append({"index": p[1].index, "id": p[1].id, "type": "function",
                          "function": {"name": p[1].name, "arguments": p[1].arguments}})
        elif p[0] == "args":
            calls.append({"index": p[1], "function": {"arguments": p[2]}})
    if calls:
        d["tool_calls"] = calls
    return d


def tool_call_json(c: Call) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def check_tokens(tokenizer, tool_parser: str | None, reasoning_parser: str | None, k3_template: bool = False) -> None:
    """At start: the parsers' (and K3's format's) markers must be special tokens of the model's tokenizer, or the
    model could not write them (a ConfigError naming the missing ones)."""
    from ..config import ConfigError
    from .k3_chat import CONTROL
    need = {}
    for flag, name in (("--tool-call-parser", tool_parser), ("--reasoning-parser", reasoning_parser)):
        if name is not None:
            need[f"{flag} {name}"] = PARSER_TOKENS[name]
    if k3_template:
        need["Kimi K3's chat format"] = CONTROL
    for who, tokens in need.items():
        missing = [t for t in tokens if special_id(tokenizer, t) is None]
        if missing:
            raise ConfigError(f"{who} reads the special tokens {', '.join(missing)}, which the model's tokenizer "
                              f"({getattr(tokenizer, 'kind', type(tokenizer).__name__)}) does not have")


def special_id(tokenizer, text: str) -> int | None:
    """The id of a special token's spelling: Kimi's tokenizer names them (token_id); others encode it as one
    special id."""
    if hasattr(tokenizer, "token_id"):
        return tokenizer.token_id(text)
    ids = tokenizer.encode(text)
    return ids[0] if len(ids) == 1 and ids[0] in getattr(tokenizer, "special_ids", ()) else None
