"""MXFP4 routed experts for decode: the 4-bit weights are read as stored and dequantized in registers
(weights E2M1 + E8M0, activations BF16, FP32 accumulate). The entry point is moe_mxfp4_experts; its
kernels are kernels/moe_mxfp4_v3.py's ("v3": the weights as the MMA's register operand with a packed
BF16x2 decode), kernels/moe.py's combine sums over k. Also here: its FP32 reference and mxfp4_gemv.

Layout (kernels/mxfp4_format.py): a weight [R, C] is packed [R, C/2] uint8 (element 2j in the low
nibble, 2j+1 in the high one) with one E8M0 scale byte per 32 values [R, C/32]. Stacked per expert:
w13 [E, 2I, Dz/2] + [E, 2I, Dz/32] (gate rows then up rows), w2 [E, Dz, I/2] + [E, Dz, I/32].

Same schedule as kernels/moe.py (no host sync, CUDA-graph capturable, no atomics): the first assignment
of each chosen expert works and serves every token that chose it, so its weights are read once per step.
s = 255 (E8M0 NaN) makes its group NaN, as in mxfp4_format.dequantize; s = 0 (2^-127) reads as 0.

Two earlier forms lost to v3 at every B on the H200 and were removed (docs/experiments.md): v1, the tokens
on the MMA's M side with the dequantized weights staged through shared memory (~19 instructions a value),
and v2, a word decode into FP32 FMAs with one scale multiply per group.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import moe_mxfp4_v3 as v3
from .moe import _pow2, moe_combine, moe_experts_ref
from .moe_mxfp4_v3 import _tile
from .mxfp4_format import GROUP, dequantize

BPG = GROUP // 2                     # packed bytes per scale group
GEMV_BLOCK_R, GEMV_BLOCK_KB = 16, 128                   # one-matrix GEMV tiles (small M, no tl.dot)
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def moe_mxfp4_experts(x: torch.Tensor, q13: torch.Tensor, s13: torch.Tensor, q2: torch.Tensor, s2: torch.Tensor,
                      topk_ids: torch.Tensor, topk_w: torch.Tensor, *, activation: str = "swiglu",
                      out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """out[b] = Σ_k topk_w[b,k] · W2_e act(W1_e x_b, W3_e x_b) over MXFP4 experts; out in x.dtype.

    x [B, Dz] (BF16 or FP32), q13 [E, 2I, Dz/2] uint8 + s13 [E, 2I, Dz/32] uint8, q2 [E, Dz, I/2] + s2 [E, Dz, I/32],
    topk_ids [B, k] int32 (distinct per token), topk_w [B, k] FP32. config: overrides of moe_mxfp4_v3.KEYS
    (the decode and the tiles; the benchmark's sweep), else v3's per-B defaults.
    """
    B, Dz = x.shape
    E, two_i, kb_up = q13.shape
    I = two_i // 2
    k = topk_ids.shape[1]
    assert Dz % GROUP == 0 and I % GROUP == 0 and kb_up * 2 == Dz
    assert s13.shape == (E, 2 * I, Dz // GROUP) and q2.shape == (E, Dz, I // 2) and s2.shape == (E, Dz, I // GROUP)
    assert all(t.dtype == torch.uint8 and t.is_contiguous() for t in (q13, s13, q2, s2)), "packed weights: contiguous uint8"
    assert x.stride(1) == 1 and topk_ids.dtype == torch.int32 and topk_ids.is_contiguous() and topk_w.shape == (B, k)
    topk_w = topk_w.float().contiguous()
    if out is None:
        out = torch.empty(B, Dz, dtype=x.dtype, device=x.device)
    assert out.shape == (B, Dz) and out.stride(1) == 1
    h = torch.empty(B, k, I, dtype=torch.float32, device=x.device)
    part = torch.empty(B, k, Dz, dtype=torch.float32, device=x.device)
    v3.launch(x, q13, s13, q2, s2, topk_ids, h, part, activation, _TL[x.dtype], config)
    return moe_combine(part.view(1, B * k, Dz), topk_w, out=out)  # kernels/moe.py's fixed-order k-sum


def moe_mxfp4_experts_ref(x, q13, s13, q2, s2, topk_ids, topk_w, activation: str = "swiglu") -> torch.Tensor:
    """FP32: each chosen expert dequantized (mxfp4_format's table path), then the token loop of
    kernels/moe.py's reference. Returns FP32 [B, Dz]."""
    used = sorted(set(topk_ids.flatten().tolist()))
    remap = {e: j for j, e in enumerate(used)}
    u = torch.tensor(used, device=q13.device)
    w13 = dequantize(q13[u], s13[u], torch.float32)
    w2 = dequantize(q2[u], s2[u], torch.float32)
    ids = topk_ids.cpu().clone().apply_(lambda e: remap[e]).to(topk_ids.device)
    return moe_experts_ref(x, w13, w2, ids, topk_w, activation)


# ---- one MXFP4 matrix (or one per row) times activations: y = W x, FMA form for M ≤ 4 ----------------------
@triton.jit
def _mx_gemv_kernel(x_ptr, q_ptr, s_ptr, ids_ptr, y_ptr, R, KB, stride_xm, stride_ym,
                    HAS_IDS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr, BPG: tl.constexpr):
    pid_r, m = tl.program_id(0), tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    rows = offs_r.to(tl.int64)
    if HAS_IDS:  # this row's expert
        rows += tl.load(ids_ptr + m).to(tl.int64) * R
    KG = KB // BPG
    offs_k = tl.arange(0, BLOCK_KB)
    acc = tl.zeros([BLOCK_R, BLOCK_KB], tl.float32)
    for kb0 in range(0, KB, BLOCK_KB):
        k = kb0 + offs_k
        k_ok = k < KB
        xe = tl.load(x_ptr + m * stride_xm + 2 * k, mask=k_ok, other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + m * stride_xm + 2 * k + 1, mask=k_ok, other=0.0).to(tl.float32)
        lo, hi = _tile(q_ptr, s_ptr, rows, r_ok, kb0, KB, KG, BLOCK_R, BLOCK_KB, BPG)
        acc += lo * xe[None, :] + hi * xo[None, :]
    tl.store(y_ptr + m * stride_ym + offs_r, tl.sum(acc, axis=1), mask=r_ok)


def mxfp4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """y[m] = W_{ids[m]} x[m] in FP32, reading the 4-bit weights directly.

    x [M, C] (BF16/FP32, unit stride), packed [E, R, C/2] uint8 and scale [E, R, C/32] uint8
    (or [R, ...] without ids: every row uses the same weight), ids [M] int -> out [M, R] FP32.
    """
    M, C = x.shape
    if ids is None:
        packed, scale = packed.unsqueeze(0), scale.unsqueeze(0)
    E, R, C2 = packed.shape
    assert C == 2 * C2 and C % GROUP == 0 and scale.shape == (E, R, C // GROUP)
    assert packed.is_contiguous() and scale.is_contiguous() and x.stride(1) == 1
    if out is None:
        out = torch.empty(M, R, dtype=torch.float32, device=x.device)
    assert out.shape == (M, R) and out.stride(1) == 1 and out.dtype == torch.float32
    ids_arg = ids.contiguous() if ids is not None else packed  # unread when HAS_IDS is off
    _mx_gemv_kernel[(triton.cdiv(R, GEMV_BLOCK_R), M)](
        x, packed, scale, ids_arg, out, R, C2, x.stride(0), out.stride(0),
        HAS_IDS=ids is not None, BLOCK_R=GEMV_BLOCK_R, BLOCK_KB=max(BPG, min(GEMV_BLOCK_KB, _pow2(C2))), BPG=BPG)
    return out
