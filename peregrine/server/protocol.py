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
return_token_ids (adds choices[].token_ids), logit_bias, response_format / structured_outputs (structured.py:
SamplingParams.logit_bias / .guided), and in chat tools / tool_choice / parallel_tool_calls (tools.py).
Rejected with 400 because ignoring them would change what the client gets:
best_of other than n, suffix, functions, tools in /v1/completions, vLLM's old guided_* fields, echo in chat,
more than one prompt.
Benchmarks only: forced_tokens (completions; a server started with --allow-forced-replies), the token ids the
reply must be, whatever the model says (bench serve --workload agent); without that flag a request carrying it
is a 400 naming it.
Any other unknown field (user, metadata, store, service_tier, ...) is ignored.
Every string of the request must be valid Unicode: a lone surrogate (JSON "\\ud800") is a 400.
Every number must be one the engine can carry: a float field that is not finite (NaN and Infinity, which
Python's JSON parser accepts, or 1e400) or whose integer overflows a float, an integer outside its range
(seed: int64, and seed + n - 1 too), is a 400 naming the field. An unknown model is a 404
(code "model_not_found"), as OpenAI and vLLM answer it.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

from ..engine.logprobs import MAX_LOGPROBS
from ..engine.penalties import PENALTY_RANGE
from ..engine.request import INT64, MAX_STOP_TOKEN_IDS, RequestError, SamplingParams
from .errors import APIError, HugeInt, bad, error_body  # noqa: F401  (re-exported: the server's modules import them here)

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DEFAULT_TEMPERATURE = 1.0       # OpenAI's default: clients wanting greedy pass temperature=0
MAX_N = 16                      # choices per request: each runs as its own sequence (a slot and its blocks)
MAX_STOP_STRINGS = 16           # OpenAI allows 4; lm-eval tasks pass a few more



def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return _is_int(x) or isinstance(x, float)


def _number(body: dict, key: str, default: float) -> float:
    """A float setting: a JSON number that is finite as a float (not NaN / Infinity / 1e400, nor an integer
    too large for a float)."""
    v = body.get(key)
    if v is None:
        return float(default)
    if not _is_num(v):
        raise bad(f"'{key}' is out of range: {v!r}" if isinstance(v, HugeInt) else f"'{key}' must be a number, got {v!r}",
                  key)
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise bad(f"'{key}' must be a finite number, got {_short(v)}", key)
    return f


def _short(v) -> str:
    """A value for a message: a huge integer by its size, not its digits."""
    if _is_int(v) and abs(v) > 10**30:
        return f"an integer of {len(str(abs(v)))} digits"
    return repr(v)


def _get(body: dict, key: str, check, what: str, default=None):
    v = body.get(key)
    if v is None:
        return default
    if not check(v):
        raise bad(f"'{key}' is out of range: {v!r}" if isinstance(v, HugeInt) else f"'{key}' must be {what}, got {v!r}",
                  key)
    return v


def _int_or_huge(s: str):
    return int(s) if len(s) <= HugeInt.MAX_DIGITS else HugeInt(len(s.lstrip("-")))


def parse_json(raw: bytes):
    """The request body as JSON, or a 400: not JSON, or nested deeper than the parser can go. NaN and
    Infinity (which Python's parser accepts) come through as floats: the fields refuse them by name."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise bad("request body is nested too deeply to parse") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"request body is not valid JSON: {e}") from None
    except ValueError as e:  # an integer past Python's conversion limit: parse again, marking it
        try:
            return json.loads(raw, parse_int=_int_or_huge)
        except (ValueError, RecursionError):
            raise bad(f"request body is not valid JSON: {e}") from None


def _reject_unsupported(body: dict, chat: bool) -> None:
    def off(key, ok):
        v = body.get(key)
        if v is not None and not ok(v):
            raise bad(f"'{key}'={v!r} is not supported by this server", key)
    off("best_of", lambda v: v == (body.get("n") or 1))
    if chat:
        off("echo", lambda v: v is False)
    off("suffix", lambda v: v == "")
    if not chat:
        for k in ("tools", "tool_choice", "parallel_tool_calls", "functions"):
            if body.get(k) is not None:
                raise bad(f"'{k}' is taken by /v1/chat/completions only", k)


_NUMBERS = frozenset((int, float, bool, type(None)))  # JSON values with no string inside


def check_unicode(v, path: str = "") -> None:
    """Every string in the body must encode as UTF-8: JSON lets a lone surrogate through ("\\ud800").
    A walk with its own stack: a body nested as deep as the parser allows cannot overflow Python's."""
    todo = [(v, path)]
    while todo:
        v, path = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad(f"'{path or 'body'}' is not valid Unicode text: it holds a lone surrogate "
                          f"U+{ord(v[e.start]):04X} at character {e.start}",
                          path.split(".")[0].split("[")[0] or None) from None
        elif isinstance(v, dict):
            for k, x in reversed(v.items()):
                todo.append((x, f"{path}.{k}" if path else str(k)))
                todo.append((k, path))
        elif isinstance(v, list) and not _NUMBERS.issuperset(map(type, v)):  # a prompt of token ids: no look
            todo.extend((x, f"{path}[{i}]") for i, x in reversed(list(enumerate(v))) if isinstance(x, (str, dict, list)))


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
    forced_tokens: list[int] | None = None  # benchmarks only: the reply's tokens (--allow-forced-replies)
    tools: object = None          # chat: tools.ToolRequest (tools, tool_choice, parallel_tool_calls)
    thinking: bool = True         # chat: the template opened a think channel (Kimi K3; its reasoning parser reads it)


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
        raise bad(f"'{key}' must be in [0, {MAX_LOGPROBS}], got {_short(k)}", key)
    return on, k


def _forced_tokens(body, vocab_size: int, max_tokens: int, mt_key: str, logprobs_on: bool) -> list[int] | None:
    """The benchmark-only field forced_tokens (taken when _reject_unsupported let it through): None when absent,
    else its token ids, or a 400 naming it."""
    v = body.get("forced_tokens")
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(_is_int(t) for t in v):
        what = next((x for x in v if not _is_int(x)), None) if isinstance(v, list) and v else v
        raise bad(f"'forced_tokens' must be a non-empty list of integer token ids, got {_short(what)}"
                  f"{' in the list' if isinstance(v, list) and v else ''}", "forced_tokens")
    out = [t for t in v if not 0 <= t < vocab_size]
    if out:
        raise bad(f"'forced_tokens' ids must be in [0, {vocab_size}), got [{', '.join(map(_short, out[:5]))}]",
                  "forced_tokens")
    if len(v) > max_tokens:
        raise bad(f"'forced_tokens' has {len(v)} tokens but {mt_key} is {max_tokens}", "forced_tokens")
    if logprobs_on:
        raise bad("'forced_tokens' cannot be combined with logprobs (they would describe the model's draws, not "
                  "the forced tokens)", "forced_tokens")
    return list(v)


def parse_common(body, served_model: str, max_model_len: int, vocab_size: int,
                 prompt_ids_fn, default_max_tokens, chat: bool = False, defaults=None,
                 allow_forced: bool = False, guided_fn=None) -> ParsedRequest:
    """prompt_ids_fn(body) -> token ids; default_max_tokens(prompt_len) -> int;
    defaults: the model's GenerationConfig (temperature / top_p / top_k for requests that set none);
    allow_forced: the benchmark-only field forced_tokens is taken (serve --allow-forced-replies);
    guided_fn(body) -> GuidedDecoding | None: the output's constraint (default: response_format /
    structured_outputs; chat adds tool_choice's), asked after prompt_ids_fn."""
    from . import structured
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    check_unicode(body)
    model = _get(body, "model", lambda v: isinstance(v, str), "a string", served_model)
    if model != served_model:
        raise APIError(404, f"The model `{model}` does not exist: this server serves `{served_model}`", "model",
                       code="model_not_found")
    _reject_unsupported(body, chat)
    if body.get("forced_tokens") is not None and (chat or not allow_forced):
        raise bad("'forced_tokens' is taken by /v1/completions only" if allow_forced else
                  "'forced_tokens' is a benchmark-only field: this server was not started with --allow-forced-replies",
                  "forced_tokens")
    n = _get(body, "n", _is_int, "an integer", 1)
    if not 1 <= n <= MAX_N:
        raise bad(f"'n' must be in [1, {MAX_N}], got {_short(n)}", "n")
    echo = False if chat else _get(body, "echo", lambda v: isinstance(v, bool), "true or false", False)
    logprobs_on, top_k_lp = _logprobs(body, chat)
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    so = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = so.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad(f"'stream_options.include_usage' must be true or false, got {include_usage!r}", "stream_options")
    ids = prompt_ids_fn(body)
    pkey = "messages" if chat else "prompt"  # where the prompt came from
    if not ids:
        raise bad("prompt is empty: at least one token is needed", pkey)
    bad_ids = [t for t in ids if not 0 <= t < vocab_size]
    if bad_ids:
        raise bad(f"prompt token ids must be in [0, {vocab_size}), got [{', '.join(map(_short, bad_ids[:5]))}]", pkey)
    if len(ids) >= max_model_len:
        raise bad(f"prompt{' (the messages)' if chat else ''} is {len(ids)} tokens but the model's limit is "
                  f"{max_model_len} tokens (prompt plus at least one generated token)", pkey)
    mt_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, mt_key, _is_int, "an integer", None)
    if max_tokens is None:
        max_tokens = default_max_tokens(len(ids))
    echo_only = echo and max_tokens == 0
    if echo_only:
        max_tokens = 1  # the engine samples one token, which the answer leaves out
    if max_tokens <= 0:
        raise bad(f"'{mt_key}' must be >= 1 (0 only with echo), got {_short(max_tokens)}", mt_key)
    if len(ids) + max_tokens > max_model_len:
        raise bad(f"prompt ({len(ids)} tokens) plus {mt_key} ({_short(max_tokens)}) exceeds the model's limit of "
                  f"{max_model_len} tokens", mt_key)
    forced = _forced_tokens(body, vocab_size, 0 if echo_only else max_tokens, mt_key, logprobs_on)
    dflt = lambda key, fallback: fallback if defaults is None or getattr(defaults, key) is None else getattr(defaults, key)  # noqa: E731
    top_k = _get(body, "top_k", _is_int, "an integer (0 or -1 = off)", dflt("top_k", 0))
    stop_ids = _get(body, "stop_token_ids", lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
                    "a list of token ids", [])
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise bad(f"'stop_token_ids' has {len(stop_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are supported",
                  "stop_token_ids")
    seed = _get(body, "seed", _is_int, "an integer", None)
    if seed is not None and not INT64[0] <= seed <= INT64[1] - (n - 1):
        why = "" if n == 1 else f" (choice i samples with seed + i: seed + {n - 1} must fit too)"
        raise bad(f"'seed' must be in [-2^63, 2^63 - 1]{why}, got {_short(seed)}", "seed")
    min_tokens = _get(body, "min_tokens", _is_int, "an integer", 0)
    if not 0 <= min_tokens <= max_tokens:
        raise bad(f"'min_tokens' must be in [0, {mt_key}={max_tokens}], got {_short(min_tokens)}", "min_tokens")
    pen = {}
    for k in ("presence_penalty", "frequency_penalty"):
        pen[k] = _number(body, k, 0.0)
        if not PENALTY_RANGE[0] <= pen[k] <= PENALTY_RANGE[1]:
            raise bad(f"'{k}' must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}], got {pen[k]:g}", k)
    min_p = _number(body, "min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise bad(f"'min_p' must be in [0, 1], got {min_p:g}", "min_p")
    rep = _number(body, "repetition_penalty", 1.0)
    if rep <= 0:
        raise bad(f"'repetition_penalty' must be > 0 (1 = off), got {rep:g}", "repetition_penalty")
    if top_k < -1:
        raise bad(f"'top_k' must be >= 1, or 0 or -1 for off, got {_short(top_k)}", "top_k")
    params = SamplingParams(
        temperature=_number(body, "temperature", dflt("temperature", DEFAULT_TEMPERATURE)),
        top_p=_number(body, "top_p", dflt("top_p", 1.0)),
        top_k=0 if top_k == -1 else top_k, min_p=min_p, repetition_penalty=rep,
        seed=seed,
        max_tokens=max_tokens,
        stop_token_ids=list(stop_ids),
        ignore_eos=_get(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false", False),
        stop=_stop_strings(body), min_tokens=min_tokens, **pen,
        logprobs=top_k_lp if logprobs_on else None,
        prompt_logprobs=top_k_lp if (echo and logprobs_on) else None,
        logit_bias=structured.logit_bias(body), guided=(guided_fn or structured.guided)(body))
    try:  # the engine's own ranges (the one place they are kept), answered here with the field's name
        params.validate(vocab_size)
    except RequestError as e:
        raise bad(str(e), e.param) from None
    return ParsedRequest(ids, params, stream, include_usage,
                         _get(body, "return_token_ids", lambda v: isinstance(v, bool), "true or false", False), model,
                         n=n, echo=echo, echo_only=echo_only, logprobs=logprobs_on, top_logprobs=top_k_lp,
                         forced_tokens=forced)


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


def usage(prompt_len: int, n_out: int, cached: int = 0) -> dict:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache served (OpenAI
    sends it always, vLLM with --enable-prompt-tokens-details; aiperf and agent harnesses read it)."""
    return {"prompt_tokens": prompt_len, "completion_tokens": n_out, "total_tokens": prompt_len + n_out,
            "prompt_tokens_details": {"cached_tokens": cached}}


def now() -> int:
    return int(time.time())
