"""A chat request's tools: `tools`, `tool_choice`, `parallel_tool_calls`, checked as vLLM checks them.

- `tools`: a non-empty list of {"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}};
  an empty list, a tool without a name or a non-object `parameters` is a 400 naming `tools`.
- `tool_choice`: "none", "auto" (the default when tools are given, "none" without), "required", or
  {"type": "function", "function": {"name": NAME}} naming one of the tools; any other value, a choice without
  tools, or a name not in `tools` is a 400 naming `tool_choice`. "auto" needs the server's
  --enable-auto-tool-choice and --tool-call-parser (vLLM's rule: without a parser the calls could not be read back).
- `parallel_tool_calls`: true (default) or false; false keeps the first call of an answer (vLLM's filter).

"required" and a named function are held to a JSON schema by guided decoding, as vLLM's JSON path builds it
(`guided_schema`): a named function's output is its `parameters` object (an object with no properties where the
tool declares none); "required" is an array of at least one {"name": one of the tools, "parameters": its
parameters}, each tool a branch of `anyOf`, the tools' `$defs` lifted to the top. Kimi K3's tool format is XTML,
not JSON, so with `--tool-call-parser kimi_k3` "required" is the template's instruction and the answer is read as
"auto" (vLLM without strict tool calling); a named function there is a 400 (vLLM needs structural tags for it).
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

from ..engine.request import GuidedDecoding
from .protocol import bad

log = logging.getLogger(__name__)
CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # vLLM's schema for a tool that declares no parameters


@dataclass
class ToolRequest:
    tools: list[dict] | None = None      # as sent (the template renders them)
    choice: str = "none"                 # "none" | "auto" | "required" | "named"
    name: str | None = None              # the named function
    parallel: bool = True
    names: list[str] = field(default_factory=list)
    k3: bool = False                     # the kimi_k3 tool parser: "required" is read as auto, not JSON-guided

    @property
    def parses_calls(self) -> bool:
        """The answer is read for tool calls (auto, or required read as auto)."""
        return self.choice in ("auto", "required")


def _tools(v) -> list[dict]:
    if not isinstance(v, list):
        raise bad(f"'tools' must be a list of {{'type': 'function', 'function': {{...}}}} objects, got {v!r}", "tools")
    if not v:
        raise bad("'tools' must not be an empty array: give at least one tool or leave the field out", "tools")
    for i, t in enumerate(v):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(f, dict) or t.get("type", "function") != "function":
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, ...}}}}", "tools")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise bad(f"tools[{i}].function.name must be a non-empty string", "tools")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise bad(f"tools[{i}].function.description must be a string", "tools")
    return v


def parse_tools(body: dict, auto_enabled: bool, k3: bool = False) -> ToolRequest:
    """auto_enabled: the server runs --enable-auto-tool-choice with a --tool-call-parser; k3: that parser is kimi_k3."""
    tools = _tools(body["tools"]) if body.get("tools") is not None else None
    if body.get("functions") is not None:
        raise bad("'functions' (OpenAI's deprecated function calling) is not supported: send 'tools'", "functions")
    par = body.get("parallel_tool_calls", True)
    if par is None:
        par = True
    if not isinstance(par, bool):
        raise bad(f"'parallel_tool_calls' must be true or false, got {par!r}", "parallel_tool_calls")
    tc = body.get("tool_choice")
    if tc is None:
        tc = "auto" if tools else "none"
    req = ToolRequest(tools=tools, parallel=par, names=[t["function"]["name"] for t in tools or ()], k3=k3)
    if tc == "none":
        return req
    if tools is None:
        raise bad("'tool_choice' needs 'tools': there is no tool to choose", "tool_choice")
    if isinstance(tc, dict):
        f = tc.get("function")
        name = f.get("name") if isinstance(f, dict) else None
        if tc.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise bad(f"'tool_choice' must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                      f"\"function\": {{\"name\": NAME}}}}, got {tc!r}", "tool_choice")
        if name not in req.names:
            raise bad(f"'tool_choice' names the function {name!r}, which is not in 'tools' "
                      f"({', '.join(map(repr, req.names))})", "tool_choice")
        if k3:
            raise bad("a named 'tool_choice' is not supported with --tool-call-parser kimi_k3 (K3 calls tools in "
                      "XTML, not JSON; vLLM needs strict tool calling for it): use \"auto\" or \"required\"",
                      "tool_choice")
        req.choice, req.name = "named", name
        return req
    if tc not in CHOICES:
        raise bad(f"'tool_choice' must be \"none\", \"auto\", \"required\" or a named function, got {tc!r}",
                  "tool_choice")
    if (tc == "auto" or (tc == "required" and k3)) and not auto_enabled:
        raise bad(f"tool_choice \"{tc}\"{' (the default when tools are given)' if 'tool_choice' not in body else ''} "
                  "needs a server started with --enable-auto-tool-choice and --tool-call-parser", "tool_choice")
    req.choice = tc
    return req


def guided_schema(req: ToolRequest) -> dict | None:
    """The JSON schema guided decoding holds a "required" or named-function answer to (None: not JSON-guided)."""
    params = {t["function"]["name"]: t["function"].get("parameters") for t in req.tools or ()}
    if req.choice == "named":
        return copy.deepcopy(params[req.name]) or dict(EMPTY_PARAMETERS)
    if req.choice != "required" or req.k3:
        return None
    defs: dict = {}
    branches = []
    for name, p in params.items():
        p = copy.deepcopy(p) if p else dict(EMPTY_PARAMETERS)
        for k, v in (p.pop("$defs", None) or {}).items():
            if k in defs and defs[k] != v:
                raise bad(f"tools define '$defs' entry {k!r} twice with different schemas; tool_choice \"required\" "
                          "needs one definition per name", "tools")
            defs[k] = v
        branches.append({"properties": {"name": {"type": "string", "enum": [name]}, "parameters": p},
                         "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if defs:
        schema["$defs"] = defs
    return schema


def guided(req: ToolRequest, body: dict, other: GuidedDecoding | None) -> GuidedDecoding | None:
    """The answer's constraint: a named function or "required" (JSON-guided) wins over response_format /
    structured_outputs (`other`), as vLLM's tool path replaces them; a named function beside structured_outputs
    is a 400 (vLLM: constraints or tools, not both)."""
    schema = guided_schema(req)
    if schema is None:
        return other
    if req.choice == "named" and body.get("structured_outputs") is not None:
        raise bad("'structured_outputs' cannot be combined with a named 'tool_choice': the answer is the function's "
                  "arguments", "tool_choice")
    if other is not None:
        log.info("tool_choice %s: the answer is held to the tools' schema; %s is not applied", req.choice, other.field)
    return GuidedDecoding("json", schema, "tool_choice")
