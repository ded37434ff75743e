"""OpenAI request parsing and response bodies.

Requests are parsed by hand (not by pydantic models) so every mistake answers
400 with a message naming the field, in OpenAI's error shape.

Supported: prompt (a string, token ids, or a one-element list of either),
messages, max_tokens / max_completion_tokens, temperature, top_p, seed, n (independent
choices; choice i samples with seed + i), stop (strings, also split over tokens),
logprobs (completions: an int; chat: true with top_logprobs), echo (completions; with
max_tokens 0 the prompt and its logprobs only, as lm-eval's loglikelihood asks),
presence_penalty / frequency_penalty, stream, stream_options.include_usage, and the
extensions top_k (-1 or 0 = off), min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
return_token_ids (adds choices[].token_ids).
Rejected with 400 because ignoring them would change what the client gets:
best_of other than n, suffix, logit_bias, tools / tool_choice /
functions, response_format other than text, echo in chat, more than one prompt.
Any other unknown field (user, metadata, store, service_tier, ...) is ignored.
Every string of the request must be valid Unicode: a lone surrogate (JSON "\\ud800") is a 400.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from ..engine.logprobs import MAX_LOGPROBS
from ..engine.penalties import PENALTY_RANGE
from ..engine.request import SamplingParams

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DEFAULT_TEMPERATURE = 1.0       # OpenAI's default: clients wanting greedy pass temperature=0
MAX_N = 16                      # choices per request: each runs as its own sequence (a slot and its blocks)
MAX_STOP_STRINGS = 16           # OpenAI allows 4; lm-eval tasks pass a few more


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


def _reject_unsupported(body: dict, chat: bool) -> None:
    def off(key, ok):
        v = body.get(key)
        if v is not None and not ok(v):
            raise bad(f"'{key}'={v!r} is not supported by this server", key)
    off("best_of", lambda v: v == (body.get("n") or 1))
    if chat:
        off("echo", lambda v: v is False)
    off("suffix", lambda v: v == "")
    v = body.get("logit_bias")
    if v is not None and v != {}:
        raise bad("'logit_bias' is not supported by this server: the decode step samples on the device from "
                  "per-request settings, and a per-token bias table is not one of them yet", "logit_bias")
    for k in ("tools", "functions"):
        off(k, lambda v: v == [])
    off("tool_choice", lambda v: v == "none")
    off("response_format", lambda v: isinstance(v, dict) and v.get("type") == "text")


def check_unicode(v, path: str = "") -> None:
    """Every string in the body must encode as UTF-8: JSON lets a lone surrogate through ("\\ud800")."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad(f"'{path or 'body'}' is not valid Unicode text: it holds a lone surrogate "
                      f"U+{ord(v[e.start]):04X} at character {e.start}", path.split(".")[0].split("[")[0] or None) from None
    elif isinstance(v, dict):
        for k, x in v.items():
            check_unicode(k, path)
            check_unicode(x, f"{path}.{k}" if path else str(k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            check_unicode(x, f"{path}[{i}]")


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    model: str
    n: int = 1
    echo: bool = False
    echo_only: bool = False       # echo with max_tokens 0: the prompt (and its logprobs), nothing generated
    logprobs: bool = False        # choices carry logprobs
    top_logprobs: int = 0


def _stop_strings(body) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
        raise bad(f"'stop' must be a string or a list of strings, got {v!r}", "stop")
    stops = [x for x in stops if x != ""] if isinstance(v, str) else stops
    if any(x == "" for x in stops):
        raise bad("'stop' strings must not be empty", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS} are supported", "stop")
    return stops


def _logprobs(body, chat: bool) -> tuple[bool, int]:
    """-> (logprobs on, alternatives per token). Completions: logprobs = k; chat: logprobs + top_logprobs."""
    lp = body.get("logprobs")
    if chat:
        on = _get(body, "logprobs", lambda v: isinstance(v, bool), "true or false", False)
        k = _get(body, "top_logprobs", _is_int, "an integer", None)
        if k is not None and not on:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        k = k or 0
        key = "top_logprobs"
    else:
        if lp is not None and (isinstance(lp, bool) or not _is_int(lp)):
            raise bad(f"'logprobs' must be an integer (alternatives per token) or null, got {lp!r}", "logprobs")
        on, k, key = lp is not None, lp or 0, "logprobs"
    if not 0 <= k <= MAX_LOGPROBS:
        raise bad(f"'{key}' must be in [0, {MAX_LOGPROBS}], got {k}", key)
    return on, k


def parse_common(body, served_model: str, max_model_len: int, vocab_size: int,
                 prompt_ids_fn, default_max_tokens, chat: bool = False, defaults=None) -> ParsedRequest:
    """prompt_ids_fn(body) -> token ids; default_max_tokens(prompt_len) -> int;
    defaults: the model's GenerationConfig (temperature / top_p / top_k for requests that set none)."""
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    check_unicode(body)
    model = _get(body, "model", lambda v: isinstance(v, str), "a string", served_model)
    if model != served_model:
        raise APIError(400, f"model '{model}' does not exist: this server serves '{served_model}'", "model",
                       code="model_not_found")
    _reject_unsupported(body, chat)
    n = _get(body, "n", _is_int, "an integer", 1)
    if not 1 <= n <= MAX_N:
        raise bad(f"'n' must be in [1, {MAX_N}], got {n}", "n")
    echo = False if chat else _get(body, "echo", lambda v: isinstance(v, bool), "true or false", False)
    logprobs_on, top_k_lp = _logprobs(body, chat)
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
    echo_only = echo and max_tokens == 0
    if echo_only:
        max_tokens = 1  # the engine samples one token, which the answer leaves out
    if max_tokens <= 0:
        raise bad(f"'{mt_key}' must be >= 1 (0 only with echo), got {max_tokens}", mt_key)
    if len(ids) + max_tokens > max_model_len:
        raise bad(f"prompt ({len(ids)} tokens) plus {mt_key} ({max_tokens}) exceeds the model's limit of "
                  f"{max_model_len} tokens", mt_key)
    dflt = lambda key, fallback: fallback if defaults is None or getattr(defaults, key) is None else getattr(defaults, key)  # noqa: E731
    top_k = _get(body, "top_k", _is_int, "an integer (0 or -1 = off)", dflt("top_k", 0))
    stop_ids = _get(body, "stop_token_ids", lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
                    "a list of token ids", [])
    min_tokens = _get(body, "min_tokens", _is_int, "an integer", 0)
    if not 0 <= min_tokens <= max_tokens:
        raise bad(f"'min_tokens' must be in [0, {mt_key}={max_tokens}], got {min_tokens}", "min_tokens")
    pen = {}
    for k in ("presence_penalty", "frequency_penalty"):
        pen[k] = float(_get(body, k, _is_num, "a number", 0.0))
        if not PENALTY_RANGE[0] <= pen[k] <= PENALTY_RANGE[1]:
            raise bad(f"'{k}' must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}], got {pen[k]:g}", k)
    min_p = float(_get(body, "min_p", _is_num, "a number", 0.0))
    if not 0 <= min_p <= 1:
        raise bad(f"'min_p' must be in [0, 1], got {min_p:g}", "min_p")
    rep = float(_get(body, "repetition_penalty", _is_num, "a number", 1.0))
    if rep <= 0:
        raise bad(f"'repetition_penalty' must be > 0 (1 = off), got {rep:g}", "repetition_penalty")
    if top_k < -1:
        raise bad(f"'top_k' must be >= 1, or 0 or -1 for off, got {top_k}", "top_k")
    params = SamplingParams(
        temperature=float(_get(body, "temperature", _is_num, "a number", dflt("temperature", DEFAULT_TEMPERATURE))),
        top_p=float(_get(body, "top_p", _is_num, "a number", dflt("top_p", 1.0))),
        top_k=0 if top_k == -1 else top_k, min_p=min_p, repetition_penalty=rep,
        seed=_get(body, "seed", _is_int, "an integer", None),
        max_tokens=max_tokens,
        stop_token_ids=list(stop_ids),
        ignore_eos=_get(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false", False),
        stop=_stop_strings(body), min_tokens=min_tokens, **pen,
        logprobs=top_k_lp if logprobs_on else None,
        prompt_logprobs=top_k_lp if (echo and logprobs_on) else None)
    return ParsedRequest(ids, params, stream, include_usage,
                         _get(body, "return_token_ids", lambda v: isinstance(v, bool), "true or false", False), model,
                         n=n, echo=echo, echo_only=echo_only, logprobs=logprobs_on, top_logprobs=top_k_lp)


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
