"""Residual add + RMSNorm in the prologue of the decode skinny GEMM (issue #20: fewer, fatter kernels).

    v = round(x + residual)            (the residual's dtype; written to residual_out by one program column)
    y = round(v · rsqrt(mean(v²) + eps) · w_norm) @ W.T      (the norm's output rounded to x's dtype, FP32 acc)

the same rounding points as kernels/norm.add_rms_norm followed by kernels/gemm.skinny_gemm, in one launch
instead of two. Every program needs its rows' full-row RMS, so it first sums v² over all of K (M ≤ 16 rows
of x: a few KB from L2), then streams its weight tile as gemm._gemm_kernel does, normalising each x tile
on the fly. With split-K each split repeats the (cheap) prologue. The residual is written by the programs
of N tile 0 and split 0 only, to a buffer other than the one read: other programs may still be reading it
(no grid-wide barrier), so the decode step would ping-pong two residual buffers.

Where it helps: the attention in-projections (KDA and MLA) are the only readers of their norm's output, so
the 27 add_rms_norm launches before them can go (B = 1: the norm kernel is launch- and latency-bound).
The MoE's norm feeds the router, the experts and the shared expert, so it stays. The decode step takes it
with {"decode_fused_norm": true} (decode/specialized.py _norm_in_proj; off):
`python -m peregrine.bench.kernels_norm_gemm` times it against the two-kernel chain. Measured on the H200
(63b08d0, results/2026-12-02-session12): slower than the chain at every in-projection shape and B = 1..8
(B = 1 KDA 23.2 vs 19.6 µs; bench decode 2.706 vs 2.561 ms), so the flag stays off.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import gemm
from .gemm import _mac, _tile, _use_ieee


@triton.jit
def _rows_v(x_ptrs, r_ptrs, row_ok, kk, K, HAS_RES: tl.constexpr, EVEN_K: tl.constexpr, RDT: tl.constexpr):
    """v = x (+ residual, rounded to the residual's dtype) for one [BLOCK_M, BLOCK_K] tile, in FP32."""
    v = _tile(x_ptrs, row_ok, kk, K, EVEN_K).to(tl.float32)
    if HAS_RES:
        v = (v + _tile(r_ptrs, row_ok, kk, K, EVEN_K).to(tl.float32)).to(RDT).to(tl.float32)
    return v


@triton.jit
def _norm_gemm_kernel(x_ptr, r_ptr, ro_ptr, nw_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_rm, stride_rom,
                      stride_wn, stride_ym, stride_ys, k_per_split, eps,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                      IEEE: tl.constexpr, EVEN_K: tl.constexpr, HAS_RES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    RDT = r_ptr.dtype.element_ty
    x_row = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    r_row = r_ptr + rm[:, None].to(tl.int64) * stride_rm
    writer = (pid_n == 0) & (pid_s == 0)
    # prologue: the full rows' sum of squares (and, by one program column, the new residual)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        v = _rows_v(x_row + kk[None, :], r_row + kk[None, :], m_ok, kk, K, HAS_RES, False, RDT)
        sq += tl.sum(v * v, axis=1)
        if HAS_RES:
            if writer:
                tl.store(ro_ptr + rm[:, None].to(tl.int64) * stride_rom + kk[None, :], v.to(RDT),
                         mask=m_ok[:, None] & (kk < K)[None, :])
    rstd = tl.rsqrt(sq / K + eps)
    k0 = pid_s * k_per_split
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :]
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        kk = k0 + k + rk
        wk = _tile(w_ptrs, n_ok, kk, K, EVEN_K)
        v = _rows_v(x_row + kk[None, :], r_row + kk[None, :], m_ok, kk, K, HAS_RES, EVEN_K, RDT)
        nw = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        xn = (v * rstd[:, None] * nw[None, :]).to(x_ptr.dtype.element_ty)  # the norm's rounding, as add_rms_norm
        acc = _mac(acc, xn, wk, USE_DOT, IEEE)
        w_ptrs += BLOCK_K
    if not USE_DOT:
        acc = tl.sum(acc, axis=2)
    y_ptrs = y_ptr + pid_s.to(tl.int64) * stride_ys + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def norm_gemm(x: torch.Tensor, w_norm: torch.Tensor, w: torch.Tensor, eps: float,
              residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
              out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """y = RMSNorm(x [+ residual])·w_norm @ w.T for x [M, K] (M ≤ 16), w [N, K]; with a residual, its sum with
    x is written to residual_out (required, and not the residual itself). `config` as skinny_gemm's plan."""
    M, K = x.shape
    N = w.shape[0]
    for t, name in ((x, "x"), (w, "w")):
        gemm._check_2d(t, name)
    assert w.shape[1] == K and w_norm.shape == (K,) and w_norm.is_contiguous(), (x.shape, w.shape, w_norm.shape)
    if residual is not None:
        assert residual_out is not None, "the residual's sum goes to residual_out"
        assert residual.shape == x.shape == residual_out.shape and residual.stride(1) == residual_out.stride(1) == 1
        assert residual_out.data_ptr() != residual.data_ptr(), "residual_out must not alias the residual it reads"
    y = out if out is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    assert y.shape == (M, N) and y.stride(1) == 1
    if M == 0:
        return y
    cfg = config or gemm.lookup(M, N, K)
    if cfg["kernel"] in ("torch", "resident"):  # the plan's cuBLAS / resident shapes: the prologue needs this kernel
        cfg = gemm.heuristic(M, N, K)
    grid, k_per, tile = gemm.tiling(M, N, K, cfg)  # the skinny GEMM's tiles for this config
    split = grid[1]
    r = residual if residual is not None else x
    ro = residual_out if residual_out is not None else x
    meta = dict(tile, IEEE=_use_ieee(x, w), HAS_RES=residual is not None)
    args = (x, r, ro, w_norm, w)
    strides = (x.stride(0), r.stride(0), ro.stride(0), w.stride(0))
    if split == 1:
        _norm_gemm_kernel[grid](*args, y, M, N, K, *strides, y.stride(0), 0, k_per, float(eps), **meta)
        return y
    ws = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    _norm_gemm_kernel[grid](*args, ws, M, N, K, *strides, N, M * N, k_per, float(eps), **meta)
    gemm._splitk_reduce_kernel[(triton.cdiv(N, gemm.REDUCE_BLOCK), M)](ws, y, N, M * N, N, y.stride(0), SPLIT_K=split,
                                                                       BLOCK=gemm.REDUCE_BLOCK, num_warps=4)
    return y


def norm_gemm_ref(x, w_norm, w, eps, residual=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FP32 math with the kernel's rounding points -> (y FP32, the new residual or None)."""
    v = x.float() if residual is None else (x.float() + residual.float()).to(residual.dtype).float()
    n = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w_norm.float()).to(x.dtype)
    return n.float() @ w.float().t(), (None if residual is None else v.to(residual.dtype))
