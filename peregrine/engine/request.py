"""Requests as the user sees them (params, outputs) and as the engine tracks them (Sequence)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .logprobs import MAX_LOGPROBS
from .penalties import PENALTY_RANGE, needs_processing


class RequestError(ValueError):
    """A user mistake in a request; the message names the problem, `param` the setting (None: no one setting)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


INT64 = (-2**63, 2**63 - 1)  # a seed is an int64 on the device (the sampler keys its draws by it)
GREEDY_BELOW = 1e-5          # a temperature below this is greedy, as vLLM takes it (far below, logits / T overflow FP32)
MAX_TEMPERATURE = 1e6        # the sampler divides FP32 logits by the temperature: kept far inside FP32's range
REPETITION_RANGE = (1e-6, 1e6)  # repetition_penalty multiplies or divides FP32 logits: the same reason
MAX_STOP_TOKEN_IDS = 64      # stop_token_ids per request: each generated token is checked against them
MAX_STOP_CHARS = 256         # longest stop string: the text held back and searched per token grows with it
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: a bias outside it is a 400
MAX_LOGIT_BIAS = 1024        # biased tokens a request: OpenAI allows 300; the device table is sized by it
GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")  # vLLM's structured_outputs keys (+ json_object)


@dataclass(frozen=True)
class GuidedDecoding:
    """Constrained output (engine/guided.py compiles it with xgrammar): kind "json" (spec: a JSON schema, dict or
    string), "json_object" (any JSON object), "regex" (a pattern), "choice" (a list of strings), "grammar" (EBNF).
    field: the request field it came from, named in a 400 when it cannot be compiled."""
    kind: str
    spec: object = None
    field: str = "structured_outputs"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


@dataclass
class SamplingParams:
    temperature: float = 0.0      # 0 → greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 (or -1, vLLM's spelling) → off
    min_p: float = 0.0            # drop tokens below min_p × the most likely one's probability (0 → off)
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)  # stop strings: the text is cut before the first one
    min_tokens: int = 0             # end ids, stop ids and stop strings are held off until this many tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output (1 → off)
    logprobs: int | None = None     # logprob of each sampled token and this many alternatives (None: off)
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (greedy too)
    guided: GuidedDecoding | None = None  # the output constrained to a grammar (JSON schema, regex, choice, EBNF)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to do with the logits: the runner's on-device argmax is the token."""
        return (self.greedy and self.logprobs is None and not needs_processing(self) and self.guided is None
                and self.logit_bias is None)

    def validate(self, vocab_size: int) -> None:
        """Every setting in the range the engine's tensors and arithmetic can carry (RequestError names the one
        that is not); normalises equivalent spellings: top_k -1 or >= vocab_size (every token) to 0 (off), a
        temperature below GREEDY_BELOW to 0 (greedy)."""
        if not _is_num(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise RequestError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}",
                               "temperature")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise RequestError(f"top_k must be an int >= 1, or 0 or -1 for off, got {self.top_k!r}", "top_k")
        if self.top_k == -1 or self.top_k >= vocab_size:
            self.top_k = 0
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        lo, hi = REPETITION_RANGE
        if not _is_num(self.repetition_penalty) or not lo <= self.repetition_penalty <= hi:
            raise RequestError(f"repetition_penalty must be a number in [{lo:g}, {hi:g}] (1 = off), got "
                               f"{self.repetition_penalty!r}", "repetition_penalty")
        if self.seed is not None and (not _is_int(self.seed) or not INT64[0] <= self.seed <= INT64[1]):
            raise RequestError(f"seed must be an int in [-2^63, 2^63 - 1] or None, got {self.seed!r}", "seed")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}", "max_tokens")
        if not isinstance(self.stop_token_ids, (list, tuple)) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids", "stop_token_ids")
        bad = [t for t in self.stop_token_ids if not _is_int(t) or not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"stop_token_ids must be token ids in [0, {vocab_size}), got {bad[:5]}", "stop_token_ids")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(x, str) and x for x in self.stop):
            raise RequestError(f"stop must be a list of non-empty strings, got {self.stop!r}", "stop")
        long = [x for x in self.stop if len(x) > MAX_STOP_CHARS]
        if long:
            raise RequestError(f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of {len(long[0])}",
                               "stop")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
                               "min_tokens")
        for k in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, k)
            if not _is_num(v) or not PENALTY_RANGE[0] <= v <= PENALTY_RANGE[1]:
                raise RequestError(f"{k} must be a number in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}], got {v!r}", k)
        for k in ("logprobs", "prompt_logprobs"):
            v = getattr(self, k)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise RequestError(f"{k} must be an int in [0, {MAX_LOGPROBS}] or None, got {v!r}", k)
        if self.logit_bias is not None:
            lb = self.logit_bias
            lo, hi = LOGIT_BIAS_RANGE
            if not isinstance(lb, dict) or len(lb) > MAX_LOGIT_BIAS:
                raise RequestError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases", "logit_bias")
            for t, b in lb.items():
                if not _is_int(t) or not 0 <= t < vocab_size:
                    raise RequestError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {t!r}", "logit_bias")
                if not _is_num(b) or not lo <= b <= hi:
                    raise RequestError(f"logit_bias values must be numbers in [{lo:g}, {hi:g}], got {b!r} for {t}",
                                       "logit_bias")
            if not lb:
                self.logit_bias = None
        g = self.guided
        if g is not None and (not isinstance(g, GuidedDecoding) or g.kind not in GUIDED_KINDS):
            raise RequestError(f"guided must be a GuidedDecoding of kind {', '.join(GUIDED_KINDS)}, got {g!r}",
                               getattr(g, "field", "structured_outputs"))


@dataclass
class RequestOutput:
    request_id: str
    prompt_len: int
    new_token_ids: list[int]        # produced in this step
    output_token_ids: list[int]     # all produced so far (a stop/eos token is included)
    finished: bool
    finish_reason: str | None       # "stop" | "length" | "abort" | "error" (serving it failed: `error` says why)
    text_delta: str | None = None   # output text made final by this step (None: the engine has no tokenizer)
    text: str | None = None         # the whole output text, once finished (cut before a stop string)
    stop_str: str | None = None     # the stop string that ended it
    logprobs: list | None = None    # TokenLogprob of each of new_token_ids (when asked for)
    prompt_logprobs: list | None = None  # TokenLogprob of each prompt token (None first), with the first output
    error: str | None = None        # finish_reason "error": what failed while serving this request
    num_cached_tokens: int = 0      # prompt tokens reused from the prefix cache (vLLM's name; known once admitted)


@dataclass
class StepInfo:
    num_seqs: int
    num_prefill_tokens: int
    num_decode_seqs: int
    path: str
    duration_s: float
    num_new_tokens: int = 0          # tokens appended to sequences this step (> rows with speculation)
    num_draft_tokens: int = 0        # speculative: drafted tokens verified this step
    num_accepted_tokens: int = 0     # speculative: of those, accepted
    lookahead: bool = False          # this step's forward was launched by the step before (decode lookahead)


class Sequence:
    """Engine-side state of one request: tokens, cache placement, seed."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams,
                 on_token: Callable[[RequestOutput], None] | None, seed: int):
        self.request_id, self.params, self.on_token, self.seed = request_id, params, on_token, seed
        self.token_ids = list(prompt)
        self.prompt_len = len(prompt)
        self.num_cached = 0               # tokens already written to the caches
        self.kda_slot: int | None = None
        self.blocks: list[int] = []       # reserved for the whole life of the request (a reused prefix first)
        self.block_hashes: list[int] = []  # prefix-cache chain hash of each full cached block, in order
        self.prompt_hashes: list[int] | None = None  # the prompt's chain hashes as far as a lookup needed them
        self.decode_snap: tuple[int, int] | None = None  # (snapshot, block) of its latest decode-time snapshot
        self.num_cached_tokens = 0         # prompt tokens its admission reused from the prefix cache
        self.guide = None                  # its grammar's matcher (SamplingParams.guided; engine/guided.py)
        self.snap_points: set[int] = set()  # prompt positions (block ends) whose KDA state another prompt will reuse
        self.finish_reason: str | None = None
        self.error: str | None = None     # finish_reason "error": what failed (engine._fail)
        self.text = None                  # stops.TextState when the engine detokenizes
        self.pending_logprobs: list = []  # logprobs of sampled tokens not emitted yet
        self.prompt_logprobs: list | None = [None] * len(prompt) if params.prompt_logprobs is not None else None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def output(self, new: list[int]) -> RequestOutput:
        out = RequestOutput(self.request_id, self.prompt_len, list(new), self.output_token_ids,
                            self.finished, self.finish_reason, num_cached_tokens=self.num_cached_tokens)
        if self.text is not None:
            if self.finished:
                self.text.finish()
            out.text_delta = self.text.take()
            if self.finished:
                out.text, out.stop_str = self.text.text, self.text.stop_str
        if self.params.logprobs is not None:
            out.logprobs, self.pending_logprobs = self.pending_logprobs[:len(new)], []
        if self.prompt_logprobs is not None:
            out.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return out
