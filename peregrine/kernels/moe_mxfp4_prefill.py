"""The MoE prefill's grouped GEMM over MXFP4 expert weights: rows sorted by expert, each expert's weights decoded
from their E2M1 codes and E8M0 scales inside the GEMM (never a BF16 copy), no host sync, so a prefill step with
MXFP4 experts replays from CUDA graphs as the BF16 one does (models/moe.py mxfp4_experts, decode/prefill_graphs.py).

grouped_mm(a, codes, scales, counts, v4, rows) -> out [P, R]: out[p] = a[rows[p]] @ W[e]^T for the p-th row of
expert e's run (rows sorted by expert, counts[e] of them; rows None: a's own rows in order), W[e] = dequantize(codes[e],
scales[e]) [R, K]. The layouts (kernels/mxfp4_format.py, kernels/mxfp4_repack.py): codes [E, R, K/2] uint8, two codes a
byte; scales [E, R, K/32] (checkpoint) or [E, K/32, R] (v4, the decode kernels' layout on Hopper).

A program owns BLOCK_M rows of one expert's run and BLOCK_N output columns. Its expert and first row come from the
run lengths on the device (a bisection over the experts' cumulative block counts): the grid is sized for the worst
case (every expert's last block partial) and the programs past the last block return at once. Per BLOCK_K step it
loads the weight tile's bytes [BLOCK_N, BLOCK_K/2], splits each into its two codes and joins them in byte order:
the checkpoint layout's byte j holds elements 2j, 2j+1, so the joined tile is in element order; v4's 32-bit word
holds its 8 elements in the order V4_ORDER, so the joined tile is too, and the A tile is loaded with its columns in
that order (a gather within each 8-column word) instead of the weights reordered. Codes become values through the
E2M1 bit pattern (sign | exponent | mantissa into FP32's fields), times the group's 2^(scale - 127), cast to A's
dtype, then one tl.dot. FP32 reference below (grouped_mm_ref): dequantize and matmul per expert.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting, mxfp4_format, mxfp4_repack
from .mxfp4_format import GROUP

V4_ORDER = mxfp4_repack.ORDER  # element of each nibble slot of a v4 word (slot s holds element V4_ORDER[s])
BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 64  # rows of one expert, output columns, reduction step (a multiple of 32)
GROUP_C = tl.constexpr(GROUP)  # the format's group, as the kernels see it
NUM_WARPS, NUM_STAGES = 4, 3  # untuned: the H100 run picks them (bench/kernels_moe_mxfp4_prefill.py)


@triton.jit
def _e2m1(code):
    """E2M1 codes (int32, 0..15: sign bit 3, exponent bits 1-2, mantissa bit 0) -> FP32 values, exactly."""
    mag = code & 7
    e = mag >> 1
    # normal (e > 0): 2^(e-1) · (1 + m/2) -> FP32 exponent e - 1 + 127, mantissa bit 22; subnormal: 0 or 0.5
    exp = tl.where(e > 0, e + 126, tl.where(mag == 1, 126, 0))
    man = tl.where(e > 0, (mag & 1) << 22, 0)
    return (((code >> 3) << 31) | (exp << 23) | man).to(tl.float32, bitcast=True)


@triton.jit
def _grouped_mm_kernel(a_ptr, rows_ptr, codes_ptr, scale_ptr, cum_rows_ptr, cum_blocks_ptr, out_ptr,
                       R, K, E, stride_a, stride_ce, stride_cr, stride_se, stride_sr, stride_sg, stride_o,
                       HAS_ROWS: tl.constexpr, V4: tl.constexpr, LOG2_E: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0)
    total = tl.load(cum_blocks_ptr + E - 1)
    if b >= total:
        return
    # the expert whose blocks hold b: the first e with cum_blocks[e] > b (bisection over E entries)
    lo, hi = 0, E - 1
    for _ in tl.static_range(LOG2_E):
        mid = (lo + hi) // 2
        go_right = tl.load(cum_blocks_ptr + mid) <= b
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    e = lo
    blocks_before = tl.where(e > 0, tl.load(cum_blocks_ptr + e - 1, mask=e > 0, other=0), 0)
    run_start = tl.where(e > 0, tl.load(cum_rows_ptr + e - 1, mask=e > 0, other=0), 0)
    run_end = tl.load(cum_rows_ptr + e)
    r = run_start + (b - blocks_before) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < run_end
    src = tl.load(rows_ptr + r, mask=r_ok, other=0) if HAS_ROWS else r
    src = src.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < R
    kk = tl.arange(0, BLOCK_K)
    if V4:  # column of A for each joined weight column: the v4 word's element order
        a_col = (kk // 8) * 8 + 2 * (kk % 4) + (kk % 8) // 4
    else:
        a_col = kk
    jj = tl.arange(0, BLOCK_K // 2)
    gg = tl.arange(0, BLOCK_K // GROUP_C)
    c_base = codes_ptr + e.to(tl.int64) * stride_ce + n.to(tl.int64)[:, None] * stride_cr
    s_base = scale_ptr + e.to(tl.int64) * stride_se + n.to(tl.int64)[:, None] * stride_sr
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + src[:, None] * stride_a + (k0 + a_col)[None, :],
                    mask=r_ok[:, None] & (k0 + a_col < K)[None, :], other=0.0)
        byte = tl.load(c_base + (k0 // 2 + jj)[None, :], mask=n_ok[:, None] & (k0 // 2 + jj < K // 2)[None, :],
                       other=0).to(tl.int32)
        w = tl.reshape(tl.join(_e2m1(byte & 15), _e2m1(byte >> 4)), (BLOCK_N, BLOCK_K))
        g = k0 // GROUP_C + gg
        s = tl.load(s_base + g[None, :] * stride_sg, mask=n_ok[:, None] & (g < K // GROUP_C)[None, :], other=127)
        scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # E8M0: 2^(s - 127)
        w = tl.reshape(tl.reshape(w, (BLOCK_N, BLOCK_K // GROUP_C, GROUP_C)) * scale[:, :, None], (BLOCK_N, BLOCK_K))
        if IEEE:  # FP32 operands (or the interpreter, whose BF16 dot is garbage): exact FP32 products, not TF32
            acc = tl.dot(a.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_o + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & n_ok[None, :])


def run_offsets(counts: torch.Tensor, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [E] rows a run -> (cumulative rows, cumulative BLOCK_M blocks), int32 on the device: no host sync."""
    c = counts.to(torch.int32)
    return torch.cumsum(c, 0, dtype=torch.int32), torch.cumsum((c + block_m - 1) // block_m, 0, dtype=torch.int32)


def grouped_mm(a: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor, v4: bool,
               rows: torch.Tensor | None = None, out: torch.Tensor | None = None,
               tile: tuple[int, int, int] = (BLOCK_M, BLOCK_N, BLOCK_K), num_warps: int = NUM_WARPS,
               num_stages: int = NUM_STAGES) -> torch.Tensor:
    """a [N, K] (rows contiguous), codes [E, R, K/2] uint8, scales (v4: [E, K/32, R]; else [E, R, K/32]) uint8,
    counts [E] (sum P), rows [P] (a's row of each sorted row; None: P = N, a's rows in order) -> [P, R] in a's
    dtype, rows in expert order. The worst-case grid: P / BLOCK_M + E programs a column tile."""
    E, R, K2 = codes.shape
    K = 2 * K2
    P = a.shape[0] if rows is None else rows.numel()
    assert a.shape[1] == K and a.stride(1) == 1 and K % GROUP == 0 and counts.shape == (E,), (a.shape, codes.shape)
    assert scales.shape == ((E, K // GROUP, R) if v4 else (E, R, K // GROUP)), (scales.shape, v4)
    assert codes.stride(2) == 1 and codes.dtype == torch.uint8 and scales.dtype == torch.uint8
    bm, bn, bk = tile
    assert bk % GROUP == 0 and (not v4 or bk % 8 == 0)
    o = torch.empty(P, R, dtype=a.dtype, device=a.device) if out is None else out
    assert o.shape == (P, R) and o.stride(1) == 1
    if P == 0 or R == 0:
        return o
    cum_rows, cum_blocks = run_offsets(counts, bm)
    s_e, s_r, s_g = (scales.stride(0), scales.stride(2), scales.stride(1)) if v4 else scales.stride()
    idx = rows.contiguous() if rows is not None else cum_rows  # (unused without rows: a valid pointer)
    grid = (triton.cdiv(P, bm) + E, triton.cdiv(R, bn))
    _grouped_mm_kernel[grid](a, idx, codes, scales, cum_rows, cum_blocks, o, R, K, E, a.stride(0),
                             codes.stride(0), codes.stride(1), s_e, s_r, s_g, o.stride(0),
                             HAS_ROWS=rows is not None, V4=v4, LOG2_E=max(1, (E - 1).bit_length()),
                             IEEE=a.dtype == torch.float32 or interpreting(),
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=num_warps, num_stages=num_stages)
    return o


def grouped_mm_ref(a: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, counts: torch.Tensor, v4: bool,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """FP32: each expert's weights dequantized whole (the format's own helpers), its run's rows times them."""
    x = (a if rows is None else a[rows.long()]).float()
    out = torch.empty(x.shape[0], codes.shape[1], dtype=torch.float32, device=a.device)
    at = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            w = (mxfp4_repack.dequantize(codes[e], scales[e]) if v4 else mxfp4_format.dequantize(codes[e], scales[e]))
            out[at:at + n] = x[at:at + n] @ w.float().T
        at += n
    return out
