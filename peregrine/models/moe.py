"""Sigmoid-routed MoE with a shared expert (docs/models.md "MoE layer").

Experts are stored stacked — w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I] —
so one tensor serves the standard path (grouped GEMM) and the fused kernels.
K3: experts live in a latent space (z = W_down x, out = W_up RMSNorm(y)) and may be
MXFP4 — then w13/w2 are None and the packed codes + E8M0 scales are stored stacked the
same way (w13_q [E, 2I, Dz/2], w13_s [E, 2I, Dz/32], w2_q [E, Dz, I/2], w2_s [E, Dz, I/32]).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from ..config import ConfigError, ModelConfig
from .. import kernels
from . import layers, mxfp4
from .layers import DenseMLP, HFParam, param, rms_norm, situ, swiglu
from ..parallel.group import SINGLE
from ..parallel.slicing import slicing


def activation(cfg: ModelConfig):
    """The gated activation of every MLP of the model (dense, shared, routed)."""
    if cfg.hidden_act == "situ":
        return lambda gu: situ(gu, cfg.situ_beta, cfg.situ_linear_beta)
    return swiglu


def route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scaling: float):
    """FP32 router: -> (ids [N, k] long, weights [N, k] FP32)."""
    return select(x.float() @ gate_w.float().T, bias, top_k, renormalize, scaling)


def select(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scaling: float):
    """The router's top-k of FP32 logits [N, E]: -> (ids [N, k] long, weights [N, k] FP32)."""
    s = torch.sigmoid(logits)
    ids = torch.topk(s + bias.float(), top_k, dim=-1, sorted=True).indices
    w = s.gather(-1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, w * scaling


FUSED_GLUE: bool | None = None  # the SwiGLU-weight and combine kernels (kernels/moe_prefill.py) around the grouped
#   GEMMs. None: on the GPU for prefill-sized steps outside FP32 runs (the oracle keeps the torch forms;
#   decode steps keep the exact torch form the specialized path is checked against); True: for any step,
#   also under the interpreter (tests); False: never
GLUE_MIN_TOKENS = layers.FUSED_MIN_ROWS  # fewer tokens: the passes are launch-bound


def fused_glue(x: torch.Tensor, act) -> bool:
    return act is swiglu and layers.fused(x, FUSED_GLUE)


BF16_ROUTER: bool | None = None  # None: prefill-sized BF16 steps on the GPU; False: always the FP32 form


def router_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """FP32 router logits x @ w.T. BF16 products are exact in FP32, so on the GPU a prefill-sized step takes
    one BF16 tensor-core GEMM accumulating and writing FP32 (only the summation order differs) instead of
    up-casting both to an FP32 SIMT GEMM (H200, 8K tokens x 256 experts: ~0.2 ms a layer, 21 ms of a 32K
    prefill); decode steps keep the FP32 form the specialized router kernel is checked against."""
    global BF16_ROUTER
    if (BF16_ROUTER is not False and x.is_cuda and x.dtype == w.dtype == torch.bfloat16
            and x.shape[0] >= GLUE_MIN_TOKENS and not kernels.batch_invariant()):  # (the mode: linear's FP32 form)
        try:
            return torch.mm(x, w.T, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without mm's out_dtype on this GPU
            BF16_ROUTER = False
    return layers.linear(x.float(), w.float())


FUSED_ROUTER: bool | None = None  # the router's sigmoid, bias, top-k and renormalisation in one kernel per token
#   (kernels/moe.py router_topk, the decode path's) for prefill-sized steps; torch.topk over [N, E] FP32 and its
#   five elementwise passes were 13 ms of a cold 32K prompt (H200, 48B). Switch as layers.fused


def route_logits(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scaling: float, x: torch.Tensor):
    """select() of FP32 logits [N, E]; a prefill-sized step takes the one-pass kernel (the same math in FP32;
    ties go to the lower expert id, the renormalising sum may differ in its last bit)."""
    if layers.fused(x, FUSED_ROUTER) and logits.is_contiguous():
        from ..kernels.moe import router_topk
        ids, w = router_topk(logits.view(1, 1, *logits.shape), bias, top_k, renormalize, scaling)
        return ids.long(), w
    return select(logits, bias, top_k, renormalize, scaling)


def grouped_experts(x, w13, w2, ids, w, act, grouped: bool | None = None, add: tuple = (),
                    mx: tuple | None = None) -> torch.Tensor:
    """Σ_k w[n,k]·E_ids[n,k](x[n]) with each used expert's weights read once per step; then each tensor of `add`
    ([N, D] in x's dtype) added in order, rounded after each add (the fused glue adds them in its combine pass).

    Token-expert pairs are sorted by expert and run as one grouped GEMM (no host
    sync, so a decode step can be graph-captured). The routing weight scales each pair's
    activation before the down projection (linear, so the same sum; no FP32 copy of the
    [N, k, D] outputs), and the sum over k runs in FP32 in a fixed order: bitwise reproducible.
    mx = (q13, s13, q2, s2, v4): MXFP4 experts (w13, w2 unused), through kernels/moe_mxfp4_prefill.py's grouped
    GEMM, which decodes each expert's weights inside it and gathers the up GEMM's rows itself.
    """
    N, k = ids.shape
    E = (w13 if mx is None else mx[0]).shape[0]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    if grouped is None:  # the grouped GEMM on CUDA/BF16; its CPU fallback is slower than looping over used experts
        # (batch-invariant mode loops over them too: cuBLAS's grouped GEMM picks its kernel by the rows of each)
        grouped = mx is not None or (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
                                     and not layers.invariant_kernels(x))
    w_flat = w.flatten()[order]  # each pair's routing weight, applied before the down GEMM
    fused = fused_glue(x, act)
    if fused:
        from ..kernels.moe_prefill import combine, gather_pairs, swiglu_weighted
        weighted = swiglu_weighted
    else:
        weighted = lambda gu, wp: (act(gu) * wp.unsqueeze(-1)).to(x.dtype)  # noqa: E731
    if mx is not None:
        from ..kernels.moe_mxfp4_prefill import grouped_mm
        q13, s13, q2, s2, v4 = mx
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        h = weighted(grouped_mm(x, q13, s13, counts, v4, rows=order // k), w_flat)
        ys = grouped_mm(h, q2, s2, counts, v4)
    elif grouped:
        xs = gather_pairs(x, order, k) if fused else x[order // k]
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)  # bincount would sync on its size
        h = weighted(torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs), w_flat)
        ys = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    else:  # older torch / other dtypes / batch-invariant mode: loop over the experts actually used
        xs = x[order // k]
        ys = torch.empty(N * k, w2.shape[1], dtype=x.dtype, device=x.device)
        sf = flat[order]
        for e in torch.unique(sf).tolist():
            m = sf == e
            ys[m] = layers.linear(weighted(layers.linear(xs[m], w13[e]), w_flat[m]), w2[e])
    if fused:  # each pair's row among the sorted ones, then the sum over k straight from them
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        return combine(ys, inv, k, add=tuple(add))
    y = torch.empty_like(ys)
    y[order] = ys
    # the sum over k in FP32 and a fixed order (bitwise reproducible), read straight from the model dtype
    y = y.view(N, k, -1).sum(1, dtype=torch.float32).to(x.dtype)
    for a in add:
        y = y + a
    return y


MX_CHUNK = 8  # experts (or token-expert pairs) dequantized at a time: ~1 GB of BF16 temporaries at K3 widths
# MXFP4 experts through the grouped kernel (None: where the kernels run on the GPU; PEREGRINE_MXFP4_GROUPED=0 / 1 for an
# A/B); switch as layers.fused. The dequantize-then-GEMM loop below syncs on the expert list and was ~1K tokens/s of
# prefill on the 48B (H100, #65)
MX_GROUPED: bool | None = {"0": False, "1": True}.get(os.environ.get("PEREGRINE_MXFP4_GROUPED", ""))


def mxfp4_grouped(x: torch.Tensor) -> bool:
    """Whether x's MXFP4 experts take kernels/moe_mxfp4_prefill.py's grouped GEMM: on the GPU where the kernels
    run (MX_GROUPED None), or wherever MX_GROUPED says (True: the interpreter's CPU tests)."""
    if MX_GROUPED is not None:
        return MX_GROUPED
    return x.is_cuda and kernels.available(x.device)


def mxfp4_experts(x, q13, s13, q2, s2, ids, w, act, chunk: int = MX_CHUNK, dequantize=mxfp4.dequantize) -> torch.Tensor:
    """grouped_experts over MXFP4 weights, dequantizing only the chosen experts, `chunk` at a time
    (`dequantize`: the layout's, MoE.dequantize).

    Eager: each distinct expert is dequantized once (one host sync for the expert list) and serves
    all of its tokens. Under CUDA-graph capture nothing may sync, so the token-expert pairs are
    taken in order, `chunk` at a time (a repeated expert is dequantized once per pair).
    Either way the weighted sum over k runs in FP32 in a fixed order.
    """
    N, k = ids.shape
    flat = ids.flatten()
    xs = x.repeat_interleave(k, 0)  # row n·k + j: token n for its j-th expert
    ys = torch.empty(N * k, q2.shape[1], dtype=x.dtype, device=x.device)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        for a in range(0, N * k, chunk):
            e = flat[a:a + chunk]
            w13 = dequantize(q13[e], s13[e], x.dtype)  # [c, 2I, Dz]
            h = act(torch.bmm(w13, xs[a:a + chunk].unsqueeze(-1)).squeeze(-1))
            del w13
            w2 = dequantize(q2[e], s2[e], x.dtype)     # [c, Dz, I]
            ys[a:a + chunk] = torch.bmm(w2, h.unsqueeze(-1)).squeeze(-1)
    else:
        sf, order = torch.sort(flat, stable=True)
        used, counts = (t.tolist() for t in torch.unique_consecutive(sf, return_counts=True))  # one host sync
        xs, ys_sorted, row = xs[order], torch.empty_like(ys), 0
        for a in range(0, len(used), chunk):
            sel = torch.tensor(used[a:a + chunk], device=x.device)
            w13 = dequantize(q13[sel], s13[sel], x.dtype)
            w2 = dequantize(q2[sel], s2[sel], x.dtype)
            for j, n in enumerate(counts[a:a + chunk]):
                ys_sorted[row:row + n] = layers.linear(act(layers.linear(xs[row:row + n], w13[j])), w2[j])
                row += n
            del w13, w2
        ys[order] = ys_sorted
    return (ys.view(N, k, -1).float() * w.unsqueeze(-1)).sum(1).to(x.dtype)


class MoE(nn.Module):
    """With tensor parallelism (cfg is a rank's shard) the experts hold a slice of the
    intermediate rows and the output is a partial sum; K3's latent y is summed over ranks
    before its norm, and up_proj holds a column slice of the latent width. With slicing
    (parallel/slicing.py) gate_w holds the rank's E/N experts' rows: the logits are gathered."""

    def __init__(self, cfg: ModelConfig, dtype, tp=SINGLE):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        Dz = cfg.routed_expert_hidden_size or D  # width the routed experts read and write
        self.act = activation(cfg)
        self.router_sliced = slicing(cfg, tp).get("router", "") is None  # gate_w: this rank's E/N rows
        self.gate_w = param(E // tp.world if self.router_sliced else E, D, dtype=dtype)
        self.bias = param(E, dtype=torch.float32)
        self.mx = cfg.expert_quant == "mxfp4"
        if self.mx:
            if Dz % mxfp4.GROUP or I % mxfp4.GROUP:
                raise ConfigError(f"{cfg.name}: MXFP4 experts need widths divisible by {mxfp4.GROUP} (got {Dz}, {I})")
            u8 = torch.uint8
            self.w13 = self.w2 = None
            self.w13_q, self.w13_s = param(E, 2 * I, Dz // 2, dtype=u8), param(E, 2 * I, Dz // mxfp4.GROUP, dtype=u8)
            self.w2_q, self.w2_s = param(E, Dz, I // 2, dtype=u8), param(E, Dz, I // mxfp4.GROUP, dtype=u8)
        else:
            self.w13 = param(E, 2 * I, Dz, dtype=dtype)
            self.w2 = param(E, Dz, I, dtype=dtype)
        self.mx_layout = "checkpoint"  # or "v4" once repack_experts ran (kernels/mxfp4_repack.py)
        self.mx_fold = False
        self.latent = cfg.routed_expert_hidden_size is not None
        if self.latent:
            self.down = param(Dz, D, dtype=dtype)
            self.up = param(D, Dz // tp.world, dtype=dtype)
            self.norm = param(Dz, dtype=dtype)
        ns = cfg.num_shared_experts
        self.shared = DenseMLP(D, I * ns, dtype, act=self.act) if ns else None
        self.last_ids = None  # routed expert ids of the last forward (roofline counts them)

    def hf_params(self, prefix: str) -> list[HFParam]:
        E, I, D = self.cfg.num_experts, self.cfg.moe_intermediate_size, self.cfg.hidden_size
        Dz, G = self.cfg.routed_expert_hidden_size or D, mxfp4.GROUP
        out = [(prefix + "gate.weight", self.gate_w, tuple(self.gate_w.shape)), (prefix + "gate.e_score_correction_bias", self.bias, (E,))]
        if self.latent:
            out += [(prefix + "routed_expert_down_proj.weight", self.down, (Dz, D)),
                    (prefix + "routed_expert_norm.weight", self.norm, (Dz,)),
                    (prefix + "routed_expert_up_proj.weight", self.up, tuple(self.up.shape))]
        for e in range(E):
            p = f"{prefix}experts.{e}."
            if self.mx:
                out += [(p + "w1.weight_packed", self.w13_q[e, :I], (I, Dz // 2)), (p + "w1.weight_scale", self.w13_s[e, :I], (I, Dz // G)),
                        (p + "w3.weight_packed", self.w13_q[e, I:], (I, Dz // 2)), (p + "w3.weight_scale", self.w13_s[e, I:], (I, Dz // G)),
                        (p + "w2.weight_packed", self.w2_q[e], (Dz, I // 2)), (p + "w2.weight_scale", self.w2_s[e], (Dz, I // G))]
            else:
                out += [(p + "w1.weight", self.w13[e, :I], (I, Dz)), (p + "w3.weight", self.w13[e, I:], (I, Dz)),
                        (p + "w2.weight", self.w2[e], (Dz, I))]
        if self.shared is not None:
            out += self.shared.hf_params(prefix + "shared_experts.")
        return out

    def repack_experts(self) -> int:
        """MXFP4 experts to kernels/mxfp4_repack.py's layout in place, an expert at a time (temporaries of one
        expert); the checkpoint names then no longer map onto these tensors (load first). Returns the bytes."""
        from ..kernels import mxfp4_repack
        assert self.mx and self.mx_layout == "checkpoint"
        for name in ("w13", "w2"):
            q, s = getattr(self, name + "_q"), getattr(self, name + "_s")
            st = torch.empty(s.shape[0], s.shape[2], s.shape[1], dtype=s.dtype, device=s.device)
            for e in range(q.shape[0]):
                q.data[e] = mxfp4_repack.repack_codes(q.data[e])
                st[e] = s.data[e].T
            setattr(self, name + "_s", nn.Parameter(st, requires_grad=False))
        self.mx_layout = "v4"
        from ..kernels.moe_mxfp4_v4 import fold_scales
        self.mx_fold = fold_scales(self.w13_s, self.w2_s)  # the v4 decode's folded scales (every scale <= 2)
        return sum(t.numel() for t in (self.w13_q, self.w13_s, self.w2_q, self.w2_s))

    def dequantize(self, q: torch.Tensor, s: torch.Tensor, dtype) -> torch.Tensor:
        """Selected experts' MXFP4 weights in this layer's layout -> dtype."""
        if self.mx_layout == "v4":
            from ..kernels import mxfp4_repack
            return mxfp4_repack.dequantize(q, s, dtype)
        return mxfp4.dequantize(q, s, dtype)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """FP32 [N, E]: the rank's slice of the experts' logits gathered in rank order when sliced."""
        logits = router_gemm(x, self.gate_w)
        return self.tp.all_gather(logits, -1) if self.router_sliced else logits

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual (one rank only: with tensor parallelism the caller adds it after the all-reduce): added to
        the output, as the layer's `h + mlp(...)`, in the experts' combine pass where that runs."""
        c = self.cfg
        ids, w = route_logits(self.router_logits(x), self.bias, c.num_experts_per_token, c.moe_renormalize,
                              c.routed_scaling_factor, x)
        self.last_ids = ids
        z = layers.linear(x, self.down) if self.latent else x
        after = tuple(t for t in (self.shared(x) if self.shared is not None else None, residual) if t is not None)
        mx_grouped = self.mx and mxfp4_grouped(z)
        fold = not self.latent and (mx_grouped or not self.mx)  # the experts' combine adds `after` itself
        if self.mx and not mx_grouped:
            y = mxfp4_experts(z, self.w13_q, self.w13_s, self.w2_q, self.w2_s, ids, w, self.act, dequantize=self.dequantize)
        else:
            mx = (self.w13_q, self.w13_s, self.w2_q, self.w2_s, self.mx_layout == "v4") if self.mx else None
            y = grouped_experts(z, self.w13, self.w2, ids, w, self.act, add=after if fold else (), mx=mx)
        if self.latent:
            lo, hi = self.tp.span(self.norm.shape[0])
            y = layers.linear(rms_norm(self.tp.all_reduce(y), self.norm, c.rms_norm_eps)[:, lo:hi], self.up)
        for t in () if fold else after:
            y = y + t
        return y
