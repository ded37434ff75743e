"""The latency_specialized runner: pure decode steps at small batch through the
fused Triton kernels, the whole step (all layers, final norm, lm_head, greedy
argmax) replayed from one CUDA graph per (B, context bucket).

Speculative verify steps (peregrine/speculative) are pure decode steps of T = 1 + k tokens per
sequence: the GEMMs take B·T rows, the KDA decode runs the T positions in one program and
writes the state after each into the step's checkpoint buffers, and MLA gives each query
position the sequence's block table and the length up to itself (causal within the draft),
one row a program by default (PEREGRINE_MLA_VERIFY_ROWS=2: two rows share each latent tile it
reads). One graph per (B, T), and one more that also draws the sampled rows' tokens at every position.

It reads the model's parameters in place — the model already stores them fused
(one input projection per attention layer, stacked experts), so the standard runner
shares every tensor; the one copy is each KDA layer's f_b | g_b stacked for one launch. Steps it cannot serve go
to the standard runner over the same caches; each reason is counted and logged once.
"""
from __future__ import annotations

import os
from collections import Counter

import torch

from .. import kernels
from ..kernels.gemm import WIDE_MAX_ROWS, groupable, grouped_gemm, skinny_gemm
from ..kernels.kda import kda_decode
from ..kernels.mla import mla_decode, uv_why_not
from ..kernels.mla_prologue import mla_prologue
from ..kernels.mla_prologue import why_not as prologue_why_not
from ..kernels.moe import moe_combine, moe_expert_partials, moe_experts, moe_route, router_partials, router_topk
from ..kernels.moe_mxfp4 import moe_mxfp4_experts
from ..kernels.moe_mxfp4_v4 import moe_mxfp4_experts_v4, on_hopper
from ..kernels.norm import add_rms_norm, rms_norm
from ..kernels.pdl import pdl as kernels_pdl
from ..kernels.logprobs import token_logprobs
from ..kernels.sampling import argmax
from ..models.layers import swiglu
from ..parallel.group import SINGLE
from .head import draw
from .standard import GraphCache

MAX_DECODE_BATCH = 16  # the skinny GEMMs are written for M ≤ 16 rows
DISTINCT_SEED = 0xD157  # the random tokens graph_replay_time(distinct=True) feeds, fixed: the same table every start
# MLA's combine with W_UV in one launch up to this B: it won 7-16 us a step at B = 1, 2 and lost 33-117 us at
# B = 4, 8 (sessions 17, 18); larger batches take the combine, then the bmm
FUSED_UV_MAX_B = 2


VERIFY_GEMM_ENV = "PEREGRINE_VERIFY_GEMM"  # "triton": verify steps' 17..64-row GEMMs on the skinny kernel's wide tile
# verify steps' MLA, rows of a sequence per program: 1 (default: the rows share the sequence's table and length in
# the kernel, no expand), 2 (M = 64, the latent read T / 2 times; ptxas spills: opt-in until measured), 0 (before)
VERIFY_MLA_ENV = "PEREGRINE_MLA_VERIFY_ROWS"
# MXFP4 experts: "v4" (kernels/moe_mxfp4_v4.py: the experts repacked in place at start, the standard path
# dequantizing the same tensors; the default on Hopper: 0.92 / 0.90 / 0.87 / 0.82x v3's k3-slice step at B = 1, 2, 4,
# 8 on an H100, results/2026-12-05-session27) or "v3" (the checkpoint layout; the default elsewhere: v4's Gluon
# kernel is Hopper's, its portable form the interpreter's)
MXFP4_ENV = "PEREGRINE_MXFP4"
MXFP4_FORMS = ("v3", "v4")


def _verify_rows() -> int:
    """Most rows _mm gives the skinny kernel: MAX_DECODE_BATCH, or with PEREGRINE_VERIFY_GEMM=triton the wide
    tile's WIDE_MAX_ROWS (one M tile: the weights stream once). cuBLAS stays the default above 16 rows until an
    H200 run of kernels_gemm --ms 17..64 says which is faster per shape (then plan entries choose)."""
    return WIDE_MAX_ROWS if os.environ.get(VERIFY_GEMM_ENV) == "triton" else MAX_DECODE_BATCH


def _mm(x, w, out=None):
    """Skinny GEMM up to _verify_rows() rows; cuBLAS/torch beyond (verify steps of B·T rows)."""
    if x.shape[0] <= _verify_rows() or kernels.batch_invariant():  # (cuBLAS picks its kernel by M)
        return skinny_gemm(x, w, out=out)
    return x @ w.T if out is None else torch.matmul(x, w.T, out=out)


class SpecializedRunner:
    name = "latency_specialized"
    lookahead = True  # greedy_tokens may be a next step's input_ids on the device (engine decode lookahead)
    device_sampler = True  # honours StepInput.sampling / .logprobs / .penalties in its step (_head)

    def __init__(self, model, cache, standard, *, max_batch: int = 8, cuda_graphs: bool = True, log=print,
                 max_blocks: int | None = None, allreduce: str = "auto", pdl: bool = False,
                 batch_invariant: bool = False):
        if not 1 <= max_batch <= MAX_DECODE_BATCH:
            raise ValueError(f"max_decode_batch must be in 1..{MAX_DECODE_BATCH}, got {max_batch}")
        self.model, self.cache, self.standard, self.max_batch, self.log = model, cache, standard, max_batch, log
        self.cfg = model.cfg
        self.pdl = pdl  # Programmatic Dependent Launch for this runner's kernels (captured into its graphs)
        # --batch-invariant: kernels planned from static sizes only (kernels.set_batch_invariant), for this runner's steps
        self.batch_invariant, self.max_len = batch_invariant, (max_blocks or cache.num_blocks) * cache.block_size
        # verify steps' MLA: a sequence's query rows a program takes (0: each row its own sequence, expanded)
        self.verify_query_rows = int(os.environ.get(VERIFY_MLA_ENV, "1"))
        self.fused_uv_max_b = FUSED_UV_MAX_B  # _mla_attend's combine and W_UV in one launch up to this many rows
        self.last_path = self.name
        self.fallback_reasons: Counter = Counter()
        self.greedy_tokens = None  # argmax of the last specialized step (the engine skips its own)
        # a drafter's work run at the end of every verify step, in its graph: after_verify(step, tokens) -> a dict
        # of device tensors, left in verify_extras (speculative/dflash_graphs.py: the next block drafted from the
        # rows' accepted prefixes without a second launch and read-back)
        self.after_verify = None
        self.verify_extras = None
        self.device_logprobs = None  # its logprobs, when the step asked for them (StepInput.logprobs)
        dev = cache.latent.device
        self.verify_graphs: dict[int, GraphCache] = {}  # speculative verify steps, by T = 1 + k
        self._graph_args = (cuda_graphs and dev.type == "cuda", max_blocks)
        self.unavailable = kernels.why_unavailable(dev)
        self._k3 = self.cfg.is_k3 or self.cfg.expert_quant is not None  # served by _step_k3
        self.mxfp4 = self._mxfp4_form(model)
        # per KDA layer: [f_b; g_b] stacked, both gate up-projections in one grouped launch (_gates)
        self.gate_w = self._stack_gates(model)
        self.side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        # tensor parallel: row-parallel outputs are written straight into the one-shot all-reduce's
        # symmetric buffer when there is one (NCCL all-reduce otherwise)
        self.tp = getattr(model, "tp", SINGLE)
        self.oneshot = None
        if self.tp.world > 1 and allreduce != "nccl" and not self.unavailable:
            from ..parallel.symm import OneShot
            self.oneshot = OneShot.create(self.tp, max_batch, self.cfg.hidden_size, model.dtype, dev, log)
        # one graph per B: the MLA decode grid depends only on the block-table width, not on lengths
        self.graphs = GraphCache(self._pdl_step, cache, max_batch, log, fixed_blocks=max_blocks, samples=True) if (
            cuda_graphs and dev.type == "cuda") else None
        log(f"latency_specialized: decode B ≤ {max_batch} via fused kernels"
            + (f", CUDA graphs per batch size" if self.graphs else ", no graphs")
            + (", programmatic dependent launch on" if pdl else "")
            + "; weights shared with the standard path in place"
            + f" (re-packed: only the KDA gate up-projections stacked, {self._gate_bytes() / 2**20:.1f} MiB)"
            + (f"; kernels unavailable here ({self.unavailable}): every step falls back" if self.unavailable else ""))
        if self.graphs is not None and max_blocks is not None and not self.unavailable:
            self.graphs.capture_all()

    def _mxfp4_form(self, model) -> str | None:
        """The MXFP4 expert kernels this runner uses (None: no MXFP4 experts); v4 repacks them in place here."""
        moes = [l.mlp for l in model.layers if l.is_moe and l.mlp.mx]
        if not moes:
            return None
        form = os.environ.get(MXFP4_ENV) or ("v4" if on_hopper(moes[0].gate_w.device) else "v3")
        if form not in MXFP4_FORMS:
            raise ValueError(f"{MXFP4_ENV}={form!r}: expected one of {', '.join(MXFP4_FORMS)}")
        if form == "v4" and any(m.mx_layout != "v4" for m in moes):
            n = sum(m.repack_experts() for m in moes if m.mx_layout != "v4")
            self.log(f"latency_specialized: MXFP4 experts repacked for v4 in place ({n / 2**30:.2f} GiB, {len(moes)} layers)")
        return form

    # ---- dispatch ----
    def why_not(self, step) -> str | None:
        if self.unavailable:
            return f"kernels unavailable: {self.unavailable}"
        if not step.is_decode and not step.spec_tokens:  # a verify step has T tokens for every sequence
            return "prefill in batch"
        if step.num_seqs > self.max_batch:
            return "batch too large"
        if getattr(self.model, "taps", None) is not None and (self.cfg.is_k3 or self.cfg.expert_quant is not None):
            return "a DFlash drafter's hidden-state taps (not taken in the K3 / MXFP4 step)"
        return None

    def _fall_back(self, reason: str) -> None:
        if reason not in self.fallback_reasons:
            self.log(f"latency_specialized: falling back to standard ({reason}); counted from now on")
        self.fallback_reasons[reason] += 1

    def forward_pieces(self, step, layers_per_piece: int):
        """A prefill chunk run in pieces beside decode steps: the standard path's, counted as a fallback."""
        self._fall_back(self.why_not(step) or "prefill pieces")
        return self.standard.forward_pieces(step, layers_per_piece)

    def forward(self, step) -> torch.Tensor:
        reason = self.why_not(step)
        if reason is not None:
            self._fall_back(reason)
            self.last_path, self.greedy_tokens, self.device_logprobs, self.verify_extras = "standard", None, None, None
            return self.standard.forward(step)
        self.last_path = self.name
        graphs = self.verify_graphs.get(step.spec_tokens) if step.spec_tokens else self.graphs
        out = graphs.run(step) if graphs and not self.record_routing else None  # record eagerly
        res = out if out is not None else self._pdl_step(step)
        self.verify_extras = res[-1] if isinstance(res[-1], dict) else None
        res = res[:-1] if self.verify_extras is not None else res
        logits, self.greedy_tokens = res[:2]
        self.device_logprobs = res[2] if len(res) > 2 else None  # (chosen, top ids, top logprobs) with step.logprobs
        if self.record_routing:
            self.standard.record_step_routing()  # same model, same log
        return logits

    @property
    def record_routing(self) -> bool:
        return self.standard.record_routing

    @record_routing.setter
    def record_routing(self, on: bool) -> None:  # fallback steps record too, one entry per step
        self.standard.record_routing = on

    def routed_experts_per_step(self):
        return self.standard.routed_experts_per_step()

    def graph_replay_time(self, B: int, iters: int = 100, T: int = 1, distinct: bool = False,
                          sampled: bool = False) -> float | None:
        """Median ms of B's (verify: B·T rows') graph replayed on scratch inputs. distinct: every row a different
        random token, so the MoE reads the union of experts a real step's rows route to; else the capture's
        tokens, alike in every row (8 experts a layer whatever B·T: a 48B verify at T = 8 then timed ~3 ms under
        its real cost on an H200, results/2026-12-05-session29). sampled: the graph that draws the rows (its
        most-used variant: sampled, logprobs, ...), else the greedy one."""
        g = self.graphs if T == 1 else self.verify_graphs.get(T)
        if not g:
            return None
        ids = None
        if distinct:
            dev = self.cache.latent.device
            gen = torch.Generator(device=dev).manual_seed(DISTINCT_SEED + 64 * B + T)
            ids = torch.randint(0, self.cfg.vocab_size, (B * T,), generator=gen, device=dev)
        return g.replay_time(B, iters, ids, sampled)

    def enable_speculation(self, k: int, kda_ckpt, max_blocks: int) -> None:
        """Serve verify steps of T = 2 .. k+1 tokens per sequence; on the GPU capture two graphs per (B, T) now,
        with block tables of max_blocks (room for k tokens past max_model_len): the greedy one and the sampled one,
        which draws every row's token from StepInput.sampling (B·T rows, keyed by position) so that a verify step
        of sampled requests reads its tokens back with the greedy rows' (each T's graphs share one memory pool)."""
        on, fixed = self._graph_args
        self.verify_graphs = {}
        if not on or self.unavailable:
            return
        for T in range(2, k + 2):
            g = GraphCache(self._pdl_step, self.cache, self.max_batch, self.log, fixed_blocks=max_blocks,
                           tokens_per_seq=T, static_extra={"spec_tokens": T, "kda_ckpt": kda_ckpt}, samples=True)
            if fixed is not None:
                g.capture_all()
            self.verify_graphs[T] = g

    # ---- the step ----
    def _pdl_step(self, step):
        """The step with this runner's PDL setting, for eager runs, warm-up and graph capture alike."""
        kernels.set_batch_invariant(self.batch_invariant, self.max_len)
        with kernels_pdl(self.pdl):
            return self._step(step)

    @torch.inference_mode()
    def _step(self, step):
        if self.cfg.is_k3 or self.cfg.expert_quant is not None:
            return self._step_k3(step)
        m, eps = self.model, self.cfg.rms_norm_eps
        if self.oneshot is not None:
            self.oneshot.reset()  # the same buffer order in every step and every graph
        T = step.spec_tokens or 1  # query tokens per sequence: 1 + k in a verify step
        residual = m.embed(step.input_ids)
        taps = m.taps  # a DFlash drafter's: layer L's output is the residual once layer L + 1 adds its MLP output
        if taps is not None:
            taps.take(-1, residual.clone(), step)  # clones: the residual is added to in place further on
        layers = m.layers
        x, w_in = None, layers[0].input_layernorm.weight  # layer 0's input: RMSNorm(residual), nothing to add
        for i, layer in enumerate(layers):
            proj, residual = self._norm_in_proj(layer.attn, x, residual, w_in)
            if taps is not None and i > 0:
                taps.take(i - 1, residual.clone(), step)
            a = (self._kda(layer.attn, None, step, T, proj=proj) if layer.is_kda
                 else self._mla(layer.attn, None, step, T, proj=proj))
            h, residual = add_rms_norm(self._reduce(a), residual, layer.post_attention_layernorm.weight, eps)
            f = self._moe(layer.mlp, h) if layer.is_moe else self._dense(layer.mlp, h, self._rbuf(h))
            x = self._reduce(f)
            w_in = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else None
        h, residual = add_rms_norm(x, residual, m.norm.weight, eps)
        if taps is not None:
            taps.take(len(layers) - 1, residual.clone(), step)
        out = self._head(_mm(h, m.lm_head).float(), step)
        if step.spec_tokens and self.after_verify is not None:
            out = (*out, self.after_verify(step, out[1]))
        return out

    def _norm_in_proj(self, attn, x, residual, w):
        """(RMSNorm(residual [+ x])·w @ in_proj.T, the residual after the add, in place)."""
        eps = self.cfg.rms_norm_eps
        h = rms_norm(residual, w, eps) if x is None else add_rms_norm(x, residual, w, eps)[0]
        return _mm(h, attn.in_proj), residual

    def _head(self, logits, step):
        """The step's tokens from [B, V] FP32 logits: the argmax, or with step.sampling each row's draw
        (greedy rows the argmax too); vocab-parallel lm_head: gathered argmax and logits."""
        if step.defer_draw:  # the engine draws after the step (StepInput.defer_draw)
            return logits, None
        if self.tp.world > 1 and step.sampling is None:
            ids = self.tp.argmax(logits, argmax(logits))
            logits = self.tp.all_gather(logits, -1)
            lp = token_logprobs(logits, ids) if step.logprobs else None
        else:
            if self.tp.world > 1:
                logits = self.tp.all_gather(logits, -1)
            ids, lp = draw(logits, step)
        return (logits, ids) if lp is None else (logits, ids, lp)

    def _rbuf(self, h):
        """Where a row-parallel GEMM writes its [B, D] output: the all-reduce's own buffer, or anywhere."""
        if self.oneshot is not None and h.shape[0] <= self.oneshot.rows:
            return self.oneshot.buffer(h.shape[0])
        return None

    def _reduce(self, x):
        if self.oneshot is not None and self.oneshot.usable(x):
            return self.oneshot.all_reduce(x)
        return self.tp.all_reduce(x)

    def _stack_gates(self, model) -> dict:
        """{layer: cat([f_b, g_b])} for the KDA layers whose two low-rank gate up-projections can share a
        grouped launch: same shape and dtype, inputs f_a | g_a adjacent in the in-projection (a copy:
        the standard path keeps reading f_b and g_b; 2 MB per layer at 48B widths)."""
        out = {}
        for layer in model.layers:
            if not layer.is_kda or self.unavailable or layer.attn.g_b is None:
                continue
            a, fb, gb = layer.attn, layer.attn.f_b, layer.attn.g_b
            if fb.shape == gb.shape and fb.dtype == gb.dtype and a.splits[1] == a.splits[2] == fb.shape[1]:
                out[a.layer] = torch.cat([fb, gb]).contiguous()
        return out

    def _gate_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.gate_w.values())

    def _gates(self, attn, proj, fa, ga):
        """(f, r): f_a @ f_b.T and g_a @ g_b.T (r = g_a for a full-rank gate); one grouped launch when
        the layer's weights are stacked and the plan's tile fits, giving the two launches' bits."""
        w = self.gate_w.get(attn.layer)
        n, k = attn.f_b.shape
        if w is not None and proj.shape[0] <= MAX_DECODE_BATCH and groupable(proj.shape[0], n, k):
            lo = attn.splits[0]
            fr = grouped_gemm(proj[:, lo:lo + 2 * k], w, 2)
            return fr[:, :n], fr[:, n:]  # column views: kda_decode reads strided rows
        return _mm(fa, attn.f_b), ga if attn.g_b is None else _mm(ga, attn.g_b)

    def _kda(self, attn, h, step, T=1, proj=None):
        """proj: the in-projection already applied (_step's _norm_in_proj); else h @ in_proj.T here."""
        proj = _mm(h, attn.in_proj) if proj is None else proj
        N, B = proj.shape[0], proj.shape[0] // T
        qkv, fa, ga, b = proj.split(attn.splits, dim=-1)
        f, r = self._gates(attn, proj, fa, ga)
        k = self.cache.kda_index[attn.layer]
        lb = self.cfg.kda_gate_lower_bound
        ck = step.kda_ckpt if T > 1 else None  # verify: the state after each position, for rollback
        sq = lambda t: t.unflatten(0, (B, T))  # noqa: E731  [B·T, C] -> [B, T, C] (a view)
        o = kda_decode(sq(qkv), sq(f), sq(b), sq(r), attn.conv_w, attn.A_log,
                       attn.dt_bias, attn.o_norm, self.cache.state[k], self.cache.conv[k], step.kda_slots,
                       gate="softplus" if lb is None else "bounded", lower_bound=lb if lb is not None else -5.0,
                       eps_o=self.cfg.rms_norm_eps, state_ckpt=None if ck is None else ck[0][k, :B, :T],
                       conv_ckpt=None if ck is None else ck[1][k, :B, :T])
        return _mm(o.view(N, -1), attn.o_proj, out=self._rbuf(proj))

    def _mla(self, attn, h, step, T=1, proj=None):
        proj = _mm(h, attn.in_proj) if proj is None else proj
        q, kva, _ = proj.split(attn.splits, dim=-1)
        q, kva = attn.gather_sliced(q, kva)  # TP slicing: this rank's kv_a columns -> all of them
        if attn.q_b is not None:  # q-LoRA (a kimi_linear config may set q_lora_rank): q = W_qb RMSNorm(W_qa x)
            q = _mm(rms_norm(q, attn.q_a_norm, self.cfg.mla_norm_eps), attn.q_b)
        o = self._mla_attend(attn, q, kva, step, T)
        return _mm(o, attn.o_proj, out=self._rbuf(proj))

    def _mla_attend(self, attn, q, kva, step, T=1):
        """Write this step's latents, then absorbed attention over the paged cache: [B, H·v]."""
        B, c = q.shape[0], self.cache
        q = q.view(B, attn.H, -1)
        w_uk, w_uv = attn.w_uk_uv
        mi = c.mla_index[attn.layer]
        if prologue_why_not(q, kva, w_uk, c.latent[mi]) is None:  # norm, cache write and W_UK in one launch
            qh = mla_prologue(q, kva, w_uk, attn.kv_norm, self.cfg.mla_norm_eps, c.latent[mi],
                              c.scale[mi] if c.fp8 else None, step.slot_mapping)
        else:  # the chain: norm, cat, cache write, bmm, cat
            entries = torch.cat([rms_norm(kva[:, : attn.r], attn.kv_norm, self.cfg.mla_norm_eps), kva[:, attn.r:]], -1)
            c.write_latent(attn.layer, step.slot_mapping, entries)
            q_lat = torch.bmm(q[..., : attn.nope].transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, r]
            qh = torch.cat([q_lat, q[..., attn.nope:]], -1)
        tables, lens = step.block_tables, step.context_lens_t
        kw = {}
        if T > 1 and self.verify_query_rows == 0:  # verify, the A/B baseline: query t of a sequence its own row
            S = B // T  # expand, not repeat_interleave: no host sync inside a graph capture
            tables = tables.unsqueeze(1).expand(S, T, tables.shape[1]).reshape(B, -1)
            lens = (lens.unsqueeze(1) - (T - 1) + torch.arange(T, device=lens.device, dtype=lens.dtype)).reshape(B)
        elif T > 1:  # verify: the kernel gives row t of a sequence its table and the length up to itself
            kw = dict(tokens_per_seq=T, query_rows=self.verify_query_rows)
        args = (qh, c.latent[mi], c.scale[mi] if c.fp8 else None, tables, lens, attn.sm_scale)
        if (B <= self.fused_uv_max_b or self.batch_invariant) and uv_why_not(qh, w_uv, attn.r) is None:  # W_UV in the combine: [B, H·v]
            return mla_decode(*args, kv_lora_rank=attn.r, w_uv=w_uv, **kw)
        o_lat = mla_decode(*args, kv_lora_rank=attn.r, **kw)
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).reshape(B, -1)

    def _dense(self, mlp, h, out=None):
        return _mm(swiglu(_mm(h, mlp.gate_up)), mlp.down, out=out)

    def _shared(self, moe, h, mlp):
        """Launch the shared expert (None without one) on the side stream, overlapping the routed
        experts; the caller waits on self.side before using it."""
        if moe.shared is None:
            return None
        if self.side is None:
            return mlp(moe.shared, h)
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            return mlp(moe.shared, h)

    def _route(self, moe, h, shared_slot: bool = False):
        """The fused router; under TP slicing its logits kernel runs on the rank's experts and the
        partials are gathered before the top-k (the same FP32 bits on every rank: the same choice).
        shared_slot: one more slot per token for the shared expert (kernels/moe.py router_topk)."""
        cfg = self.cfg
        if not moe.router_sliced:
            return moe_route(h, moe.gate_w, moe.bias, cfg.num_experts_per_token, cfg.moe_renormalize,
                             cfg.routed_scaling_factor, shared_slot=shared_slot)
        part = router_partials(h, moe.gate_w, num_experts=cfg.num_experts)
        return router_topk(self.tp.all_gather_stacked(part), moe.bias, cfg.num_experts_per_token,
                           cfg.moe_renormalize, cfg.routed_scaling_factor, shared_slot=shared_slot)

    def _shared_weights(self, moe):
        """(gate_up, down) of a shared expert the routed-expert launches can serve as one more expert
        (the routed experts' shape and dtype, contiguous), else None: it then runs as a dense MLP."""
        sh = moe.shared
        if sh is None:
            return None
        gu, dn = sh.gate_up, sh.down
        fits = (gu.shape == moe.w13.shape[1:] and dn.shape == moe.w2.shape[1:] and gu.dtype == dn.dtype == moe.w13.dtype
                and gu.is_contiguous() and dn.is_contiguous())
        return (gu, dn) if fits else None

    def _moe(self, moe, h):
        shared_w = self._shared_weights(moe)
        if shared_w is not None:  # router -> experts + shared -> combine: no side stream, no dense-MLP launches
            ids, w = self._route(moe, h, shared_slot=True)
            moe.last_ids = ids[:, :-1]
            part = moe_expert_partials(h, moe.w13, moe.w2, ids, shared=shared_w)
            return moe_combine(part, w, dtype=h.dtype, out=self._rbuf(h))
        shared = self._shared(moe, h, self._dense)
        ids, w = self._route(moe, h)
        moe.last_ids = ids
        part = moe_expert_partials(h, moe.w13, moe.w2, ids)  # tiles per B from kernels/moe_plan.json
        if shared is not None and self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)
        # the shared expert is added before the one rounding; out may be the all-reduce buffer
        return moe_combine(part, w, add=shared, dtype=h.dtype, out=self._rbuf(h))

    # ---- K3 layers and MXFP4 experts (docs/models.md K3 column): q-LoRA MLA with output gate, latent MoE
    # with SiTU, AttnRes block mixing. KDA's bounded gate and full-rank output gate are _kda's.
    # Under tensor parallel every attention and MLP output is a row-parallel partial sum, reduced
    # here as the standard DecoderLayer does (the latent MoE also reduces y before its norm). Verify steps
    # (T = 1 + k query rows a sequence) take the same layers over B·T rows, as _step's do.
    def _step_k3(self, step):
        m, eps = self.model, self.cfg.rms_norm_eps
        T = step.spec_tokens or 1  # query tokens per sequence: 1 + k in a verify step
        if self.oneshot is not None:
            self.oneshot.reset()  # the same buffer order in every step and every graph
        p = m.embed(step.input_ids)
        blocks: list[torch.Tensor] = []  # AttnRes block list (DecoderLayer.forward_res)
        for layer in m.layers:
            x = p
            if layer.res:
                x = layer.attn_res(p, blocks) if blocks else p
                if layer.block_start:
                    blocks.append(p)
            h = rms_norm(x, layer.input_layernorm.weight, eps)
            a = self._reduce(self._kda(layer.attn, h, step, T) if layer.is_kda else self._mla_k3(layer.attn, h, step, T))
            if layer.res:
                p = a if layer.block_start else p + a
                h = rms_norm(layer.mlp_res(p, blocks), layer.post_attention_layernorm.weight, eps)
            else:
                h, p = add_rms_norm(a, p, layer.post_attention_layernorm.weight, eps)  # p is ours: in place
            p = p + self._reduce(self._moe_k3(layer.mlp, h) if layer.is_moe else self._mlp_k3(layer.mlp, h, self._rbuf(h)))
        if m.output_res is not None:
            p = m.output_res(p, blocks)
        return self._head(_mm(rms_norm(p, m.norm.weight, eps), m.lm_head).float(), step)

    def _mla_k3(self, attn, h, step, T=1):
        q, kva, g = _mm(h, attn.in_proj).split(attn.splits, dim=-1)
        q, kva = attn.gather_sliced(q, kva)
        if attn.q_b is not None:  # q-LoRA: q = W_qb RMSNorm(W_qa x)
            q = _mm(rms_norm(q, attn.q_a_norm, self.cfg.mla_norm_eps), attn.q_b)
        o = self._mla_attend(attn, q, kva, step, T)  # [B·T, H·v]
        if attn.gate_dim:  # K3: o ⊙ σ(W_g x), in FP32
            o = (o.float() * torch.sigmoid(g.float())).to(h.dtype)
        return _mm(o, attn.o_proj, out=self._rbuf(h))

    def _mlp_k3(self, mlp, h, out=None):  # dense / shared expert with the model's activation (SiTU for K3)
        return _mm(mlp.act(_mm(h, mlp.gate_up)), mlp.down, out=out)

    def _moe_k3(self, moe, h):
        cfg = self.cfg
        shared = self._shared(moe, h, self._mlp_k3)  # on the un-projected input
        ids, w = self._route(moe, h)  # the router also reads x, not z
        moe.last_ids = ids
        z = _mm(h, moe.down) if moe.latent else h
        act = "situ" if cfg.hidden_act == "situ" else "swiglu"
        if moe.mx and moe.mx_layout == "v4":
            y = moe_mxfp4_experts_v4(z, moe.w13_q, moe.w13_s, moe.w2_q, moe.w2_s, ids, w, activation=act, fold=moe.mx_fold)
        elif moe.mx:
            y = moe_mxfp4_experts(z, moe.w13_q, moe.w13_s, moe.w2_q, moe.w2_s, ids, w, activation=act)
        else:
            y = moe_experts(z, moe.w13, moe.w2, ids, w, activation=act)
        if moe.latent:  # TP: y is summed over the ranks before its norm; up_proj holds a column slice
            lo, hi = self.tp.span(moe.norm.shape[0])  # a row-strided view: the skinny GEMM reads it in place
            y = _mm(rms_norm(self.tp.all_reduce(y), moe.norm, cfg.rms_norm_eps)[:, lo:hi], moe.up)
        if shared is None:
            return y
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)
        return y + shared
