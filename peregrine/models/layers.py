"""Shared building blocks: norms, activations, the dense MLP, and the
checkpoint-name table every module exposes.

Weights that read the same input are stored fused (one GEMM streams them once)
and the checkpoint's separate tensors are row slices of the fused parameter:
``hf_params()`` yields (checkpoint name, view into our parameter, checkpoint
shape) and is the single source for loading, saving and dummy init.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HFParam = tuple[str, torch.Tensor, tuple[int, ...]]


def param(*shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float()).to(x.dtype)


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    g, u = gu.float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(gu.dtype)


def situ(gu: torch.Tensor, beta: float, beta_l: float) -> torch.Tensor:
    """K3's SiTU: β·tanh(g/β)·σ(g) · β_l·tanh(u/β_l), in FP32."""
    g, u = gu.float().chunk(2, dim=-1)
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * beta_l * torch.tanh(u / beta_l)).to(gu.dtype)


def split_rows(p: torch.Tensor, prefix: str, parts: list[tuple[str, int]], tail: tuple[int, ...]) -> list[HFParam]:
    """Checkpoint tensors stacked along dim 0 of the fused parameter `p`."""
    out, off = [], 0
    for name, n in parts:
        out.append((prefix + name, p[off:off + n], (n, *tail)))
        off += n
    assert off == p.shape[0], (prefix, off, p.shape)
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype):
        super().__init__()
        self.weight, self.eps = param(dim, dtype=dtype), eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class DenseMLP(nn.Module):
    """SwiGLU (or SiTU) MLP with gate and up fused: used by dense layers and shared experts."""

    def __init__(self, hidden: int, inter: int, dtype, act=swiglu):
        super().__init__()
        self.inter, self.act = inter, act
        self.gate_up = param(2 * inter, hidden, dtype=dtype)
        self.down = param(hidden, inter, dtype=dtype)

    def forward(self, x):
        return self.act(x @ self.gate_up.T) @ self.down.T

    def hf_params(self, prefix: str) -> list[HFParam]:
        D = self.gate_up.shape[1]
        return split_rows(self.gate_up, prefix, [("gate_proj.weight", self.inter), ("up_proj.weight", self.inter)], (D,)) + [
            (prefix + "down_proj.weight", self.down, tuple(self.down.shape))]
