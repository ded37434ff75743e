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

from .. import kernels

HFParam = tuple[str, torch.Tensor, tuple[int, ...]]


def param(*shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


FUSED: bool | None = None  # kernels for prefill-sized steps: the one-pass RMSNorm (kernels/norm.py) and the
#   shared expert's SwiGLU (kernels/moe_prefill.py). None: on the GPU outside FP32 runs (the oracle keeps
#   the torch forms); True: any rows, also under the interpreter (tests); False: never
FUSED_MIN_ROWS = 64  # fewer rows: decode steps keep the torch form the specialized path is checked against


INVARIANT_KERNELS: bool | None = None  # batch-invariant mode's kernel forms on the standard path (fixed-tile GEMMs,
#   the one-pass norms, the flash attention without splits): None on the GPU; True also under the interpreter (tests)


def invariant_kernels(x: torch.Tensor) -> bool:
    """Whether this step runs batch-invariant mode's kernel forms (docs/correctness.md §5): the mode is on and the
    kernels run here (the GPU; the CPU's interpreter where INVARIANT_KERNELS says)."""
    if not kernels.batch_invariant() or INVARIANT_KERNELS is False:
        return False
    return (x.is_cuda or bool(INVARIANT_KERNELS)) and kernels.available(x.device)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T; in batch-invariant mode with the same bits for a row whatever the rows beside it."""
    if not kernels.batch_invariant():
        return x @ w.T
    x2 = x.reshape(-1, x.shape[-1])
    if invariant_kernels(x):  # one fixed-tile GEMM for every row count (cuBLAS picks its kernel, so a row's sums, by M)
        from ..kernels.gemm import prefill_invariant_config, skinny_gemm
        y = skinny_gemm(x2 if x2.stride(-1) == 1 else x2.contiguous(), w, config=prefill_invariant_config(*w.shape))
    else:  # PyTorch a row at a time: a BLAS GEMM's kernel and edge tiles change with M, one row's product does not
        y = torch.cat([r @ w.T for r in x2.split(1)]) if x2.shape[0] > 1 else x2 @ w.T
    return y.view(*x.shape[:-1], w.shape[0])


def fused(x: torch.Tensor, switch: bool | None = None) -> bool:
    """Whether this step's token-parallel elementwise work takes the kernels: `switch` (default FUSED)
    True / False, or None: a prefill-sized step on the GPU outside FP32 (any step in batch-invariant mode: the
    kernels reduce a row in one order whatever the rows, torch's reductions pick their split by the tensor's size)."""
    switch = FUSED if switch is None else switch
    if switch is False:
        return False
    if invariant_kernels(x):
        return True
    rows = x.numel() // max(1, x.shape[-1])
    on = switch or (x.is_cuda and x.dtype != torch.float32 and rows >= FUSED_MIN_ROWS)
    return bool(on) and kernels.available(x.device)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) · w in FP32, rounded once to x's dtype. A prefill-sized step on the GPU takes
    one kernel pass (the torch form is ~6 passes over an FP32 copy: ~150 µs a norm at 8K × 2304 on H200)."""
    if (x.dim() == 2 or x.is_contiguous()) and x.stride(-1) == 1 and fused(x):
        from ..kernels.norm import rms_norm as one_pass
        return one_pass(x, w.contiguous(), eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float()).to(x.dtype)


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + a), x + a), the sum rounded to the model dtype before the norm. A prefill-sized GPU step takes
    one kernel pass that writes the sum over `a` (a temporary the caller owns); x is never written."""
    if (x.shape == a.shape and a.dim() == 2 and a.is_contiguous() and x.stride(-1) == 1 and x.dtype == a.dtype
            and fused(a)):
        from ..kernels.norm import add_rms_norm as one_pass
        return one_pass(x, a, w.contiguous(), eps)
    h = x + a
    return rms_norm(h, w, eps), h


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
        gu = linear(x, self.gate_up)
        if self.act is swiglu and gu.dim() == 2 and fused(gu):  # one pass (weight 1: the same rounding as the torch form's)
            from ..kernels.moe_prefill import swiglu_weighted
            return linear(swiglu_weighted(gu, gu.new_ones(gu.shape[0], dtype=torch.float32)), self.down)
        return linear(self.act(gu), self.down)

    def hf_params(self, prefix: str) -> list[HFParam]:
        D = self.gate_up.shape[1]
        return split_rows(self.gate_up, prefix, [("gate_proj.weight", self.inter), ("up_proj.weight", self.inter)], (D,)) + [
            (prefix + "down_proj.weight", self.down, tuple(self.down.shape))]
