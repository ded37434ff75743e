"""vLLM's offline API: `from peregrine import LLM, SamplingParams`.

    llm = LLM(model="peregrine-tiny")
    outs = llm.generate(["rev:falcon|", "12+30="], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)

LLM builds the engine as `peregrine serve` does (the same options, by the same names), then runs every prompt of a
call as one continuously batched workload, with a progress line. `generate` takes text, token ids (a list of ints, or
{"prompt_token_ids": [...]}) or a list of them; `chat` a conversation (or a list of them) rendered by the model's chat
template, tools included. SamplingParams has vLLM's fields and defaults (temperature 1.0: set 0 for greedy); n > 1
choices are seeded seed, seed + 1, ... as the server seeds them, so a seeded request gets the server's answer.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field

from .engine.request import GuidedDecoding, RequestError
from .engine.request import SamplingParams as EngineParams

PROGRESS_EVERY_S = 0.5  # the progress line's refresh


@dataclass
class StructuredOutputsParams:
    """vLLM's structured_outputs: exactly one of json (a schema), regex, choice, grammar (EBNF) or json_object."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def guided(self) -> GuidedDecoding:
        set_ = {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, False)}
        if len(set_) != 1:
            raise RequestError(f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; got "
                               f"{sorted(set_) or 'none'}", "structured_outputs")
        (k, v), = set_.items()
        return GuidedDecoding("json_object" if k == "json_object" else k, None if k == "json_object" else v)


@dataclass
class SamplingParams:
    """vLLM's SamplingParams: its field names and defaults (those peregrine serves)."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    skip_special_tokens: bool = True

    def engine_params(self, index: int, max_tokens: int) -> EngineParams:
        """The engine's settings for choice `index` (its seed: seed + index, as the server seeds n > 1)."""
        so = self.structured_outputs
        if isinstance(so, dict):
            so = StructuredOutputsParams(**so)
        return EngineParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=None if self.seed is None else self.seed + index, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
            logit_bias={int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None,
            guided=None if so is None else so.guided())


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None     # the stop string or stop token that ended it (vLLM's)
    logprobs: list | None = None             # per token {token id: logprob} (the chosen one and the top)
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None


class LLM:
    """An engine for offline batches. Options: the engine's, with vLLM's names (model, max_model_len, max_num_seqs,
    max_num_batched_tokens, gpu_memory_utilization, kv_cache_dtype, tensor_parallel_size, enable_prefix_caching,
    dtype, seed, speculative_config, additional_config e.g. {"decode_backend": "latency_specialized"}), plus
    dummy_weights (seeded random weights) and quiet (no build log on stderr)."""

    def __init__(self, model: str = "peregrine-tiny", *, dummy_weights: bool = False, quiet: bool = False,
                 additional_config: dict | str | None = None, speculative_config=None, **engine_options):
        from .config import EngineConfig
        from .engine.build import build_engine
        from .speculative.config import SpeculativeConfig
        known = {f.name for f in dataclasses.fields(EngineConfig)} - {"extra", "speculative_config"}
        unknown = sorted(set(engine_options) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        ecfg = EngineConfig(**engine_options)
        if additional_config:
            ecfg.apply_additional_config(additional_config)
        ecfg.speculative_config = SpeculativeConfig.parse(speculative_config)
        ecfg.validate()
        log = (lambda m: None) if quiet else (lambda m: print(f"[peregrine] {m}", file=sys.stderr, flush=True))
        self.engine, self.tokenizer = build_engine(model, ecfg, dummy_weights=dummy_weights, log=log)
        self.model = model
        self._chat_template = None
        self._ids = 0

    # ---- prompts ----
    def _prompt_ids(self, p) -> tuple[str | None, list[int]]:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return None, list(p["prompt_token_ids"])
            p = p.get("prompt")
        if isinstance(p, str):
            return p, self.tokenizer.encode(p)
        if isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return None, list(p)
        raise TypeError(f"a prompt is a string, a list of token ids or {{'prompt_token_ids': [...]}}, got {type(p).__name__}")

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order (each with sampling_params.n choices)."""
        single = isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                      and all(isinstance(t, int) for t in prompts))
        prompts = [prompts] if single else list(prompts)
        return self._run([self._prompt_ids(p) for p in prompts], sampling_params, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, tools: list | None = None, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of them, rendered by the model's
        chat template (with `tools`, as the server renders them); the generated text is returned as is (the server's
        tool-call parsing is the server's)."""
        if not add_generation_prompt:
            raise ValueError("add_generation_prompt=False is not supported: the templates end on the assistant's turn")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tmpl = self._template()
        rows = []
        for conv in convs:
            try:
                ids = tmpl.prompt_ids(self.tokenizer, conv, tools, **(chat_template_kwargs or {}))
            except Exception as e:  # the server's 400 (a bad message or tool): the same message here
                raise ValueError(getattr(e, "message", str(e))) from None
            rows.append((None, ids))
        return self._run(rows, sampling_params, use_tqdm)

    def _template(self):
        if self._chat_template is None:
            from .config import resolve_model
            from .server.chat import ChatTemplate
            self._chat_template = ChatTemplate(resolve_model(self.model)[1], model_type=self.engine.model_cfg.model_type)
        return self._chat_template

    # ---- the batch ----
    def _run(self, rows, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        sps = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(rows)
        if len(sps) != len(rows):
            raise ValueError(f"{len(sps)} sampling_params for {len(rows)} prompts")
        e, limit = self.engine, self.engine.max_model_len
        results, done = [], {}
        ids = []
        try:
            for (text, prompt), sp in zip(rows, sps):
                out = RequestOutput(str(self._ids), text, prompt)
                self._ids += 1
                results.append(out)
                mt = sp.max_tokens if sp.max_tokens is not None else max(1, limit - len(prompt))
                for i in range(sp.n):
                    rid = f"{out.request_id}-{i}"
                    e.add_request(prompt, sp.engine_params(i, mt), rid,
                                  on_token=lambda o, out=out, i=i: o.finished and done.__setitem__((out.request_id, i), o))
                    ids.append(rid)
        except RequestError as err:
            for rid in ids:
                e.abort(rid)
            while e.has_unfinished():
                e.step()
            raise ValueError(str(err)) from None
        total, t0, last = len(ids), time.perf_counter(), 0.0
        while e.has_unfinished():
            e.step()
            now = time.perf_counter()
            if use_tqdm and now - last > PROGRESS_EVERY_S:
                last = now
                print(f"\rProcessed prompts: {len(done)}/{total} ({now - t0:.1f} s)", end="", file=sys.stderr, flush=True)
        if use_tqdm:
            print(f"\rProcessed prompts: {len(done)}/{total} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
        eos = set(e.model_cfg.eos_token_ids)
        for out, sp in zip(results, sps):
            for i in range(sp.n):
                o = done[(out.request_id, i)]
                if o.finish_reason == "error":
                    raise RuntimeError(f"request {out.request_id} choice {i} failed: {o.error}")
                out.num_cached_tokens = o.num_cached_tokens
                out.prompt_logprobs = o.prompt_logprobs
                out.outputs.append(self._completion(i, o, sp, eos))
        return results

    def _completion(self, i: int, o, sp: SamplingParams, eos: set) -> CompletionOutput:
        toks = o.output_token_ids
        stop_tok = toks[-1] if o.finish_reason == "stop" and toks and (toks[-1] in eos or toks[-1] in (sp.stop_token_ids or ())) \
            else None
        if o.text is not None:
            text = o.text
        else:
            shown = toks[:-1] if stop_tok is not None else toks
            if sp.skip_special_tokens:
                special = getattr(self.tokenizer, "special_ids", frozenset())
                shown = [t for t in shown if t not in special]
            text = self.tokenizer.decode(shown)
        lp = None
        if o.logprobs is not None:
            lp = [{x.token_id: x.logprob, **{t: v for t, v in x.top}} for x in o.logprobs]
        stop_reason = o.stop_str if getattr(o, "stop_str", None) else (stop_tok if stop_tok not in eos else None)
        return CompletionOutput(i, text, list(toks), o.finish_reason, stop_reason, lp,
                                sum(x.logprob for x in o.logprobs) if o.logprobs else None)
