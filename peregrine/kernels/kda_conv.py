"""KDA prefill's short conv, fused (docs/models.md "KDA layer"): one pass from a row's raw q|k|v projections to
chunk_kda's inputs.

x [T, 3·H·d] (a column slice of the fused in_proj output: any row stride) follows its conv window
win [W-1, 3·H·d] (the W-1 inputs before the row). Per channel c and token t:
    y[t, c] = SiLU(Σ_j w[c, j] · x_ext[t + j, c]),  x_ext = win ++ x
and q, k are L2-normalised per head (y · rsqrt(Σ y² + eps)), v is y. The result is one [3, T, H, d]
tensor (q, k, v planes, each contiguous), in FP32 arithmetic rounded once. This replaces four passes
of the fla path: the copy that makes x contiguous for fla's conv, the conv, the copies that split its
output into q, k, v, and fla's two L2-norm passes (H200, a 32K prompt of 48B: ~58 ms of 655 in all).

Grid (token blocks, 3·H): a program owns BLOCK_T tokens of one head of q, k or v, so each head's norm
is a reduction within the program. CH_MAJOR=True swaps the grid so heads vary fastest and programs running
together read neighbouring 256-byte pieces of the same rows: a candidate for the kernel's 46 % of the copy
bandwidth, not yet timed on a GPU (bench kernels_kda_conv times both orders).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# H200 (results/2026-12-02-session11/…-kernels-kda-conv-7867924.json): heads fastest in the grid with 64-token
# blocks, 0.683 ms at 32K tokens (0.179 at 8K) against 0.826 (0.215) for 32-token blocks, tokens fastest
BLOCK_T = 64     # tokens per program: [64, 128] FP32 = 64 registers per thread at 4 warps
NUM_WARPS = 4
CH_MAJOR = True  # grid order: heads fastest (a token block's programs read neighbouring columns together)


@triton.jit
def _kda_conv_kernel(x_ptr, win_ptr, w_ptr, out_ptr, T, H, stride_x, stride_win, stride_plane, eps,
                     D: tl.constexpr, W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                     CH_MAJOR: tl.constexpr):
    if CH_MAJOR:
        ch = tl.program_id(0)          # head ch of q | k | v: channels ch·D … ch·D + D - 1
        tb = tl.program_id(1)
    else:
        tb = tl.program_id(0)
        ch = tl.program_id(1)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    c = ch * D + dd
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(W):
        r = t + (j - (W - 1))          # the input row tap j reads; r < 0: the window's row r + W - 1
        in_x = (r >= 0) & t_ok
        in_win = (r < 0) & t_ok
        xv = tl.load(x_ptr + r.to(tl.int64)[:, None] * stride_x + c[None, :], mask=in_x[:, None] & d_ok[None, :], other=0.0)
        wv = tl.load(win_ptr + (r + (W - 1))[:, None] * stride_win + c[None, :], mask=in_win[:, None] & d_ok[None, :],
                     other=0.0)
        tap = tl.load(w_ptr + c * W + j, mask=d_ok, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + wv.to(tl.float32)) * tap[None, :]
    y = acc * tl.sigmoid(acc)
    plane = ch // H                    # 0 q, 1 k, 2 v
    inv = tl.rsqrt(tl.sum(y * y, axis=1) + eps)
    y = y * tl.where(plane < 2, inv, 1.0)[:, None]
    dst = out_ptr + plane.to(tl.int64) * stride_plane + (t.to(tl.int64)[:, None] * H + ch % H) * D + dd[None, :]
    tl.store(dst, y.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :])


def kda_conv(x: torch.Tensor, win: torch.Tensor, w: torch.Tensor, H: int, eps: float,
             out: torch.Tensor | None = None, block_t: int = BLOCK_T, num_warps: int = NUM_WARPS,
             ch_major: bool = CH_MAJOR) -> torch.Tensor:
    """x [T, 3·H·d] (unit inner stride), win [W-1, 3·H·d], w [3·H·d, W] -> [3, T, H, d] in x's dtype:
    L2-normalised q, k and v after the short conv + SiLU. `out` may be a [3, T, H, d] view whose planes
    are strided (rows of a larger buffer)."""
    T, C = x.shape
    d = C // (3 * H)
    W = w.shape[1]
    assert C == 3 * H * d and x.stride(1) == 1, "x must be [T, 3·H·d] with a unit inner stride"
    assert win.shape == (W - 1, C) and win.stride(1) == 1 and w.shape == (C, W) and w.is_contiguous()
    if out is None:
        out = torch.empty(3, T, H, d, dtype=x.dtype, device=x.device)
    assert out.shape == (3, T, H, d) and out[0].is_contiguous(), "out planes must be [T, H, d] contiguous"
    if T == 0:
        return out
    blocks = triton.cdiv(T, block_t)
    _kda_conv_kernel[(3 * H, blocks) if ch_major else (blocks, 3 * H)](
        x, win, w, out, T, H, x.stride(0), win.stride(0), out.stride(0), eps,
        D=d, W=W, BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(d), CH_MAJOR=ch_major, num_warps=num_warps)
    return out


def kda_conv_ref(x: torch.Tensor, win: torch.Tensor, w: torch.Tensor, H: int, eps: float) -> torch.Tensor:
    """FP32 reference: [3, T, H, d]."""
    W = w.shape[1]
    x_ext = torch.cat([win, x]).float()
    y = torch.stack([x_ext[j:j + x.shape[0]] for j in range(W)], -1)   # [T, C, W]: tap j is input t - (W-1) + j
    y = torch.nn.functional.silu((y * w.float()).sum(-1))
    q, k, v = y.view(x.shape[0], 3, H, -1).unbind(1)
    nrm = lambda z: z * torch.rsqrt(z.pow(2).sum(-1, keepdim=True) + eps)  # noqa: E731
    return torch.stack([nrm(q), nrm(k), v])
