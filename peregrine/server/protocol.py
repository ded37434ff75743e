"""OpenAI request parsing and response bodies.

Requests are parsed by hand (not by pydantic models) so every mistake answers
400 with a message naming the field, in OpenAI's error shape.

Supported: prompt (a string, token ids, or a one-element list of either),
messages, max_tokens / max_completion_tokens, temperature, top_p, seed, n=1,
stream, stream_options.include_usage, and the extensions top_k (-1 or 0 = off),
stop_token_ids, ignore_eos, return_token_ids (adds choices[].token_ids).
Rejected with 400 because ignoring them would change what the client gets:
n>1, best_of>1, stop strings, logprobs / top_logprobs, echo, suffix, non-zero
presence/frequency/repetition penalties, logit_bias, min_tokens>0, tools /
tool_choice / functions, response_format other than text, more than one prompt.
Any other unknown field (user, metadata, store, service_tier, ...) is ignored.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from ..engine.request import SamplingParams

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DEFAULT_TEMPERATURE = 1.0       # OpenAI's default: clients wanting greedy pass temperature=0


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return _is_int(x) or isinstance(x, float)


def _get(body: dict, key: str, check, what: str, default=None):
    v = body.get(key)
    if v is None:
        return default
    if not check(v):
        raise bad(f"'{key}' must be {what}, got {v!r}", key)
    return v


def _reject_unsupported(body: dict) -> None:
    def off(key, ok):
        v = body.get(key)
        if v is not None and not ok(v):
            raise bad(f"'{key}'={v!r} is not supported by this server", key)
    off("n", lambda v: v == 1)
    off("best_of", lambda v: v == 1)
    off("stop", lambda v: v == [] or v == "")
    off("logprobs", lambda v: v is False)
    off("top_logprobs", lambda v: v == 0)
    off("echo", lambda v: v is False)
    off("suffix", lambda v: v == "")
    for k in ("presence_penalty", "frequency_penalty"):
        off(k, lambda v: v == 0)
    off("repetition_penalty", lambda v: v == 1)
    off("logit_bias", lambda v: v == {})
    off("min_tokens", lambda v: v == 0)
    for k in ("tools", "functions"):
        off(k, lambda v: v == [])
    off("tool_choice", lambda v: v == "none")
    off("response_format", lambda v: isinstance(v, dict) and v.get("type") == "text")


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    model: str


def parse_common(body, served_model: str, max_model_len: int, vocab_size: int,
                 prompt_ids_fn, default_max_tokens) -> ParsedRequest:
    """prompt_ids_fn(body) -> token ids; default_max_tokens(prompt_len) -> int."""
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    model = _get(body, "model", lambda v: isinstance(v, str), "a string", served_model)
    if model != served_model:
        raise APIError(400, f"model '{model}' does not exist: this server serves '{served_model}'", "model",
                       code="model_not_found")
    _reject_unsupported(body)
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    so = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = so.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad(f"'stream_options.include_usage' must be true or false, got {include_usage!r}", "stream_options")
    ids = prompt_ids_fn(body)
    if not ids:
        raise bad("prompt is empty: at least one token is needed", "prompt")
    bad_ids = [t for t in ids if not 0 <= t < vocab_size]
    if bad_ids:
        raise bad(f"prompt token ids must be in [0, {vocab_size}), got {bad_ids[:5]}", "prompt")
    if len(ids) >= max_model_len:
        raise bad(f"prompt is {len(ids)} tokens but the model's limit is {max_model_len} tokens "
                  "(prompt plus at least one generated token)", "prompt")
    mt_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, mt_key, _is_int, "an integer", None)
    if max_tokens is None:
        max_tokens = default_max_tokens(len(ids))
    if max_tokens <= 0:
        raise bad(f"'{mt_key}' must be >= 1, got {max_tokens}", mt_key)
    if len(ids) + max_tokens > max_model_len:
        raise bad(f"prompt ({len(ids)} tokens) plus {mt_key} ({max_tokens}) exceeds the model's limit of "
                  f"{max_model_len} tokens", mt_key)
    top_k = _get(body, "top_k", _is_int, "an integer (0 or -1 = off)", 0)
    stop_ids = _get(body, "stop_token_ids", lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
                    "a list of token ids", [])
    params = SamplingParams(
        temperature=float(_get(body, "temperature", _is_num, "a number", DEFAULT_TEMPERATURE)),
        top_p=float(_get(body, "top_p", _is_num, "a number", 1.0)),
        top_k=0 if top_k == -1 else top_k,
        seed=_get(body, "seed", _is_int, "an integer", None),
        max_tokens=max_tokens,
        stop_token_ids=list(stop_ids),
        ignore_eos=_get(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false", False))
    return ParsedRequest(ids, params, stream, include_usage,
                         _get(body, "return_token_ids", lambda v: isinstance(v, bool), "true or false", False), model)


def completion_prompt_ids(body: dict, encode) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        return encode(p)
    if isinstance(p, list) and all(_is_int(t) for t in p):
        return list(p)
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        raise bad(f"only one prompt per request is supported, got {len(p)}", "prompt")
    raise bad(f"'prompt' must be a string or a list of token ids, got {type(p).__name__}", "prompt")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_len: int, n_out: int) -> dict:
    return {"prompt_tokens": prompt_len, "completion_tokens": n_out, "total_tokens": prompt_len + n_out}


def now() -> int:
    return int(time.time())
