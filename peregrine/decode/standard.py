"""The standard runner: plain PyTorch ops, serves every step, the numerical oracle.

On a GPU, pure decode steps with B ≤ max_graph_batch are replayed from CUDA
graphs captured per (B, context bucket), so the baseline is not launch-bound.
"""
from __future__ import annotations

import time

import torch

from .. import kernels
from ..engine import guided
from ..engine.request import MAX_LOGIT_BIAS
from .batch import StepInput
from .capture import capture
from .head import draw
from .prefill_graphs import PrefillGraphs, unsupported


def context_bucket(blocks: int) -> int:
    """Round a block count up to a power of two: few graphs, at most 2x attention reads."""
    return 1 << max(0, blocks - 1).bit_length()


class GraphCache:
    """CUDA graphs of a decode step per (B, block bucket), over static input buffers.

    Warm-up and capture run with every static input pointing at the cache's scratch
    slot and block, so they never touch a live sequence's state.
    """

    def __init__(self, fn, cache, max_batch: int, log=None, fixed_blocks: int | None = None,
                 tokens_per_seq: int = 1, static_extra: dict | None = None, samples: bool = False):
        """fixed_blocks: one graph per B whose block tables span that many blocks (kernels whose grid
        does not depend on the context length); None: one graph per (B, power-of-two bucket).
        tokens_per_seq: T query tokens per sequence (speculative verify steps); static_extra: StepInput
        fields set on the static inputs (buffers the captured step reads in place). samples: fn draws a step's
        tokens with its StepInput.sampling (a row per token: B·T in a verify step), in graphs of their own."""
        self.fn, self.cache, self.max_batch, self.log = fn, cache, max_batch, log
        self.fixed_blocks = fixed_blocks
        self.T, self.static_extra = tokens_per_seq, static_extra or {}
        self.samples = samples  # fn draws the tokens of a step with sampling (StepInput.sampling): such steps get their own graphs
        self.pool = None  # one memory pool shared by every graph, made at the first capture
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.uses: dict[tuple[int, int], int] = {}
        self.capture_s = 0.0
        self.broken: str | None = None
        self.failed: dict[tuple, str] = {}  # variant keys whose capture failed: their steps run eagerly

    def _static(self, B: int, nb: int, sampled: bool = False, like: StepInput | None = None,
                constrained: bool = False, deferred: bool = False) -> StepInput:
        c, dev, T = self.cache, self.cache.latent.device, self.T
        long = lambda v, n=B: torch.full((n,), v, dtype=torch.long, device=dev)  # noqa: E731
        st = StepInput(
            input_ids=long(0, B * T), positions=long(0, B * T), slot_mapping=long(c.scratch_block * c.block_size, B * T),
            q_lens=[T] * B, context_lens=[T] * B, kda_slots=long(c.scratch_slot),
            block_tables=torch.full((B, nb), c.scratch_block, dtype=torch.long, device=dev),
            context_lens_t=torch.full((B,), T, dtype=torch.int32, device=dev), max_context=nb * c.block_size)
        for k, v in self.static_extra.items():
            setattr(st, k, v)
        f = lambda v, dt, n=B: torch.full((n,), v, dtype=dt, device=dev)  # noqa: E731
        if sampled:  # temperature, top_k, top_p, min_p, seed a token row (B·T: a verify step draws every position's
            # token, keyed by its position): every row greedy until run() copies a step's
            st.sampling = tuple(f(v, dt, B * T) for v, dt in ((0.0, torch.float32), (0, torch.int32),
                                                              (1.0, torch.float32), (0.0, torch.float32),
                                                              (0, torch.int64)))
        if deferred:  # the engine draws after the step (StepInput.defer_draw): the graph ends at the logits
            st.defer_draw = True
        if constrained:  # structured output / logit_bias (engine/guided.py): every token allowed, no bias until run()
            st.logit_mask = torch.full((B * T, guided.words(c.cfg.vocab_size)), -1, dtype=torch.int32, device=dev)
            st.logit_bias = (torch.zeros((B * T, MAX_LOGIT_BIAS), dtype=torch.long, device=dev),
                             torch.zeros((B * T, MAX_LOGIT_BIAS), dtype=torch.float32, device=dev))
        if like is not None and like.penalties is not None:  # the engine's count buffers, read in place; rows: scratch
            ban = like.penalties[6]
            st.penalties = like.penalties[:2] + (long(c.scratch_slot), f(1.0, torch.float32), f(0.0, torch.float32),
                                                 f(0.0, torch.float32), torch.zeros((B, ban.shape[1]), dtype=torch.long,
                                                                                   device=dev), f(0, torch.int32))
        return st

    def _capture(self, key, like: StepInput | None = None):
        B, nb = key[:2]
        t0 = time.time()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        st = self._static(B, nb, sampled="sampled" in key[2:], like=like, constrained="constrained" in key[2:],
                          deferred="deferred" in key[2:])
        st.logprobs = "logprobs" in key[2:]
        st.sample_top_k = "topk" in key[2:]
        g, out = capture(lambda: self.fn(st), self.pool)
        torch.cuda.synchronize()
        self.graphs[key] = (g, st, out)
        dt = time.time() - t0
        self.capture_s += dt
        if self.log:
            self.log(f"captured decode graph B={B}{f' T={self.T}' if self.T > 1 else ''}{''.join(' ' + f for f in key[2:])} "
                     f"context≤{nb * self.cache.block_size} in {dt:.2f}s "
                     f"({torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated)")

    def _try_capture(self, key, like: StepInput | None = None) -> bool:
        if key in self.failed:
            return False
        try:
            self._capture(key, like)
            return True
        except Exception as e:  # keep serving, loudly: an eager step is slow but correct
            why = f"{type(e).__name__}: {e}"
            if len(key) > 2:  # a variant (sampling, logprobs, penalties): only its steps run eagerly
                self.failed[key] = why
                if self.log:
                    self.log(f"WARNING: CUDA graph capture of {key} failed ({why}); such steps run eagerly")
            else:
                self.broken = why
                if self.log:
                    self.log(f"WARNING: CUDA graph capture failed ({why}); running eagerly from now on")
            torch.cuda.synchronize()
            return False

    def key_for(self, step: StepInput) -> tuple:
        """(B, blocks), and "sampled" (and "topk" where a row uses top-k) / "logprobs" / "penalties" for a step
        that samples, takes logprobs or applies penalties inside the graph (a graph of its own, captured at the
        first such step)."""
        need = (max(step.context_lens) + self.cache.block_size - 1) // self.cache.block_size
        if self.fixed_blocks is not None and need <= self.fixed_blocks:
            key = step.num_seqs, self.fixed_blocks
        else:
            key = step.num_seqs, min(context_bucket(need), self.cache.num_blocks)
        if not self.samples:
            return key
        if step.defer_draw:  # logits only: the draw's settings do not enter the graph
            return key + ("deferred",)
        sampled = ("sampled",) + (("topk",) if step.sample_top_k else ()) if step.sampling is not None else ()
        return (key + sampled + (("logprobs",) if step.logprobs else ())
                + (("penalties",) if step.penalties is not None else ())
                + (("constrained",) if step.logit_mask is not None or step.logit_bias is not None else ()))

    def capture_all(self) -> None:
        """Capture every batch size's graph now (fixed_blocks only), with progress output; with samples, also its
        sampled graph (the server's default temperature is 1.0: most requests sample, and a capture in the middle
        of serving would stall every running request; a verify cache's draws all B·T rows' tokens). Logprobs and
        penalties graphs are captured at first use."""
        import time as _time
        t0 = _time.time()
        for B in range(1, self.max_batch + 1):
            if self.log:
                self.log(f"capturing decode graphs: B={B}/{self.max_batch}" + (f" (verify, T={self.T})" if self.T > 1 else ""))
            if not self._try_capture((B, self.fixed_blocks)):
                return
            if self.samples:
                self._try_capture((B, self.fixed_blocks, "sampled"))  # a failure leaves the plain graphs
        if self.log:
            self.log(f"captured {len(self.graphs)} decode graphs in {_time.time() - t0:.1f}s "
                     f"({torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated)")

    def run(self, step: StepInput):
        """Replay the step's graph; None if graphs are off after a failed capture (caller runs eagerly)."""
        if self.broken:
            return None
        key = self.key_for(step)
        if key not in self.graphs and not self._try_capture(key, step):
            return None
        g, st, out = self.graphs[key]
        if st.penalties is not None and st.penalties[0] is not step.penalties[0]:
            return None  # count buffers made anew since the capture: run eagerly (the engine keeps one pair)
        nb = key[1]
        st.input_ids.copy_(step.input_ids)
        st.positions.copy_(step.positions)
        st.slot_mapping.copy_(step.slot_mapping)
        st.kda_slots.copy_(step.kda_slots)
        w = min(nb, step.block_tables.shape[1])
        st.block_tables.fill_(self.cache.scratch_block)
        st.block_tables[:, :w].copy_(step.block_tables[:, :w])
        st.context_lens_t.copy_(step.context_lens_t)
        if st.sampling is not None:
            for dst, src in zip(st.sampling, step.sampling):
                dst.copy_(src)
        if st.penalties is not None:
            for dst, src in zip(st.penalties[2:], step.penalties[2:]):
                dst.copy_(src)
        if st.logit_mask is not None:
            if step.logit_mask is None:
                st.logit_mask.fill_(-1)
            else:
                st.logit_mask.copy_(step.logit_mask)
            for dst in st.logit_bias:
                dst.zero_()
            if step.logit_bias is not None:
                n = step.logit_bias[0].shape[1]
                for dst, src in zip(st.logit_bias, step.logit_bias):
                    dst[:, :n].copy_(src)
        g.replay()
        self.uses[key] = self.uses.get(key, 0) + 1
        return out

    @torch.inference_mode()  # the static buffers are inference tensors when captured under it
    def scratch_replay(self, B: int, input_ids=None, sampled: bool = False):
        """B's most-used graph, its static inputs pointed at the scratch slot and block: its `replay`
        (None without a graph for B). For timing and profiling; it never touches a live sequence.
        input_ids: the rows' tokens (e.g. one each, so the MoE routes as a real batch does); else whatever
        the static buffer holds (the capture's: one token in every row)."""
        keys = [k for k in self.graphs if k[0] == B and (len(k) > 2) == sampled]
        if not keys:
            return None
        key = max(keys, key=lambda k: self.uses.get(k, 0))
        g, st, _ = self.graphs[key]
        c = self.cache
        st.slot_mapping.fill_(c.scratch_block * c.block_size)
        st.kda_slots.fill_(c.scratch_slot)
        st.block_tables.fill_(c.scratch_block)
        st.context_lens_t.fill_(key[1] * c.block_size)
        if input_ids is not None:
            st.input_ids.copy_(input_ids)
        return g.replay

    def replay_time(self, B: int, iters: int = 100, input_ids=None, sampled: bool = False) -> float | None:
        """Median ms of `iters` replays of B's most-used graph, timed with CUDA events, on scratch inputs
        (input_ids: the rows' tokens, as scratch_replay; sampled: its most-used sampling variant)."""
        replay = self.scratch_replay(B, input_ids, sampled)
        if replay is None:
            return None
        from ..bench.gpu import time_fn
        ms = time_fn(replay, iters=iters, warmup=5)
        return sorted(ms)[len(ms) // 2]


class StandardRunner:
    name = "standard"

    def __init__(self, model, cache, *, cuda_graphs: bool = True, max_graph_batch: int = 16, log=None,
                 prefill_graph_tokens: int = 0, batch_invariant: bool = False, max_len: int = 0):
        """prefill_graph_tokens: prefill steps of up to this many tokens replay piecewise CUDA graphs
        (decode/prefill_graphs.py; 0: eager). batch_invariant: the mode's forms (docs/correctness.md §5), eager: they
        loop over rows and experts on the host."""
        self.model, self.cache = model, cache
        self.batch_invariant, self.max_len = batch_invariant, max_len
        if batch_invariant:
            cuda_graphs, prefill_graph_tokens = False, 0
        self.last_path = "standard"
        self.fallback_reasons: dict[str, int] = {}
        on_gpu = cuda_graphs and cache.latent.is_cuda
        # on the GPU a decode step with sampled, penalised or logprobs rows draws them itself (in its graph: a
        # variant per kind), as the specialized runner does; the CPU engine samples on the host (sample_ref)
        self.device_sampler = on_gpu
        self.greedy_tokens = self.device_logprobs = None  # the last step's drawn tokens / logprobs, if it drew
        self.graphs = GraphCache(self._forward, cache, max_graph_batch, log, samples=on_gpu) if on_gpu else None
        self.prefill = None
        if on_gpu and prefill_graph_tokens:
            why = unsupported(model)
            if why is None:
                self.prefill = PrefillGraphs(model, cache, prefill_graph_tokens, log=log)
            elif log:
                log(f"prefill graphs off: {why}")
        self.record_routing = False
        self._routing: list[list[int]] = []

    @torch.inference_mode()
    def _forward(self, step: StepInput):
        """The logits, or (logits, tokens[, logprobs]) for a decode step the engine planned to draw here (and a
        pure verify step whose sampled rows the speculative decoder planned to draw here: a token each row)."""
        kernels.set_batch_invariant(self.batch_invariant, self.max_len)
        logits = self.model(step, self.cache)
        if (self.device_sampler and (step.is_decode or step.spec_tokens) and (step.sampling is not None or step.logprobs)
                and not step.defer_draw):
            ids, lp = draw(logits, step)
            return (logits, ids) if lp is None else (logits, ids, lp)
        return logits

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        self.greedy_tokens = self.device_logprobs = None
        logits = self._graphed_or_eager(step)
        if isinstance(logits, tuple):
            logits, self.greedy_tokens, *lp = logits
            self.device_logprobs = lp[0] if lp else None
        return logits

    def _graphed_or_eager(self, step: StepInput):
        logits = None
        # routing is recorded eagerly: a replayed graph's ids live in that graph's own buffers
        if self.graphs is not None and step.is_decode and step.num_seqs <= self.graphs.max_batch and not self.record_routing:
            logits = self.graphs.run(step)
        if logits is None and self._prefill_graphed(step):
            for logits in self.prefill.run(step):
                pass
        if logits is None:
            logits = self._forward(step)
        if self.record_routing:
            self.record_step_routing()
        return logits

    def forward_pieces(self, step: StepInput, layers_per_piece: int):
        """An eager forward in pieces of layers: -> advance(), which launches the next piece and returns
        None, or the logits after the last (engine: prefill pieces beside running decodes)."""
        if self._prefill_graphed(step):
            gen = self.prefill.run(step, layers_per_piece)
        else:
            gen = self.model.forward_pieces(step, self.cache, layers_per_piece)

        def advance():
            with torch.inference_mode():  # per piece: the caller's code between pieces runs outside it
                kernels.set_batch_invariant(self.batch_invariant, self.max_len)  # (a decode step ran in between)
                return next(gen)
        return advance

    def _prefill_graphed(self, step) -> bool:
        # routing is recorded eagerly (a graph's expert ids include its padded rows)
        return (self.prefill is not None and not self.record_routing and self.model.taps is None
                and self.prefill.serves(step))  # a drafter's taps are taken in the eager forward

    def record_step_routing(self) -> None:
        """Distinct experts each MoE layer used in the step just run (host sync: untimed passes only)."""
        self._routing.append([int(torch.unique(l.mlp.last_ids).numel()) for l in self.model.layers if l.is_moe])

    def routed_experts_per_step(self) -> list[list[int]]:
        return self._routing

    def graph_replay_time(self, B: int, iters: int = 100, sampled: bool = False) -> float | None:
        return self.graphs.replay_time(B, iters, sampled=sampled) if self.graphs is not None else None
