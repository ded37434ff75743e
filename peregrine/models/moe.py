"""Sigmoid-routed MoE with a shared expert (MODELS.md "MoE layer").

Experts are stored stacked — w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I] —
so one tensor serves the standard path (grouped GEMM) and the fused kernels.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .layers import DenseMLP, HFParam, param, swiglu


def route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, scaling: float):
    """FP32 router: -> (ids [N, k] long, weights [N, k] FP32)."""
    s = torch.sigmoid(x.float() @ gate_w.float().T)
    ids = torch.topk(s + bias.float(), top_k, dim=-1, sorted=True).indices
    w = s.gather(-1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, w * scaling


def grouped_experts(x, w13, w2, ids, w, act) -> torch.Tensor:
    """Σ_k w[n,k]·E_ids[n,k](x[n]) with each used expert's weights read once per step.

    Token-expert pairs are sorted by expert and run as one grouped GEMM (no host
    sync, so a decode step can be graph-captured); the weighted sum over k runs
    in a fixed order, so results are bitwise reproducible.
    """
    N, k = ids.shape
    E = w13.shape[0]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    xs = x[order // k]
    if hasattr(torch, "_grouped_mm") and (x.device.type == "cpu" or x.dtype == torch.bfloat16):
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)  # bincount would sync on its size
        h = act(torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs))
        ys = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    else:  # older torch / other dtypes: loop over the experts actually used
        ys = torch.empty(N * k, w2.shape[1], dtype=x.dtype, device=x.device)
        sf = flat[order]
        for e in torch.unique(sf).tolist():
            m = sf == e
            ys[m] = act(xs[m] @ w13[e].T) @ w2[e].T
    y = torch.empty_like(ys)
    y[order] = ys
    return (y.view(N, k, -1).float() * w.unsqueeze(-1)).sum(1).to(x.dtype)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype):
        super().__init__()
        if cfg.routed_expert_hidden_size is not None or cfg.expert_quant:
            raise NotImplementedError("latent / MXFP4 MoE (Kimi K3) is not implemented yet")
        self.cfg = cfg
        E, I, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_w = param(E, D, dtype=dtype)
        self.bias = param(E, dtype=torch.float32)
        self.w13 = param(E, 2 * I, D, dtype=dtype)
        self.w2 = param(E, D, I, dtype=dtype)
        ns = cfg.num_shared_experts
        self.shared = DenseMLP(D, I * ns, dtype) if ns else None
        self.last_ids = None  # routed expert ids of the last forward (roofline counts them)

    def hf_params(self, prefix: str) -> list[HFParam]:
        E, I, D = self.w13.shape[0], self.cfg.moe_intermediate_size, self.cfg.hidden_size
        out = [(prefix + "gate.weight", self.gate_w, (E, D)), (prefix + "gate.e_score_correction_bias", self.bias, (E,))]
        for e in range(E):
            p = f"{prefix}experts.{e}."
            out += [(p + "w1.weight", self.w13[e, :I], (I, D)), (p + "w3.weight", self.w13[e, I:], (I, D)),
                    (p + "w2.weight", self.w2[e], (D, I))]
        if self.shared is not None:
            out += self.shared.hf_params(prefix + "shared_experts.")
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        ids, w = route(x, self.gate_w, self.bias, c.num_experts_per_token, c.moe_renormalize, c.routed_scaling_factor)
        self.last_ids = ids
        y = grouped_experts(x, self.w13, self.w2, ids, w, swiglu)
        return y + self.shared(x) if self.shared is not None else y
