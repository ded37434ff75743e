"""Constrained output and logit_bias from a request (both endpoints), into SamplingParams.guided / .logit_bias.

- `response_format`: {"type": "text"} (nothing), {"type": "json_object"} (any JSON object), {"type": "json_schema",
  "json_schema": {"name", "schema", "strict"?, "description"?}} (the schema; strict or not, the output is held to
  it). Anything else is a 400 naming `response_format` (structural tags are not served).
- `structured_outputs` (vLLM's extra body): exactly one of `json` (a schema, or its JSON text), `regex`, `choice`
  (a non-empty list of strings), `grammar` (EBNF), `json_object` (true); vLLM's tuning keys (`whitespace_pattern`,
  `disable_any_whitespace`, `disable_additional_properties`, `disable_fallback`) are accepted and not used. A
  response_format other than text wins over it, as in vLLM.
- vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` are no longer read by vLLM
  (it ignores them now): here they are a 400 naming the field and its `structured_outputs` spelling, so a client
  never gets unconstrained output it believes constrained.
- `logit_bias`: {"token id": bias}, keys decimal token ids, biases numbers (the range, [-100, 100], and the ids are
  SamplingParams.validate's). An empty object is no bias.

Whether a schema, regex or grammar compiles is the engine's question (engine/guided.py): one that does not is a
400 naming the field it came from (GuidedDecoding.field).
"""
from __future__ import annotations

import json
import math

from ..engine.request import GuidedDecoding
from .errors import HugeInt, bad

KINDS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's structured_outputs constraints
TUNING = ("whitespace_pattern", "disable_any_whitespace", "disable_additional_properties", "disable_fallback",
          "backend")  # vLLM's options that change how, not what: accepted, not used
MAX_ID_DIGITS = 18  # longer keys are no vocabulary's ids (and past Python's int conversion limit past 4300)
OLD = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _schema(v, where: str, field: str):
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise bad(f"'{where}' is not valid JSON: {e}", field) from None
    if not isinstance(v, (dict, bool)):
        raise bad(f"'{where}' must be a JSON schema (an object), got {type(v).__name__}", field)
    return v


def response_format(body: dict) -> GuidedDecoding | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding("json_object", None, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad("'response_format' of type json_schema needs 'json_schema': {\"name\", \"schema\"}",
                      "response_format")
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise bad(f"'response_format.json_schema.strict' must be true or false, got {js['strict']!r}",
                      "response_format")
        if js.get("schema") is None:
            raise bad("'response_format.json_schema.schema' is missing: the JSON schema to hold the answer to",
                      "response_format")
        return GuidedDecoding("json", _schema(js["schema"], "response_format.json_schema.schema", "response_format"),
                              "response_format")
    raise bad(f"'response_format' must be {{\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}}, got {rf!r}",
              "response_format")


def structured_outputs(body: dict) -> GuidedDecoding | None:
    for old, new in OLD.items():
        if body.get(old) is not None:
            raise bad(f"'{old}' is vLLM's old spelling, which vLLM no longer reads: send "
                      f"\"structured_outputs\": {{\"{new}\": ...}}", old)
    so = body.get("structured_outputs")
    if so is None:
        return None
    if not isinstance(so, dict):
        raise bad(f"'structured_outputs' must be an object with one of {', '.join(KINDS)}, got {so!r}",
                  "structured_outputs")
    unknown = sorted(k for k in so if k not in KINDS and k not in TUNING and k != "structural_tag")
    if unknown:
        raise bad(f"'structured_outputs' has unknown key(s) {', '.join(unknown)}; it takes one of "
                  f"{', '.join(KINDS)}", "structured_outputs")
    if so.get("structural_tag") is not None:
        raise bad("'structured_outputs.structural_tag' is not supported by this server", "structured_outputs")
    given = [k for k in KINDS if so.get(k) is not None and so.get(k) is not False]
    if len(given) != 1:
        raise bad(f"'structured_outputs' must set exactly one of {', '.join(KINDS)}, got "
                  f"{', '.join(given) or 'none'}", "structured_outputs")
    k, v = given[0], so[given[0]]
    if k == "json":
        v = _schema(v, "structured_outputs.json", "structured_outputs")
    elif k == "json_object":
        if v is not True:
            raise bad(f"'structured_outputs.json_object' must be true, got {v!r}", "structured_outputs")
        v = None
    elif k == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(s, str) for s in v):
            raise bad("'structured_outputs.choice' must be a non-empty list of strings", "structured_outputs")
    elif not isinstance(v, str) or not v:
        raise bad(f"'structured_outputs.{k}' must be a non-empty string", "structured_outputs")
    return GuidedDecoding(k, v, "structured_outputs")


def guided(body: dict) -> GuidedDecoding | None:
    """response_format (other than text) wins over structured_outputs, as vLLM applies it."""
    so = structured_outputs(body)
    rf = response_format(body)
    return rf if rf is not None else so


def logit_bias(body: dict) -> dict[int, float] | None:
    lb = body.get("logit_bias")
    if lb is None:
        return None
    if not isinstance(lb, dict):
        raise bad(f"'logit_bias' must be an object of token id -> bias, got {lb!r}", "logit_bias")
    out = {}
    for k, v in lb.items():
        if not (k.isascii() and k.isdigit()):
            raise bad(f"'logit_bias' keys must be token ids (decimal integers as strings), got {k!r}", "logit_bias")
        if len(k) > MAX_ID_DIGITS:
            raise bad(f"'logit_bias' key {k[:24]}... ({len(k)} digits) is not a token id of this model", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or isinstance(v, HugeInt):
            raise bad(f"'logit_bias' values must be numbers, got {v!r} for {k}", "logit_bias")
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            raise bad(f"'logit_bias' values must be finite numbers, got {v!r} for {k}", "logit_bias")
        out[int(k)] = f
    return out or None
