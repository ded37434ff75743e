"""RMSNorm, fused residual-add + RMSNorm, and KDA's gated per-head RMSNorm, computed in FP32.

y = x · rsqrt(mean(x²) + eps) · w. One program per row: rows up to MAX_BLOCK
wide are held in registers (one read); wider rows take two passes.
add_rms_norm first rounds residual + x to the residual's dtype and stores it,
then normalises that rounded value, so the norm sees exactly what the next
residual add will read.
gated_rms_norm is KDA's output norm over heads: y[t, h] = RMSNorm(o[t, h])·w ⊙ σ(r[t, h]), reading
strided rows and writing into a strided destination (no copies around it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_kwargs, pdl_wait

MAX_BLOCK = 8192  # widest row kept in registers (K3 hidden 7168 fits); wider rows loop
GATED_ROWS = 32  # tokens per gated-norm program: [32, 128] FP32 tiles, 32 values per thread at 4 warps


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, D, stride_x, stride_r, stride_y, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    y_row = y_ptr + row * stride_y
    if SINGLE:
        ok = cols < D
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)  # a weight: safe before the PDL wait
        pdl_wait(USE_PDL)
        v = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_RES:
            v = v + tl.load(r_row + cols, mask=ok, other=0.0).to(tl.float32)
            v_r = v.to(r_ptr.dtype.element_ty)
            tl.store(r_row + cols, v_r, mask=ok)
            v = v_r.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
        tl.store(y_row + cols, (v * rstd * w).to(y_ptr.dtype.element_ty), mask=ok)
    else:
        pdl_wait(USE_PDL)
        sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, D, BLOCK):
            c = start + cols
            ok = c < D
            v = tl.load(x_row + c, mask=ok, other=0.0).to(tl.float32)
            if HAS_RES:
                v = v + tl.load(r_row + c, mask=ok, other=0.0).to(tl.float32)
                v_r = v.to(r_ptr.dtype.element_ty)
                tl.store(r_row + c, v_r, mask=ok)
                v = v_r.to(tl.float32)
            sq += v * v
        rstd = tl.rsqrt(tl.sum(sq, axis=0) / D + eps)
        tl.debug_barrier()  # the second pass re-reads the residual written above
        for start in range(0, D, BLOCK):
            c = start + cols
            ok = c < D
            if HAS_RES:
                v = tl.load(r_row + c, mask=ok, other=0.0).to(tl.float32)
            else:
                v = tl.load(x_row + c, mask=ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
            tl.store(y_row + c, (v * rstd * w).to(y_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() != 2:  # flattening must be a view: results written through it must land in t
        assert t.is_contiguous(), f"{name}: only 2-D tensors may be strided"
        t = t.view(-1, t.shape[-1])
    assert t.stride(-1) == 1, f"{name} needs a unit inner stride"
    return t


def _launch(x, r, w, y, eps: float) -> None:
    M, D = x.shape
    assert w.shape == (D,) and w.is_contiguous(), "w must be [D] contiguous"
    if M == 0:
        return
    block = min(triton.next_power_of_2(D), MAX_BLOCK)
    warps = 4 if block <= 2048 else 8  # ~16-32 values per thread either way
    res = r if r is not None else x
    _rms_norm_kernel[(M,)](x, res, w, y, D, x.stride(0), res.stride(0), y.stride(0), eps,
                           HAS_RES=r is not None, BLOCK=block, SINGLE=D <= block, num_warps=warps,
                           **launch_kwargs(x.device))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim; result in x.dtype (or written into `out`, may be row-strided)."""
    x2 = _rows(x, "x")
    y = out if out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert y.shape == x.shape
    _launch(x2, None, w, _rows(y, "out"), eps)
    return y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place (kept in residual's dtype); returns (RMSNorm(residual)·w, residual)."""
    assert residual.shape == x.shape
    x2, r2 = _rows(x, "x"), _rows(residual, "residual")
    y = out if out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert y.shape == x.shape
    _launch(x2, r2, w, _rows(y, "out"), eps)
    return y, residual


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """FP32 reference."""
    v = x.float()
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def add_rms_norm_ref(x, residual, w, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 reference; returns (normed, new residual in residual's dtype) without mutating."""
    r = (residual.float() + x.float()).to(residual.dtype)
    return rms_norm_ref(r, w, eps), r


@triton.jit
def _gated_rms_norm_kernel(o_ptr, r_ptr, w_ptr, y_ptr, T, H, D, stride_o, stride_r, stride_y, eps,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    ok = (t < T)[:, None] & (cols < D)[None, :]
    t64 = t.to(tl.int64)[:, None]
    c = h * D + cols[None, :]
    v = tl.load(o_ptr + t64 * stride_o + c, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(r_ptr + t64 * stride_r + c, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
    y = v * rstd[:, None] * w[None, :] * tl.sigmoid(g)
    tl.store(y_ptr + t64 * stride_y + c, y.to(y_ptr.dtype.element_ty), mask=ok)


def gated_rms_norm(o: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """o [T, H, d] (each row's H·d values contiguous, any row stride), r [T, H·d] and `out` [T, H·d] (unit
    inner stride, any row stride) -> out = RMSNorm(o[t, h])·w ⊙ σ(r[t, h]), rounded once to out's dtype
    (default o's)."""
    T, H, D = o.shape
    assert o.stride(2) == 1 and o.stride(1) == D, "o must be [T, H, d] with each row's heads contiguous"
    assert r.shape == (T, H * D) and r.stride(1) == 1, "r must be [T, H·d] with a unit inner stride"
    assert w.shape == (D,) and w.is_contiguous(), "w must be [d] contiguous"
    y = out if out is not None else torch.empty(T, H * D, dtype=o.dtype, device=o.device)
    assert y.shape == (T, H * D) and y.stride(1) == 1, "out must be [T, H·d] with a unit inner stride"
    if T:
        _gated_rms_norm_kernel[(triton.cdiv(T, GATED_ROWS), H)](
            o, r, w, y, T, H, D, o.stride(0), r.stride(0), y.stride(0), eps,
            ROWS=GATED_ROWS, BLOCK=triton.next_power_of_2(D), num_warps=4)
    return y


def gated_rms_norm_ref(o: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """FP32 reference: [T, H·d]."""
    return (rms_norm_ref(o, w, eps) * torch.sigmoid(r.float()).view(o.shape)).flatten(1)
