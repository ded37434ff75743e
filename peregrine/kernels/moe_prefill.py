"""The elementwise glue of the MoE prefill around its two grouped GEMMs (models/moe.py grouped_experts).

gather_pairs(x, order, k): xs[p] = x[order[p] // k], the up GEMM's rows in expert order, in one pass
  (torch's x[order // k] is an index kernel plus a division: ~0.8 ms a layer at 32K tokens, 20.8 ms of
  a cold 32K prompt, results/2026-12-02-session10/…-profile-prefill-32k-onestep-405aea7.log).

swiglu_weighted(gu, w): h[p] = round(round(silu(g_p) · u_p) · w_p) from the up GEMM's [P, 2I] output
  (g | u halves), w the pair's routing weight: the torch form's two roundings to the model dtype in
  one pass, where the torch form makes six (an FP32 copy, silu, the product, a cast, the weight, a cast).
combine(ys, inv, k): out[n] = Σ_j ys[inv[n·k + j]] in FP32, j ascending, rounded once, over the down
  GEMM's expert-sorted rows (inv: a pair's row among them), where the torch form scatters ys back to
  pair order, sums in FP32 and casts.
In a profile of an 8K-token prefill step (H200, kimi-linear-48b-a3b, 174 ms of kernels,
results/2026-12-01-session8/…-profile-prefill-b7914a0.log) the elementwise, copy and scatter kernels
these passes make came to ~40 ms by my attribution (26 of the 53 index_put launches, the FP32 casts
and products). FP32 references below.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GATHER_BYTES = 8192  # bytes a gather program moves: ROWS rows of a BLOCK that divides D (no ragged tail block)
BLOCK_I = 1024  # activation columns per program: Kimi-Linear's I in one program
BLOCK_D = 1024  # output columns per combine program (hidden 2304: 3 programs per token)


@triton.jit
def _rounded(x, BF16: tl.constexpr):
    """FP32 x rounded to the nearest BF16 (ties to even), kept in FP32: torch's cast, done in integer
    ops so the interpreter (whose FP32 -> BF16 cast truncates) rounds as the GPU does."""
    if BF16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        x = b.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _swiglu_weighted_kernel(gu_ptr, w_ptr, h_ptr, I, stride_gu, stride_h, BLOCK: tl.constexpr, BF16: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(gu_ptr + p * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + p * stride_gu + I + cols, mask=ok, other=0.0).to(tl.float32)
    a = _rounded(g * tl.sigmoid(g) * u, BF16).to(h_ptr.dtype.element_ty)  # the activation's rounding (torch: swiglu's cast)
    w = tl.load(w_ptr + p)
    tl.store(h_ptr + p * stride_h + cols, _rounded(a.to(tl.float32) * w, BF16).to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combine_kernel(ys_ptr, inv_ptr, out_ptr, a1_ptr, a2_ptr, D, stride_ys, stride_out, stride_a1, stride_a2,
                    K: tl.constexpr, N_ADD: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(K):  # a fixed order: bitwise reproducible
        row = tl.load(inv_ptr + n * K + j).to(tl.int64)
        acc += tl.load(ys_ptr + row * stride_ys + cols, mask=ok, other=0.0).to(tl.float32)
    acc = _rounded(acc, BF16)  # each addend after the sum's rounding: the unfused chain's `y + a` adds
    if N_ADD >= 1:
        acc = _rounded(acc + tl.load(a1_ptr + n * stride_a1 + cols, mask=ok, other=0.0).to(tl.float32), BF16)
    if N_ADD >= 2:
        acc = _rounded(acc + tl.load(a2_ptr + n * stride_a2 + cols, mask=ok, other=0.0).to(tl.float32), BF16)
    tl.store(out_ptr + n * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gather_pairs_kernel(x_ptr, order_ptr, xs_ptr, P, D, stride_x, stride_xs, K: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK: tl.constexpr):
    p = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    p_ok = p < P
    src = tl.load(order_ptr + p, mask=p_ok, other=0).to(tl.int64) // K
    ok = p_ok[:, None] & (cols < D)[None, :]
    row = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :], mask=ok)
    tl.store(xs_ptr + p[:, None] * stride_xs + cols[None, :], row, mask=ok)


def gather_tile(D: int, itemsize: int) -> tuple[int, int]:
    """(rows, block) of a gather program: the largest power-of-two block <= BLOCK_D dividing D (2304: 256, 7168:
    1024; else a padded one), as many rows as make GATHER_BYTES."""
    block = next((b for b in (1024, 512, 256, 128) if b <= BLOCK_D and D % b == 0), min(BLOCK_D, triton.next_power_of_2(D)))
    return max(1, GATHER_BYTES // (block * itemsize)), block


def gather_pairs(x: torch.Tensor, order: torch.Tensor, k: int, out: torch.Tensor | None = None,
                 tile: tuple[int, int] | None = None) -> torch.Tensor:
    """x [N, D] (rows contiguous), order [N·k] (pair indices, token n's j-th pair = n·k + j) -> [N·k, D].
    tile: (rows, block) per program (default gather_tile; the bench tries others)."""
    N, D = x.shape
    P = order.numel()
    assert x.stride(1) == 1 and order.dim() == 1 and P == N * k, (x.shape, order.shape, k)
    xs = torch.empty(P, D, dtype=x.dtype, device=x.device) if out is None else out
    assert xs.shape == (P, D) and xs.stride(1) == 1 and xs.dtype == x.dtype
    if P and D:
        rows, block = tile or gather_tile(D, x.element_size())
        _gather_pairs_kernel[(triton.cdiv(P, rows), triton.cdiv(D, block))](
            x, order.contiguous(), xs, P, D, x.stride(0), xs.stride(0), K=k, ROWS=rows, BLOCK=block)
    return xs


def gather_pairs_ref(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    return x[order // k]


def swiglu_weighted(gu: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gu [P, 2I] (rows contiguous), w [P] FP32 -> [P, I] in gu's dtype."""
    P, I2 = gu.shape
    assert I2 % 2 == 0 and gu.stride(1) == 1 and w.shape == (P,), (gu.shape, w.shape)
    I = I2 // 2
    h = torch.empty(P, I, dtype=gu.dtype, device=gu.device) if out is None else out
    assert h.shape == (P, I) and h.stride(1) == 1
    if P:
        _swiglu_weighted_kernel[(P, triton.cdiv(I, BLOCK_I))](gu, w.float().contiguous(), h, I, gu.stride(0), h.stride(0),
                                                               BLOCK=min(BLOCK_I, triton.next_power_of_2(I)),
                                                               BF16=h.dtype == torch.bfloat16)
    return h


MAX_ADDENDS = 2  # the shared expert's output and the layer's residual


def combine(ys: torch.Tensor, inv: torch.Tensor, k: int, out: torch.Tensor | None = None,
            add: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """ys [N·k, D] (rows in any order), inv [N·k] (pair n·k + j's row in ys) -> [N, D] in ys's dtype; then each
    of `add` ([N, D] in ys's dtype, rows contiguous) added in order, rounding after every add as `y + a` would:
    the separate adds' reads and writes of the [N, D] output saved, bitwise the same result."""
    P, D = ys.shape
    assert ys.stride(1) == 1 and inv.shape == (P,) and P % k == 0, (ys.shape, inv.shape, k)
    N = P // k
    assert len(add) <= MAX_ADDENDS and all(a.shape == (N, D) and a.stride(1) == 1 and a.dtype == ys.dtype for a in add), \
        [(a.shape, a.dtype) for a in add]
    y = torch.empty(N, D, dtype=ys.dtype, device=ys.device) if out is None else out
    assert y.shape == (N, D) and y.stride(1) == 1
    if N:
        a1, a2 = (tuple(add) + (y, y))[:2]  # unused slots: any pointer (N_ADD keeps them unread)
        _combine_kernel[(N, triton.cdiv(D, BLOCK_D))](ys, inv.contiguous(), y, a1, a2, D, ys.stride(0), y.stride(0),
                                                       a1.stride(0), a2.stride(0), K=k, N_ADD=len(add),
                                                       BLOCK=min(BLOCK_D, triton.next_power_of_2(D)),
                                                       BF16=y.dtype == torch.bfloat16)
    return y


def swiglu_weighted_ref(gu: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """FP32 math, rounded where the kernel (and the torch form) rounds."""
    g, u = gu.float().chunk(2, dim=-1)
    a = (g * torch.sigmoid(g) * u).to(gu.dtype)
    return (a.float() * w.float()[:, None]).to(gu.dtype)


def combine_ref(ys: torch.Tensor, inv: torch.Tensor, k: int, add: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    rows = ys.float()[inv].view(-1, k, ys.shape[1])
    acc = rows[:, 0].clone()
    for j in range(1, k):
        acc += rows[:, j]
    y = acc.to(ys.dtype)
    for a in add:
        y = (y.float() + a.float()).to(ys.dtype)
    return y
