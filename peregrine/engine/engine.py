"""The engine loop: admit → schedule → one forward → sample → stops → stream.

With speculative decoding on (peregrine/spec), a step whose decoding sequences got drafts is a
verify step instead: several tokens per sequence may be accepted, each checked for stops in order.

With prefill pieces, a prefill chunk scheduled beside running decodes does not hold them for its whole
forward: the chunk's rows run as their own forward, a few layers per engine step (as many as fit a time
budget, engine/pieces.py, or prefill_piece_layers), and every step between two pieces is a decode step of the
running requests (their cache entries are disjoint from the chunk's; the chunk's sequences are "in flight"
until its last piece).

With decode lookahead (engine/lookahead.py), a pure-decode step whose next step is certain launches
that next forward before reading its own tokens; the next step() then takes that forward's results
instead of scheduling one. Sampled rows keep it: a runner that can (the specialized one) draws their
tokens inside the step from StepInput.sampling, keyed by seed and position like the host sampler.

add_request/abort may come from other threads (the server's event loop) while step()
runs in the engine thread: they only touch a lock-guarded pending queue, drained at the
start of step() (or at once by abort() when no step is running).

One request's fault fails that request alone (finish_reason "error", RequestOutput.error says what): its
settings are checked when it is added (SamplingParams.validate), and an error raised while preparing its
row of a step (the batch's sampling and penalty tensors: the rows are then checked one by one, _drop_faulty),
drawing its token (the batch's draw is then redone row by row, _sample_each: a row's draw never depends on
its batch) or matching its stops and text (_accept_all) finishes it and the rest of the batch goes on. The
normal path pays nothing for this (try blocks only). An error no one row explains still raises from step().
"""
from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch.profiler

from ..cache import ModelCache
from ..config import INVARIANT_ALIGN, PREFILL_STEP_TOKENS, EngineConfig, ModelConfig
from ..decode.batch import StepInput, _to_device
from ..decode.head import draw
from ..host_memory import Trimmer
from ..prefix_cache import PrefixCache
from . import guided, logprobs, penalties
from .penalties import needs_processing
from .lookahead import Ahead, Readback, forced_input, next_decode_input
from .pieces import PIECE_MS, PieceSizer
from .request import RequestError, RequestOutput, SamplingParams, Sequence, StepInfo
from .sampling import sample
from .scheduler import Scheduler
from .stops import TextState

log = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 4096  # cap when the user sets none: keeps the block reservation per request modest
# block ends before a prompt's last one that keep a KDA snapshot too: the next turn may re-send this prompt without its
# last tokens (aiperf's trace replay drops a partial last block; a client trims a trailing message), and a fork inside
# the last blocks then still finds a state at most this many blocks back
TAIL_SNAPSHOT_BLOCKS = 1
CPU_PIECE_LAYERS = 6  # layers a prefill piece on the CPU, where pieces are not sized by time (steps independent of speed)


def _profiling() -> bool:
    return torch._C._autograd._profiler_enabled()


def _traced(name: str):
    """The method as a named host range in torch.profiler traces (profile_prefill's idle gaps name the
    ranges they fall in). Only while a profiler runs: record_function costs a few us a call even without one,
    and these run every decode step."""
    label = f"peregrine.{name}"

    def wrap(fn):
        def inner(*a, **k):
            if not _profiling():
                return fn(*a, **k)
            with torch.profiler.record_function(label):
                return fn(*a, **k)
        inner.__name__, inner.__doc__, inner.__wrapped__ = fn.__name__, fn.__doc__, fn
        return inner
    return wrap


class Inflight:
    """A prefill forward run in pieces: its rows, logits rows, planned snapshots, and the runner's
    advance() (None until the last piece returns the logits)."""

    def __init__(self, batch, last, snaps, advance, layers: int = 0):
        self.batch, self.last, self.snaps, self.advance = batch, last, snaps, advance
        self.seqs = {id(s) for s, _ in batch}
        self.tokens = sum(n for _, n in batch)
        self.left = layers  # layers not yet launched (a piece sized by time)
        self.prepared = False  # the drafter's per-request setup done (after the first piece's launch)


@dataclass
class StepPlan:
    """What one step runs, decided by the schedule phase; the launch phase fills in its speculation."""
    batch: list                # (sequence, tokens) rows of this step's forward (prefill pieces aside)
    ahead: Ahead | None        # the launch the previous step made for this batch (decode lookahead)
    num_live: int              # rows not finished since scheduling
    n_prefill: int             # prompt tokens this step computes (pieces included)
    n_decode: int              # decoding rows
    piece: bool                # a prefill chunk is in flight beside the batch
    verify_width: int = 1      # rows per sequence in the forward (k + 1 on a speculative step)
    drafted: int = 0           # speculative: drafted tokens verified this step
    accepted: int = 0          # of those, accepted


class LLMEngine:
    def __init__(self, runner, model_cfg: ModelConfig, engine_cfg: EngineConfig, cache: ModelCache, tokenizer=None):
        self.runner, self.model_cfg, self.engine_cfg, self.cache = runner, model_cfg, engine_cfg, cache
        self.tokenizer = tokenizer  # with one, outputs carry their text and stop strings work (stops.py)
        self.guides = None  # engine/guided.py's compiler, made at the first constrained request
        self.eos_ids = frozenset(model_cfg.eos_token_ids)  # any of them ends a generation
        if engine_cfg.max_model_len is None:
            engine_cfg.max_model_len = min(model_cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        self.max_model_len = engine_cfg.max_model_len
        if engine_cfg.max_num_batched_tokens is None:  # an engine not made by build_engine (which sizes it to memory)
            engine_cfg.max_num_batched_tokens = PREFILL_STEP_TOKENS[0]
        self.device = cache.latent.device
        self.prefix_cache = PrefixCache(cache.blocks, cache.block_size, getattr(cache, "num_snapshots", 0),
                                        needs_state=bool(model_cfg.kda_layers),
                                        enabled=getattr(engine_cfg, "enable_prefix_caching", False))
        self.invariant = bool(getattr(engine_cfg, "batch_invariant", False))
        self.scheduler = Scheduler(cache, engine_cfg.max_num_seqs, engine_cfg.max_num_batched_tokens, self.max_model_len,
                                   getattr(engine_cfg, "max_prefill_tokens_while_decoding", None), self.prefix_cache,
                                   align=INVARIANT_ALIGN if self.invariant else 1)
        self._lock = threading.Lock()        # guards the pending queues and the live-request table
        self._step_lock = threading.Lock()   # held while the engine state is being changed
        self._pending_add: list[Sequence] = []
        self._pending_abort: list[str] = []
        self._live: dict[str, Sequence] = {}  # every unfinished request, by id
        self._ids = itertools.count()
        self._seed_rng = random.Random(engine_cfg.seed)  # seeds for requests that set none
        self._unreturned: list[RequestOutput] = []        # abort outputs made outside step()
        self.last_step: StepInfo | None = None
        self.stats = {"steps_by_path": Counter(), "fallback_reasons": {}, "prompt_tokens": 0,
                      "generation_tokens": 0, "finished_requests": 0, "aborted_requests": 0, "failed_requests": 0,
                      "lookahead_steps": 0, "lookahead_discarded_tokens": 0,
                      "prefix_cache": self.prefix_cache.stats,
                      "step_kinds": {}}  # decode / prefill / mixed: steps, host seconds, prompt tokens
        # lookahead needs a runner whose argmax stays on the device and can feed the next step's ids
        self.lookahead = bool(getattr(engine_cfg, "decode_lookahead", True) and getattr(runner, "lookahead", False))
        # replay (benchmarks only): request id -> the tokens it must emit, whatever the model says; the model still
        # runs every step, so a drafter's acceptance on recorded text is measured at the engine's real cost. An
        # entry is dropped when its request ends (finished, aborted or failed: _finish, _fail)
        self.forced: dict[str, list[int]] = {}
        # sampled rows drawn inside the runner's step (its tokens stay on the device, so lookahead serves them
        # too); not yet under tensor parallel, whose other ranks would need the rows' settings sent along
        self.device_sampling = bool(getattr(runner, "device_sampler", False)) and getattr(engine_cfg, "tensor_parallel_size", 1) == 1
        # the last batch's sampling tensors, reused while it lasts: {T: tensors} (T = 1 a decode step's; a verify
        # step's each row's settings T times)
        self._sampling_key, self._sampling = None, {}
        self._sampling_top_k = False  # whether a sampled row of that batch uses top-k
        self._penalties: penalties.DevicePenalties | None = None  # made at the first penalised row served on the device
        self._ahead: Ahead | None = None  # the forward the last step launched for the next one
        pl = getattr(engine_cfg, "prefill_piece_layers", None)
        can = hasattr(runner, "forward_pieces") and getattr(engine_cfg, "tensor_parallel_size", 1) == 1
        timed = can and pl is None and self.device.type == "cuda"  # the CPU (tests) keeps a fixed size: no clock in it
        # the forward's yields: a layer each where the sizer runs as many of them a step as fit its budget
        self.piece_layers = (1 if timed else CPU_PIECE_LAYERS if pl is None else pl) if can else 0
        self.piece_sizer = PieceSizer(getattr(engine_cfg, "prefill_piece_ms", None) or PIECE_MS) if timed else None
        self._inflight: Inflight | None = None  # the prefill forward being run in pieces
        self.trimmer = Trimmer()
        self.stats["host_memory"] = self.trimmer.stats
        self.spec = None
        if getattr(engine_cfg, "speculative_config", None):
            self.enable_speculation(engine_cfg.speculative_config)

    def enable_speculation(self, spec_cfg, drafter=None, log=None) -> None:
        """Turn speculative decoding on (a SpeculativeConfig, its JSON or dict) or off (None).
        Call between steps: with requests running, drafts start at the next step."""
        from ..speculative.config import SpeculativeConfig
        cfg = SpeculativeConfig.parse(spec_cfg)
        if self.spec is not None:
            for seq in list(self._live.values()):
                self.spec.release(seq)
            self.spec.detach()
        if cfg is None:
            self.spec = None
            self.stats.pop("spec", None)
            return
        from ..speculative.decoder import SpecDecoder
        self.spec = SpecDecoder(self, cfg, drafter=drafter, log=log or logging.getLogger(__name__).info)
        self.stats["spec"] = dict(self.spec.stats, mean_acceptance_length=0.0)

    # ---- requests (any thread) ----
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    on_token: Callable[[RequestOutput], None] | None = None, forced: list[int] | None = None) -> str:
        """forced (benchmarks only): the tokens this request emits, whatever the model says (self.forced; at most
        max_tokens, each in the vocabulary); dropped when the request ends, however it ends."""
        V = self.model_cfg.vocab_size
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate(V)
        guide = None
        if params.guided is not None:
            if forced is not None:
                raise RequestError("forced_tokens cannot be combined with structured output", "forced_tokens")
            guide = self._guides().matcher(params.guided)  # compiled now: a grammar that cannot be is this request's 400
        prompt = prompt_token_ids.tolist() if hasattr(prompt_token_ids, "tolist") else list(prompt_token_ids)
        if not prompt:
            raise RequestError("prompt is empty: at least one token is needed")
        # the common case at C speed (a 32K prompt's per-token Python check was ~10 ms before its first kernel)
        ok = set(map(type, prompt)) == {int} and 0 <= min(prompt) and max(prompt) < V
        bad = [] if ok else [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise RequestError(f"prompt token ids must be ints in [0, {V}), got {bad[:5]}")
        if len(prompt) >= self.max_model_len:
            raise RequestError(f"prompt of {len(prompt)} tokens is too long: max_model_len is {self.max_model_len} "
                               "(prompt plus at least one generated token)")
        if forced is not None:
            forced = list(forced)
            if not forced or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V for t in forced):
                raise RequestError(f"forced tokens must be a non-empty list of ints in [0, {V})", "forced_tokens")
            if len(forced) > params.max_tokens:
                raise RequestError(f"{len(forced)} forced tokens but max_tokens is {params.max_tokens}", "forced_tokens")
        with self._lock:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._live:
                raise RequestError(f"duplicate request_id {rid!r}: a request with this id is still running")
            seq = Sequence(rid, prompt, params, on_token, seed)
            seq.guide = guide
            if self.tokenizer is not None:
                seq.text = TextState(self.tokenizer, params.stop)
            elif params.stop:
                raise RequestError("stop strings need the model's tokenizer, and this engine has none")
            if params.prompt_logprobs is not None and self.engine_cfg.tensor_parallel_size > 1:
                raise RequestError("prompt_logprobs (echo with logprobs) is not supported with tensor parallel yet")
            if not self.scheduler.can_ever_fit(seq):
                raise RequestError(f"request needs {self.scheduler.blocks_needed(seq)} cache blocks but the cache has "
                                   f"{self.cache.num_blocks} in total: lower max_tokens or the prompt length")
            self._live[rid] = seq
            if forced is not None:
                self.forced[rid] = forced
            self._pending_add.append(seq)
        return rid

    def _guides(self):
        """The grammar compiler over this engine's vocabulary (engine/guided.py), made at the first constrained
        request."""
        if self.guides is None:
            if self.tokenizer is None:
                raise RequestError("structured output needs the model's tokenizer, and this engine has none",
                                   "structured_outputs")
            from .guided import Guides
            self.guides = Guides(self.tokenizer, self.model_cfg.vocab_size, self.eos_ids)
        return self.guides

    def abort(self, request_id: str) -> bool:
        with self._lock:
            if request_id not in self._live:
                return False
            self._pending_abort.append(request_id)
        if self._step_lock.acquire(blocking=False):  # no step running: free now
            try:
                self._unreturned += self._drain()
            finally:
                self._step_lock.release()
        return True

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self.scheduler.waiting) + len(self._pending_add)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live) or self._inflight is not None  # an aborted in-flight chunk still holds its cache

    # ---- engine thread ----
    def _drain(self) -> list[RequestOutput]:
        """Move pending adds into the queue and carry out pending aborts (step lock held)."""
        with self._lock:
            adds, self._pending_add = self._pending_add, []
            aborts, self._pending_abort = self._pending_abort, []
        self.scheduler.waiting.extend(adds)
        outs = []
        for rid in aborts:
            seq = self._live.get(rid)
            if seq is None or seq.finished:
                continue
            seq.finish_reason = "abort"
            self.stats["aborted_requests"] += 1
            # a chunk in flight still has pieces to launch that write its blocks and slot: they are
            # given back when its last piece has run
            outs.append(self._finish(seq, [], release=not self._in_flight(seq)))
        return outs

    def _in_flight(self, seq: Sequence) -> bool:
        return self._inflight is not None and id(seq) in self._inflight.seqs

    def _finish(self, seq: Sequence, new: list[int], release: bool = True) -> RequestOutput:
        self._release(seq, release)
        return self._emit(seq, new)

    def _release(self, seq: Sequence, cache: bool = True) -> None:
        """An ended request's cache (unless a chunk in flight still needs it), drafter state and entries given back."""
        if cache:
            self.scheduler.remove(seq)
        if self.spec is not None:
            self.spec.release(seq)
        with self._lock:
            self._live.pop(seq.request_id, None)
            self.forced.pop(seq.request_id, None)

    def _emit(self, seq: Sequence, new: list[int]) -> RequestOutput:
        return self._notify(seq, seq.output(new))

    def _notify(self, seq: Sequence, out: RequestOutput) -> RequestOutput:
        if seq.on_token is not None:
            try:
                seq.on_token(out)
            except Exception:  # a user callback must never take the engine down
                log.exception("on_token callback of request %s raised", seq.request_id)
        return out

    def _fail(self, seq: Sequence, exc: BaseException) -> RequestOutput:
        """Finish one request because serving it raised (its own fault): its cache back, an output with
        finish_reason "error" (returned by this step), the rest of the batch untouched."""
        log.error("request %s failed: %s: %s", seq.request_id, type(exc).__name__, exc, exc_info=exc)
        seq.finish_reason, seq.error = "error", f"{type(exc).__name__}: {exc}"
        self.stats["failed_requests"] += 1
        self._release(seq, cache=not self._in_flight(seq))  # a chunk in flight gives its cache back after its last piece
        try:
            out = seq.output([])
        except Exception:  # its text or logprobs are what failed: the tokens alone
            out = RequestOutput(seq.request_id, seq.prompt_len, [], seq.output_token_ids, True, "error")
        out.error = seq.error
        self._unreturned.append(out)  # returned by this step (only step-lock holders touch the list)
        return self._notify(seq, out)

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        """min_tokens: an end or stop id can be token min_tokens + 1 at the earliest, a stop string's
        last token token min_tokens."""
        p = seq.params
        n_out = len(seq.token_ids) - seq.prompt_len
        if seq.guide is not None:  # the token must keep the output in its grammar; its end ends the request
            if not seq.guide.accept_token(tok):
                raise RuntimeError(f"token {tok} is outside the request's grammar")
            if seq.guide.is_terminated():
                return "stop"
        if n_out > p.min_tokens and ((not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids):
            return "stop"
        if seq.text is not None and seq.text.add(tok, may_stop=n_out >= p.min_tokens):
            return "stop"
        if n_out >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def step(self) -> list[RequestOutput]:
        outputs = self._step()
        self.trimmer.after_step(idle=not self.has_unfinished())  # the allocator's free pages back (host_memory.py)
        return outputs

    def _step(self) -> list[RequestOutput]:
        """One engine step in five phases: schedule (what runs), build and launch (a speculative verify,
        a plain step, or the next prefill piece), complete (tokens back from the device), accept (stops,
        text, outputs), account (statistics). A new step mode is one more branch of _launch."""
        with self._step_lock:
            outputs, self._unreturned = self._unreturned, []
            outputs += self._drain()
            t0 = time.perf_counter()
            plan = self._plan()
            if plan is None:
                return outputs
            new, path = self._launch(plan)
            n_new = self._accept_all(new, outputs)
            self._account(plan, path, n_new, time.perf_counter() - t0)
            if self._unreturned:  # requests this step failed (_fail)
                outputs, self._unreturned = outputs + self._unreturned, []
            return outputs

    def _plan(self) -> StepPlan | None:
        """Schedule: the batch a lookahead launch already runs, else the scheduler's; prefill rows beside
        running decodes split off into pieces. None when there is nothing to run."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and all(s.finished for s, _ in ahead.batch):  # all stopped or aborted since
            self.stats["lookahead_discarded_tokens"] += len(ahead.batch)
            ahead = None
        batch = ahead.batch if ahead is not None else self._schedule()
        self._cache_ops([("load", snap, slot) for snap, slot in self.scheduler.take_loads()])
        n_prefill = 0
        if ahead is None and self._pieces_wanted(batch):
            pre = [(s, n) for s, n in batch if s.in_prefill]
            batch = [(s, n) for s, n in batch if not s.in_prefill]
            self._inflight = self._start_pieces(pre)
            n_prefill = sum(n for _, n in pre)
        if not batch and self._inflight is None:
            return None
        live = [(s, n) for s, n in batch if not s.finished]
        n_prefill += sum(n for s, n in live if s.in_prefill)
        n_decode = sum(1 for s, _ in live if not s.in_prefill)
        return StepPlan(batch, ahead, len(live), n_prefill, n_decode, piece=self._inflight is not None)

    def _launch(self, plan: StepPlan) -> tuple[list[tuple[Sequence, list[int]]], str]:
        """Build, launch and complete the step: -> (tokens per sequence, the path that ran)."""
        batch, ahead = plan.batch, plan.ahead
        spec = (self.spec.step(batch) if self.spec is not None and ahead is None and batch
                and not logprobs.wants_prompt_rows(batch) else None)  # prompt logprobs: every row's logits
        if spec is not None:
            new, path = self._verify(plan, *spec)
            return new + (self._advance_pieces() if plan.piece else []), path
        if batch:
            # with a chunk in flight its next piece is launched while the decode runs, before the
            # decode's tokens are read back (greedy decodes: the runner's argmax, copied out first)
            return self._plain_step(batch, ahead, during=self._advance_pieces if plan.piece else None)
        return self._advance_pieces(), "standard"

    def _verify(self, plan: StepPlan, step: StepInput, drafts, T: int) -> tuple[list[tuple[Sequence, list[int]]], str]:
        """A speculative step: every row's drafts verified in one forward, the accepted tokens back."""
        d0 = (self.spec.stats["num_draft_tokens"], self.spec.stats["num_accepted_tokens"])
        logits = self._forward(step, len(step.logits_idx))
        self.spec.prepare([s for s, _ in plan.batch if s.in_prefill])  # prefill rows beside the verify rows
        path = getattr(self.runner, "last_path", "standard")
        new = self.spec.finish(plan.batch, step, drafts, T, logits)
        self._after_forward(plan.batch, {}, {id(s): t[:-1] for s, t in new})  # t[:-1]: accepted drafts, now cached
        plan.verify_width = T
        plan.drafted = self.spec.stats["num_draft_tokens"] - d0[0]
        plan.accepted = self.spec.stats["num_accepted_tokens"] - d0[1]
        return new, path

    def _accept_all(self, new: list[tuple[Sequence, list[int]]], outputs: list[RequestOutput]) -> int:
        """Accept: each sequence's new tokens through its stops and text; -> tokens appended."""
        n_new = 0
        for seq, toks in new:
            if seq.finished:  # stopped or aborted after this forward was launched ahead (or failed this step)
                if seq.finish_reason != "error":
                    self.stats["lookahead_discarded_tokens"] += len(toks)
                continue
            try:
                out = self._accept(seq, toks)
            except Exception as e:  # its stops, text or logprobs: this request alone fails
                self._fail(seq, e)
                continue
            n_new += len(out.new_token_ids)
            outputs.append(out)
        return n_new

    def _account(self, plan: StepPlan, path: str, n_new: int, duration_s: float) -> None:
        """Statistics: steps by path and kind, tokens, the fallback reasons, the width chooser's timings."""
        self.stats["steps_by_path"][path] += 1
        self.stats["fallback_reasons"] = dict(getattr(self.runner, "fallback_reasons", {}))
        self.stats["prompt_tokens"] += plan.n_prefill
        self.stats["generation_tokens"] += n_new
        if self.spec is not None:
            self.stats["spec"] = dict(self.spec.stats, mean_acceptance_length=self.spec.mean_acceptance_length)
        self.last_step = StepInfo(plan.num_live, plan.n_prefill, plan.n_decode, path, duration_s, n_new,
                                  plan.drafted, plan.accepted, lookahead=plan.ahead is not None)
        kind = "decode" if not plan.n_prefill else ("prefill" if not plan.n_decode else "mixed")
        if plan.piece:
            kind = "decode + prefill piece" if plan.n_decode else "prefill pieces"
        # the width chooser learns from pure decode steps, but not from eager ones that record routing (benchmarks)
        if (self.spec is not None and kind == "decode" and plan.n_decode == len(plan.batch)
                and not getattr(self.runner, "record_routing", False)):
            self.spec.observe(len(plan.batch), plan.verify_width, 1e3 * duration_s)
        k = self.stats["step_kinds"].setdefault(kind, {"steps": 0, "seconds": 0.0, "prefill_tokens": 0})
        k["steps"] += 1
        k["seconds"] += duration_s
        k["prefill_tokens"] += plan.n_prefill

    # ---- prefill pieces: a chunk beside running decodes, a few layers per step ----
    def _pieces_wanted(self, batch) -> bool:
        """Whether this step's prefill rows should run in pieces: somebody decodes, and the rows'
        forward may be split (a runner that can). With speculation the decodes between pieces verify."""
        if not self.piece_layers or self._inflight is not None:
            return False
        return any(s.in_prefill for s, _ in batch) and any(not s.in_prefill for s, _ in batch)

    def _start_pieces(self, pre) -> Inflight:
        step, last, snaps = self._build_step(pre)
        return Inflight(pre, last, snaps, self.runner.forward_pieces(step, self.piece_layers),
                        len(getattr(getattr(self.runner, "model", None), "layers", ())))

    def _advance_pieces(self) -> list[tuple[Sequence, list[int]]]:
        """Launch the next piece (all the rest when nobody decodes any more); after the last one, the
        chunk's sequences are sampled like any step's, and aborted ones give their cache back."""
        fl = self._inflight
        decoding = any(not s.in_prefill and not s.finished for s in self.scheduler.running)
        sizer = self.piece_sizer
        n = sizer.layers(fl.tokens, fl.left) if sizer is not None and decoding else 1
        try:
            t0 = sizer.start(self.device) if sizer is not None else None
            out, ran = fl.advance(), 1
            while out is None and (ran < n or not decoding):
                out, ran = fl.advance(), ran + 1
            if sizer is not None:
                sizer.stop(t0, ran, fl.tokens)
                fl.left -= ran
            if self.spec is not None and not fl.prepared:  # while the GPU runs the piece, as a plain prefill's
                fl.prepared = True
                self.spec.prepare([s for s, _ in fl.batch if s.in_prefill])
        except BaseException:
            self._inflight = None  # as a failed forward of a plain step: nothing of it is kept
            raise
        if out is None:
            return []
        self._inflight = None
        logits = logprobs.split_prompt_rows(fl.batch, _rows(out, fl.last[-1] + 1), fl.last)
        new, _ = self._complete(fl.batch, logits, None, "standard", fl.snaps)
        for s, _ in fl.batch:
            if s.finished:  # aborted while in flight
                self.scheduler.remove(s)
        return new

    @_traced("schedule")
    def _schedule(self):
        # while a chunk is in flight only the running decodes are scheduled (its rows are mid-forward)
        return self.scheduler.schedule(prefill=self._inflight is None)

    @_traced("forward")
    def _forward(self, step: StepInput, rows: int):
        return _rows(self.runner.forward(step), rows)

    @_traced("build_step")
    def _build_step(self, batch) -> tuple[StepInput, list[int], dict]:
        """The forward's input for these rows: each sequence's scheduled tokens; the logits rows (None:
        each sequence's last token) and the planned KDA snapshots."""
        bs = self.cache.block_size
        seqs = []
        for seq, n in batch:
            start = seq.num_cached
            table = seq.blocks[: -(-(start + n) // bs)]  # only the blocks this step can touch
            seqs.append((seq.token_ids[start:start + n], start, seq.kda_slot, table))
        step = StepInput.build(seqs, bs, self.device)
        step.logits_idx, last = logprobs.prompt_rows(batch, self.device)
        if step.is_decode and step.logits_idx is None:
            self._device_plan(step, [s for s, _ in batch])
        return step, last, self._plan_snapshots(batch, step)

    def _device_plan(self, step: StepInput, seqs: list[Sequence]) -> bool:
        """Set step.sampling / .logprobs / .penalties for a decode step of these rows when the runner can draw
        them (some row samples, wants logprobs, is penalised or held by min_tokens; a min_tokens mask of more
        than MAX_BAN ids keeps the step on the host). -> whether set."""
        ps = [s.params for s in seqs]
        if not self.device_sampling or all(p.plain_greedy for p in ps):
            return False
        if any(p.min_tokens and len(penalties.ban_ids(p, self.eos_ids)) > penalties.MAX_BAN for p in ps):
            return False
        penalised = any(needs_processing(p) for p in ps)
        if penalised:
            if self._penalties is None:
                self._penalties = penalties.DevicePenalties(self.cache.num_slots, self.model_cfg.vocab_size, self.device)
            step.penalties = self._penalties.prepare(step, seqs, self.eos_ids)
        step.sampling = None if all(p.greedy for p in ps) and not penalised else self._sampling_for(seqs)
        step.sample_top_k = step.sampling is not None and self._sampling_top_k
        step.logprobs = any(p.logprobs is not None for p in ps)
        # a grammar's mask needs the tokens so far, all known now: filled after the launch, while the step runs
        step.defer_draw = any(s.guide is not None for s in seqs)
        step.logit_mask, step.logit_bias = self._constraints(seqs, self.device, masks=not step.defer_draw)
        return True

    def _deferred_draw(self, step: StepInput, seqs: list[Sequence], logits) -> None:
        """A step launched with its draw deferred (StepInput.defer_draw): the rows' grammar masks filled now, on the
        host, while the GPU runs the forward, then the draw (decode/head.py) queued behind it; its tokens and
        logprobs land where the runner's own would."""
        live = [s if not s.finished else None for s in seqs]  # a row that stopped since the launch: any token
        step.logit_mask = self._constraints(live, self.device, biases=False)[0]
        ids, lp = draw(logits, step)
        self.runner.greedy_tokens, self.runner.device_logprobs = ids, lp

    def _sampling_for(self, seqs: list[Sequence], T: int = 1):
        """StepInput.sampling for these rows, made once per batch composition (no per-step copies in steady
        decode); T > 1: a speculative verify step's, each sequence's settings repeated for its T token rows (made
        once per composition and T: the width chooser moves T from step to step)."""
        ps = [s.params for s in seqs]
        key = tuple(seqs)  # the sequences themselves (identity), so a reused id() cannot match a gone one
        if key != self._sampling_key:
            self._sampling = {}
            V = self.model_cfg.vocab_size  # does a sampled row use top-k (the sampler's top-k levels)?
            self._sampling_top_k = any(0 < p.top_k < V and not p.greedy for p in ps)
            self._sampling_key = key
        made = self._sampling.get(T)
        if made is None:
            col = lambda vals, dt: _to_device(torch.tensor([v for v in vals for _ in range(T)], dtype=dt),  # noqa: E731
                                              self.device)
            made = self._sampling[T] = (
                col([p.temperature for p in ps], torch.float32), col([p.top_k for p in ps], torch.int32),
                col([p.top_p for p in ps], torch.float32), col([p.min_p for p in ps], torch.float32),
                col([s.seed for s in seqs], torch.int64))
        return made

    def _plain_step(self, batch, ahead: Ahead | None = None, during=None) -> tuple[list[tuple[Sequence, list[int]]], str]:
        """One forward with each sequence's scheduled tokens (or the one the last step launched
        ahead); sample the sequences now fully cached. -> (sequence, tokens) rows and the path.
        during: called once, as early as the tokens allow (see _complete); its rows are added."""
        if ahead is None:
            try:
                step, last, snaps = self._build_step(batch)
            except Exception as e:  # a row's settings the batch's tensors cannot hold: that request fails
                batch = self._drop_faulty(batch, e)
                if not batch:
                    return (during() if during else []), "standard"
                step, last, snaps = self._build_step(batch)
            logits = logprobs.split_prompt_rows(batch, self._forward(step, last[-1] + 1), last)
            if self.spec is not None:  # the drafter's setup for new requests while their prefill runs
                self.spec.prepare([s for s, _ in batch if s.in_prefill])
            if step.defer_draw:  # the grammar masks filled while the forward runs, then the draw
                self._deferred_draw(step, [s for s, _ in batch], logits)
            greedy = getattr(self.runner, "greedy_tokens", None)  # tokens already taken inside the step
            path = getattr(self.runner, "last_path", "standard")
            planned = (step.sampling is not None or step.logprobs or step.logit_mask is not None
                       or step.logit_bias is not None)  # _device_plan set the step's draw
            device = (planned, getattr(self.runner, "device_logprobs", None))
        else:
            logits, greedy, path, device = ahead.logits, ahead.greedy, ahead.path, ahead.device
            if ahead.deferred is not None:  # its grammars now hold the last step's tokens: masks, then the draw
                self._deferred_draw(ahead.deferred, [s for s, _ in batch], logits)
                greedy, device = self.runner.greedy_tokens, (True, self.runner.device_logprobs)
            snaps = {}
        return self._complete(batch, logits, greedy, path, snaps, during, device)

    @_traced("complete")
    def _complete(self, batch, logits, greedy, path: str, snaps: dict, during=None,
                  device: tuple = (False, None)) -> tuple[list[tuple[Sequence, list[int]]], str]:
        """After a forward of `batch`: advance each sequence's cached count, keep the step's cache
        blocks and snapshots, and sample the sequences now fully cached. during (a prefill piece's
        launch): called once, after the on-device argmax's copy is queued and before it is waited for,
        so its GPU work queues behind this forward's while the host goes on; else after the tokens.
        greedy: the runner's on-device tokens (None: sample here); device: (whether the step drew its sampled rows
        and took its logprobs on the device (_device_plan), the runner's logprob tensors)."""
        ready = []  # rows whose sequence has every token in the cache: sample those
        for i, (seq, n) in enumerate(batch):
            seq.num_cached += n
            if seq.num_cached == len(seq.token_ids):
                ready.append(i)
        self._after_forward(batch, snaps)  # before a lookahead launch: its copies must run first
        extra = []
        if not ready:
            return (during() if during else []), path
        rs = [batch[i][0] for i in ready]
        planned, lp = device
        wants_lp = any(s.params.logprobs is not None for s in rs)
        on_device = all(s.params.plain_greedy for s in rs) or (planned and (lp is not None or not wants_lp))
        if greedy is not None and len(ready) == len(batch) and on_device:
            lp_back = [Readback(t) for t in lp] if wants_lp else None  # before a launch reuses the graph's buffers
            if self._can_look_ahead(rs):
                pending = Readback(greedy)  # queued before the next launch reuses the graph's output buffer
                self._ahead = self._launch_ahead(rs, greedy)
                toks = pending.tolist()     # waits for this step only; the next one is queued behind it
            elif during is not None:
                pending = Readback(greedy)  # in stream order, ahead of the piece
                extra, during = during(), None
                toks = pending.tolist()     # waits for the decode only
            else:
                toks = greedy.tolist()
            if lp_back is not None:
                logprobs.record_device(rs, toks, *(b.tolist() for b in lp_back))
        else:
            toks = self._sample(rs, logits if len(ready) == len(batch) else logits[ready])
        if during is not None:
            extra = during()
        return [(s, [t]) for s, t in zip(rs, toks)] + extra, path

    # ---- prefix caching: which block ends get a KDA snapshot, and the bookkeeping after a step ----
    def _plan_snapshots(self, batch, step: StepInput) -> dict:
        """Snapshot slots for this step's prefill rows: at every block-aligned chunk end, at the
        prompt's last block ends (floor(P/bs), floor((P-1)/bs) and TAIL_SNAPSHOT_BLOCKS more blocks back: what a
        longer, a repeated or a trimmed prompt can reuse) and where another prompt parts from this one (seq.snap_points: a fork point, or a
        prompt waiting to reuse this one's prefix, scheduler.py). Ends inside a chunk are taken by the KDA layers as they pass them
        (step.kda_snapshots); a chunk's own end after the forward. -> {row: [(position, snapshot)]}."""
        pc, bs = self.prefix_cache, self.cache.block_size
        plan, mid = {}, {}
        if not pc.enabled or not pc.needs_state:
            return plan
        for i, (seq, n) in enumerate(batch):
            if not seq.in_prefill:
                continue
            s, e, P = seq.num_cached, seq.num_cached + n, seq.prompt_len
            tail = P // bs * bs - TAIL_SNAPSHOT_BLOCKS * bs  # the block ends of the prompt's last blocks
            # in order of worth, for when the pool runs short: the chunk's end, the prompt's last block end, the fork
            # points, then the tail's earlier ends, deepest first
            want = dict.fromkeys(p for p in (e, (P - 1) // bs * bs, *seq.snap_points, *range(P // bs * bs, tail - 1, -bs))
                                 if s < p <= e and p % bs == 0 and p >= bs)
            got = []
            for p in want:
                snap = pc.new_snapshot()
                if snap is None:
                    break
                got.append((p, snap))
            for p, snap in sorted(got, key=lambda x: x[0]):
                plan.setdefault(i, []).append((p, snap))
                if p < e:
                    mid.setdefault(i, []).append((p - s, snap))
        step.kda_snapshots = mid or None
        return plan

    @_traced("after_forward")
    def _after_forward(self, batch, plan: dict, accepted: dict | None = None) -> None:
        """Register the full blocks the step completed and keep the KDA snapshots taken at block ends:
        the planned prefill ones, and one per decoding sequence as it passes a block end (replacing its
        previous one). Runs before the next forward is launched, so the copies see this step's state.
        accepted (a verify step): per sequence (id), the drafts it accepted, cached by this step but not yet
        in its token_ids; a block end passed before the last of them is snapshotted from the verify's checkpoint
        of that position (the slot holds the state after the last)."""
        pc, bs = self.prefix_cache, self.cache.block_size
        if not pc.enabled:
            return
        saves = []
        for i, (seq, n) in enumerate(batch):
            if seq.finished or not seq.blocks:
                for _, snap in plan.get(i, []):
                    pc.unplan(snap)
                continue
            acc = accepted.get(id(seq), ()) if accepted else ()
            toks = seq.token_ids
            if acc and (len(seq.block_hashes) + 1) * bs <= seq.num_cached:  # a block completed: its tokens whole
                toks = toks + list(acc)
            # batch-invariant mode keeps only blocks its prompt's prefill computed: a decoded token's latent and KDA
            # state are computed by the decode kernels, whose bits differ from a prefill of the same tokens
            done = min(seq.num_cached, seq.prompt_len) if self.invariant else seq.num_cached
            pc.register(seq.blocks, seq.block_hashes, toks, done, seq.prompt_hashes or ())
            if not pc.needs_state:
                continue
            for p, snap in plan.get(i, []):
                if p == seq.num_cached:
                    saves.append(("save", seq.kda_slot, snap))
                pc.attach(snap, seq.blocks[p // bs - 1])
            p = seq.num_cached
            q, start = p // bs * bs, p - (1 + len(acc) if accepted else n)
            if i in plan or start < seq.prompt_len or q <= start or self.invariant:
                continue  # a prefill row (its snapshots are planned, as far as the pool had slots), or no block end
                # passed by this decode step
            snap = pc.new_snapshot()
            if snap is None:
                continue
            if seq.decode_snap is not None:
                pc.drop(*seq.decode_snap)
            if q == p:
                saves.append(("save", seq.kda_slot, snap))
            else:  # inside a verify step: the state after that position, from the rollback checkpoint
                self.cache.save_checkpoint(self.spec.ckpt, i, q - start - 1, snap)
            seq.decode_snap = (snap, pc.block_of[snap]) if pc.attach(snap, seq.blocks[q // bs - 1]) else None
        self._cache_ops(saves)

    def _cache_ops(self, ops) -> None:
        """Snapshot copies on this rank's caches, and (tensor parallel) on every other rank's first."""
        if not ops:
            return
        send = getattr(self.runner, "cache_ops", None)
        if send is not None:
            send(ops)
        self.cache.apply(ops)

    def _can_look_ahead(self, seqs: list[Sequence]) -> bool:
        """Whether the next step is certainly these sequences again, one greedy decode token each,
        inside the blocks they own: then it may be launched before this step's tokens are read. With speculation,
        only where that step would be a plain one anyway (SpecDecoder.plain_next: asked last, it costs host time)."""
        if not self.lookahead or self.scheduler.admits_now():
            return False  # (a request that cannot start yet does not stop it)
        if self.forced and self.engine_cfg.tensor_parallel_size > 1 and any(s.request_id in self.forced for s in seqs):
            return False  # replay under TP: every rank takes its own argmax as the next input, not the recorded token
        if len(seqs) != len(self.scheduler.running) or any(s.finished for s in seqs):
            return False  # a sequence stopped or was aborted since this step was launched
        with self._lock:
            if self._pending_add or self._pending_abort:  # a new request's prefill joins the next step
                return False
        bs = self.cache.block_size
        for s in seqs:
            n = len(s.token_ids) + 1  # tokens once this step's token is appended
            if n - s.prompt_len >= s.params.max_tokens or n >= self.max_model_len or n > len(s.blocks) * bs:
                return False  # stops at this step for length, or the next write would leave its blocks
        return self.spec is None or self.spec.plain_next(seqs)

    def _launch_ahead(self, seqs: list[Sequence], greedy) -> Ahead:
        step = next_decode_input(seqs, greedy, self.cache.block_size, self.device)
        if self.forced:  # replay: a forced row's next input is its recorded token, written over the device's
            rows = [(i, f[at]) for i, s in enumerate(seqs) if (f := self.forced.get(s.request_id)) is not None
                    and (at := len(s.token_ids) - s.prompt_len) < len(f)]
            if rows:
                step.input_ids = forced_input(greedy, rows)
        planned = self._device_plan(step, seqs)  # (penalties count step.input_ids: the forced tokens)
        logits = self._forward(step, len(seqs))
        self.stats["lookahead_steps"] += 1
        return Ahead([(s, 1) for s in seqs], logits, getattr(self.runner, "greedy_tokens", None),
                     getattr(self.runner, "last_path", "standard"),
                     (planned, getattr(self.runner, "device_logprobs", None)), step if step.defer_draw else None)

    @_traced("sample")
    def _sample(self, seqs: list[Sequence], logits) -> list[int]:
        """A token per row; a row whose own draw raises fails its request (its token is then -1, never
        accepted: the request is finished)."""
        try:
            # each draw keyed by (seed, the position of the token drawn): len(token_ids) before it is appended
            toks = sample(penalties.process(self._constrain(logits, seqs), seqs, self.eos_ids), [s.params for s in seqs],
                          [s.seed for s in seqs], [len(s.token_ids) for s in seqs])
            logprobs.record(seqs, logits, toks)  # raw logits: the model's distribution
        except Exception as e:
            return self._sample_each(seqs, logits, e)
        return toks

    def _sample_each(self, seqs: list[Sequence], logits, exc: Exception) -> list[int]:
        """After the batch's draw raised: each row drawn alone, which gives the token the batch would have
        (a draw depends on its row's logits, settings, seed and position only) and nothing is kept from the
        failed attempt (penalties work on a copy, logprobs are recorded after the draw). The rows that raise
        alone fail their requests; if none does, the batch's error was nobody's: logged, and every row goes on."""
        toks, failed = [], []
        for i, s in enumerate(seqs):
            row = logits[i:i + 1]
            try:
                t = sample(penalties.process(self._constrain(row, [s]), [s], self.eos_ids), [s.params], [s.seed],
                           [len(s.token_ids)])
                logprobs.record([s], row, t)
                toks.append(t[0])
            except Exception as e:
                failed.append((s, e))
                toks.append(-1)
        if not failed:
            log.error("a batch's draw raised but each of its %d rows drew alone", len(seqs), exc_info=exc)
        for s, e in failed:
            self._fail(s, e)
        return toks

    def _constrain(self, logits, seqs):
        """The host draw's logits with each row's logit_bias and grammar mask (engine/guided.py); the input itself
        when no row has either."""
        mask, bias = self._constraints(seqs, logits.device)
        return logits if mask is None and bias is None else guided.apply(logits, mask, bias)

    def _constraints(self, seqs, device, masks: bool = True, biases: bool = True) -> tuple:
        """(the rows' token bitmasks [R, V/32] or None, their (bias ids, values) or None) on `device`: each grammar's
        mask filled now, from the tokens accepted so far (masks / biases False: that one left None)."""
        mask = bias = None
        if masks and any(s is not None and s.guide is not None for s in seqs):
            host = torch.empty(len(seqs), guided.words(self.model_cfg.vocab_size), dtype=torch.int32,
                               pin_memory=device.type == "cuda")
            self.guides.fill([s.guide if s is not None else None for s in seqs], host)
            mask = host.to(device, non_blocking=True)
        if biases and any(s.params.logit_bias for s in seqs):
            bias = guided.bias_tensors([s.params.logit_bias for s in seqs], device)
        return mask, bias

    def _drop_faulty(self, batch, exc: Exception):
        """After building a step's input raised: the rows whose own settings cannot be prepared fail their
        requests (_row_fault) -> the rest of the batch, which the caller builds again (if that raises too, the
        error is the batch's and fails the step)."""
        faults = [(s, n, self._row_fault(s)) for s, n in batch]
        if all(f is None for _, _, f in faults):
            log.warning("building a step raised, and none of its %d rows alone: building it again (%s: %s)",
                        len(batch), type(exc).__name__, exc)
        for s, _, f in faults:
            if f is not None:
                self._fail(s, f)
        return [(s, n) for s, n, f in faults if f is None]

    def _row_fault(self, seq: Sequence) -> Exception | None:
        """Why this row alone cannot be prepared for a step, or None: its settings checked again (validate, which
        also puts equivalent spellings in their usual form) and made into the host tensors a step makes of them
        (sampling, penalties, seed, position, tokens). Only run after a batched build raised, so it costs
        nothing on the normal path."""
        p = seq.params
        try:
            p.validate(self.model_cfg.vocab_size)
            torch.tensor([p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty,
                          p.presence_penalty], dtype=torch.float32)
            torch.tensor([p.top_k], dtype=torch.int32)
            torch.tensor([seq.seed, len(seq.token_ids), seq.prompt_len + p.min_tokens], dtype=torch.int64)
            torch.tensor(penalties.ban_ids(p, self.eos_ids) + seq.token_ids, dtype=torch.long)
        except Exception as e:
            return e
        return None

    @_traced("accept")
    def _accept(self, seq: Sequence, toks: list[int]) -> RequestOutput:
        """Append the step's tokens up to the first stop; emit them (and finish the request if it stopped)."""
        f = self.forced.get(seq.request_id)
        if f is not None:  # replay: the recorded tokens at these positions (the caller caps max_tokens by them)
            at = len(seq.token_ids) - seq.prompt_len
            toks = [f[at + j] if at + j < len(f) else t for j, t in enumerate(toks)]
        kept = []
        for tok in toks:
            seq.token_ids.append(tok)
            kept.append(tok)
            seq.finish_reason = self._stop_reason(seq, tok)
            if seq.finished:
                self.stats["finished_requests"] += 1
                return self._finish(seq, kept)
        return self._emit(seq, kept)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run the prompts to completion; their output token ids, in prompt order. A request that failed
        (finish_reason "error") raises RuntimeError once all have finished."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        results: dict[str, list[int]] = {}
        errors: dict[str, str | None] = {}

        def done(out: RequestOutput) -> None:
            if out.finished:
                results[out.request_id] = out.output_token_ids
                if out.finish_reason == "error":
                    errors[out.request_id] = out.error

        ids: list[str] = []
        try:
            for p, sp in zip(prompts, plist):
                ids.append(self.add_request(p, sp, on_token=done))
        except RequestError:
            for i in ids:  # all or nothing
                self.abort(i)
            raise
        while any(i not in results for i in ids):
            if not self.has_unfinished():
                raise RuntimeError("engine has no unfinished requests but some outputs are missing")
            self.step()
        for n, i in enumerate(ids):
            if i in errors:
                raise RuntimeError(f"request {n} of {len(ids)} failed: {errors[i]}")
        return [results[i] for i in ids]


def _rows(logits, rows: int):
    if logits.shape[0] != rows:
        raise RuntimeError(f"runner returned logits for {logits.shape[0]} rows, expected {rows}")
    return logits
