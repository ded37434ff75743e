"""Fused MoE decode (MODELS.md "MoE layer"): FP32 sigmoid router with top-k,
then the routed experts, each chosen expert's weights read once per step.

Router, two launches: logits [B, E] FP32 (W_r streamed once for all tokens),
then one program per token picks top-k of σ(logit) + bias. Ties go to the
lowest expert index (the reference uses a stable descending sort).

Experts, two launches, no host sync (CUDA-graph capturable), no atomics:
 1. up: grid (B·k assignments, I tiles). The program of assignment n exits
    unless n is the first occurrence of its expert e in the flat topk_ids; the
    first one computes act(W1_e x_b, W3_e x_b) for EVERY token b that chose e
    (the token tile is one tl.dot operand), so W1_e/W3_e are read once.
    Writes h[b, slot_b(e), :] FP32; each (b, slot) has exactly one writer.
 2. down: grid (D tiles). Each program walks the assignments in order, and for
    each first occurrence reads its W2_e rows once and computes W2_e h for all
    tokens that chose e. The result lands (not added) in a per-(token, slot)
    register accumulator, scaled by topk_w; the end sums over slots. So the
    sum order is fixed per token and independent of the rest of the batch:
    outputs are bitwise reproducible and batch invariant.
    An alternative down path, ``down="partials"``, spreads (assignment, D tile)
    over the grid (more parallelism), writes FP32 partials [B, k, D] and a
    third tiny launch sums them over k: also deterministic, equal to "fused"
    up to the order of that final k-sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting

ROUTER_BLOCK_E = 4    # experts per router program: W_r is streamed once, E/4 programs keep the GPU busy
ROUTER_BLOCK_D = 128  # router reduction chunk; the [B, 4, 128] FP32 product stays in registers
UP_BLOCK_I = 32       # gate/up rows per program: 32 I-tiles per expert spread one expert over many SMs
UP_BLOCK_D = 256      # reduction chunk of the gate/up GEMV
DOWN_BLOCK_D = 16     # output rows per down program: the smallest tl.dot N, so D/16 programs
DOWN_BLOCK_I = 256    # reduction chunk of the down GEMV
COMBINE_BLOCK_D = 256  # columns per program of the partials combine
UP_WARPS = 4          # sm_90 ptxas: [32, 256] gate/up tiles fit 4 warps without spills
DOWN_WARPS = 8        # sm_90 ptxas: the down kernel spills at 4 warps, not at 8
MIN_DOT_ROWS = 16     # tl.dot needs M >= 16: the token tile is padded to it
SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0  # SiTU bounds (MODELS.md)
ACTIVATIONS = {"swiglu": 0, "situ": 1}


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


# ----------------------------------------------------------------------------- router
@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, B, E, D, stride_xb,
                          B_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_b = tl.arange(0, B_PAD)
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_d = tl.arange(0, BLOCK_D)
    b_ok, e_ok = offs_b < B, offs_e < E
    w_rows = w_ptr + offs_e.to(tl.int64)[:, None] * D
    acc = tl.zeros([B_PAD, BLOCK_E], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + offs_d
        d_ok = d < D
        x = tl.load(x_ptr + offs_b[:, None] * stride_xb + d[None, :], mask=b_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_rows + d[None, :], mask=e_ok[:, None] & d_ok[None, :], other=0.0)
        # exact FP32 products on CUDA cores (no TF32): the router decides which experts run
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(out_ptr + offs_b[:, None] * E + offs_e[None, :], acc, mask=b_ok[:, None] & e_ok[None, :])


@triton.jit
def _router_topk_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, scaling,
                        TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                        RENORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.arange(0, E_PAD)
    ok = offs < E
    s = tl.sigmoid(tl.load(logits_ptr + b * E + offs, mask=ok, other=0.0))
    choice = s
    if HAS_BIAS:
        choice = s + tl.load(bias_ptr + offs, mask=ok, other=0.0)
    choice = tl.where(ok, choice, float("-inf"))
    slots = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], tl.int32)
    ws = tl.zeros([K_PAD], tl.float32)
    for k in tl.static_range(TOP_K):  # k rounds of argmax; ties -> lowest index
        best = tl.max(choice, axis=0)
        idx = tl.min(tl.where(choice == best, offs, E_PAD), axis=0)
        hit = offs == idx
        ids = tl.where(slots == k, idx, ids)
        ws = tl.where(slots == k, tl.sum(tl.where(hit, s, 0.0), axis=0), ws)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORM:
        ws = ws / tl.sum(ws, axis=0)
    tl.store(ids_ptr + b * TOP_K + slots, ids, mask=slots < TOP_K)
    tl.store(w_ptr + b * TOP_K + slots, ws * scaling, mask=slots < TOP_K)


def moe_route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None, top_k: int,
              renormalize: bool = True, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, D], gate_w [E, D], bias [E] FP32 or None -> (topk_ids [B, k] int32, topk_w [B, k] FP32)."""
    B, D = x.shape
    E = gate_w.shape[0]
    assert gate_w.shape[1] == D and x.stride(1) == 1 and gate_w.is_contiguous() and 0 < top_k <= E
    logits = torch.empty(B, E, dtype=torch.float32, device=x.device)
    ids = torch.empty(B, top_k, dtype=torch.int32, device=x.device)
    w = torch.empty(B, top_k, dtype=torch.float32, device=x.device)
    _router_logits_kernel[(triton.cdiv(E, ROUTER_BLOCK_E),)](
        x, gate_w, logits, B, E, D, x.stride(0),
        B_PAD=_pow2(B), BLOCK_E=ROUTER_BLOCK_E, BLOCK_D=ROUTER_BLOCK_D)
    b = bias.float().contiguous() if bias is not None else logits  # dummy pointer when absent
    _router_topk_kernel[(B,)](logits, b, ids, w, E, float(scaling), TOP_K=top_k, K_PAD=_pow2(top_k),
                              E_PAD=_pow2(E), RENORM=bool(renormalize), HAS_BIAS=bias is not None)
    return ids, w


# ----------------------------------------------------------------------------- experts
# The interpreter pays heavily per nested @jit call, so the hot loops inline
# their helpers; only once-per-expert work goes through _down_tile.
@triton.jit
def _down_tile(h_ptr, w2_ptr, e, chose, slot, D, I, offs_d, d_ok,
               TOP_K: tl.constexpr, B_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr,
               DOT_T: tl.constexpr, PREC: tl.constexpr):
    """[B_PAD, BLOCK_D] = h[b, slot_b] · W2_e[offs_d]ᵀ for the tokens that chose e (others 0)."""
    offs_b = tl.arange(0, B_PAD)
    offs_i = tl.arange(0, BLOCK_I)
    rows = w2_ptr + e.to(tl.int64) * D * I + offs_d.to(tl.int64)[:, None] * I
    h_rows = h_ptr + (offs_b[:, None] * TOP_K + slot[:, None]) * I
    acc = tl.zeros([B_PAD, BLOCK_D], tl.float32)
    for i0 in range(0, I, BLOCK_I):
        i = i0 + offs_i
        i_ok = i < I
        w = tl.load(rows + i[None, :], mask=d_ok[:, None] & i_ok[None, :], other=0.0)
        # h rounds to the weight dtype, as the standard path's BF16 activations do
        h = tl.load(h_rows + i[None, :], mask=chose[:, None] & i_ok[None, :], other=0.0).to(w.dtype)
        acc = tl.dot(h.to(DOT_T), tl.trans(w.to(DOT_T)), acc, input_precision=PREC)
    return acc


@triton.jit
def _expert_up_kernel(x_ptr, w13_ptr, ids_ptr, h_ptr, B, D, I, stride_xb,
                      TOP_K: tl.constexpr, B_PAD: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr,
                      BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr, ACT: tl.constexpr,
                      DOT_T: tl.constexpr, PREC: tl.constexpr, BETA: tl.constexpr, BETA_L: tl.constexpr):
    n = tl.program_id(0)
    offs_n = tl.arange(0, N_PAD)
    e = tl.load(ids_ptr + n)
    all_ids = tl.load(ids_ptr + offs_n, mask=offs_n < B * TOP_K, other=-1)
    # only the first assignment of expert e works; it serves every token that chose e
    if tl.sum(((all_ids == e) & (offs_n < n)).to(tl.int32), axis=0) == 0:
        offs_b = tl.arange(0, B_PAD)
        offs_s = tl.arange(0, K_PAD)
        match = tl.load(ids_ptr + offs_b[:, None] * TOP_K + offs_s[None, :],
                        mask=(offs_b[:, None] < B) & (offs_s[None, :] < TOP_K), other=-1) == e
        chose = tl.sum(match.to(tl.int32), axis=1) > 0
        slot = tl.sum(tl.where(match, offs_s[None, :], 0), axis=1)
        offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        offs_d = tl.arange(0, BLOCK_D)
        i_ok = offs_i < I
        g_rows = w13_ptr + e.to(tl.int64) * 2 * I * D + offs_i.to(tl.int64)[:, None] * D
        u_rows = g_rows + I * D
        acc_g = tl.zeros([B_PAD, BLOCK_I], tl.float32)
        acc_u = tl.zeros([B_PAD, BLOCK_I], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + offs_d
            d_ok = d < D
            wm = i_ok[:, None] & d_ok[None, :]
            wg = tl.load(g_rows + d[None, :], mask=wm, other=0.0).to(DOT_T)
            wu = tl.load(u_rows + d[None, :], mask=wm, other=0.0).to(DOT_T)
            x = tl.load(x_ptr + offs_b[:, None] * stride_xb + d[None, :], mask=chose[:, None] & d_ok[None, :],
                        other=0.0).to(DOT_T)
            acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision=PREC)
            acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=PREC)
        if ACT == 0:  # SwiGLU
            h = acc_g * tl.sigmoid(acc_g) * acc_u
        else:  # SiTU in FP32; tanh(z) = 1 - 2/(e^{2z}+1) saturates cleanly to ±1 (no tl.tanh in core)
            tg = 1.0 - 2.0 / (tl.exp(2.0 * acc_g / BETA) + 1.0)
            tu = 1.0 - 2.0 / (tl.exp(2.0 * acc_u / BETA_L) + 1.0)
            h = BETA * tg * tl.sigmoid(acc_g) * (BETA_L * tu)
        tl.store(h_ptr + (offs_b[:, None] * TOP_K + slot[:, None]) * I + offs_i[None, :], h,
                 mask=chose[:, None] & i_ok[None, :])


@triton.jit
def _expert_down_kernel(h_ptr, w2_ptr, ids_ptr, tw_ptr, out_ptr, B, D, I, stride_ob,
                        TOP_K: tl.constexpr, B_PAD: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr, DOT_T: tl.constexpr, PREC: tl.constexpr):
    offs_b = tl.arange(0, B_PAD)
    offs_s = tl.arange(0, K_PAD)
    offs_n = tl.arange(0, N_PAD)
    offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    bs_ok = (offs_b[:, None] < B) & (offs_s[None, :] < TOP_K)
    all_ids = tl.load(ids_ptr + offs_n, mask=offs_n < B * TOP_K, other=-1)
    tok_ids = tl.load(ids_ptr + offs_b[:, None] * TOP_K + offs_s[None, :], mask=bs_ok, other=-1)
    tw = tl.load(tw_ptr + offs_b[:, None] * TOP_K + offs_s[None, :], mask=bs_ok, other=0.0)
    acc3 = tl.zeros([B_PAD, K_PAD, BLOCK_D], tl.float32)  # one slot per (token, k): written once, never summed into
    for n in range(0, B * TOP_K):
        e = tl.load(ids_ptr + n)
        if tl.sum(((all_ids == e) & (offs_n < n)).to(tl.int32), axis=0) == 0:
            match = tok_ids == e
            chose = tl.sum(match.to(tl.int32), axis=1) > 0
            slot = tl.sum(tl.where(match, offs_s[None, :], 0), axis=1)
            y = _down_tile(h_ptr, w2_ptr, e, chose, slot, D, I, offs_d, d_ok, TOP_K, B_PAD, BLOCK_D, BLOCK_I,
                           DOT_T, PREC)
            acc3 = tl.where(match[:, :, None], y[:, None, :] * tw[:, :, None], acc3)
    out = tl.sum(acc3, axis=1)
    tl.store(out_ptr + offs_b[:, None] * stride_ob + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(offs_b[:, None] < B) & d_ok[None, :])


@triton.jit
def _expert_down_partials_kernel(h_ptr, w2_ptr, ids_ptr, tw_ptr, part_ptr, B, D, I,
                                 TOP_K: tl.constexpr, B_PAD: tl.constexpr, K_PAD: tl.constexpr,
                                 N_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr,
                                 DOT_T: tl.constexpr, PREC: tl.constexpr):
    n = tl.program_id(0)
    offs_n = tl.arange(0, N_PAD)
    e = tl.load(ids_ptr + n)
    all_ids = tl.load(ids_ptr + offs_n, mask=offs_n < B * TOP_K, other=-1)
    if tl.sum(((all_ids == e) & (offs_n < n)).to(tl.int32), axis=0) == 0:
        offs_b = tl.arange(0, B_PAD)
        offs_s = tl.arange(0, K_PAD)
        match = tl.load(ids_ptr + offs_b[:, None] * TOP_K + offs_s[None, :],
                        mask=(offs_b[:, None] < B) & (offs_s[None, :] < TOP_K), other=-1) == e
        chose = tl.sum(match.to(tl.int32), axis=1) > 0
        slot = tl.sum(tl.where(match, offs_s[None, :], 0), axis=1)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        y = _down_tile(h_ptr, w2_ptr, e, chose, slot, D, I, offs_d, d_ok, TOP_K, B_PAD, BLOCK_D, BLOCK_I,
                       DOT_T, PREC)
        row = offs_b * TOP_K + slot
        y = y * tl.load(tw_ptr + row, mask=chose, other=0.0)[:, None]
        tl.store(part_ptr + row[:, None] * D + offs_d[None, :], y, mask=chose[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(part_ptr, out_ptr, D, stride_ob, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    offs_s = tl.arange(0, K_PAD)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    p = tl.load(part_ptr + (b * TOP_K + offs_s[:, None]) * D + offs_d[None, :],
                mask=(offs_s[:, None] < TOP_K) & d_ok[None, :], other=0.0)
    tl.store(out_ptr + b * stride_ob + offs_d, tl.sum(p, axis=0).to(out_ptr.dtype.element_ty), mask=d_ok)


def _dot_meta(wdtype: torch.dtype) -> dict:
    # FP32 weights: exact FP32 products (no TF32). The interpreter's tl.dot mis-reads
    # BF16 operands, so it gets FP32 too (BF16 products are exact in FP32 anyway).
    if wdtype == torch.float32 or interpreting():
        return dict(DOT_T=tl.float32, PREC="ieee")
    return dict(DOT_T=tl.bfloat16 if wdtype == torch.bfloat16 else tl.float16, PREC="tf32")  # PREC unused for 16-bit


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                topk_w: torch.Tensor, *, activation: str = "swiglu", out: torch.Tensor | None = None,
                workspace: torch.Tensor | None = None, down: str = "fused") -> torch.Tensor:
    """out[b] = Σ_k topk_w[b,k] · W2_e act(W1_e x_b, W3_e x_b), e = topk_ids[b,k]; out in x.dtype.

    w13 [E, 2I, D] (gate rows then up rows), w2 [E, D, I], topk_ids [B, k] int32 (distinct per token),
    topk_w [B, k] FP32. workspace: optional FP32 [B, k, I] for the activations h.
    down: "fused" (2 launches) or "partials" (3 launches, more parallel down GEMV).
    """
    B, D = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    k = topk_ids.shape[1]
    assert w13.shape == (E, 2 * I, D) and w2.shape == (E, D, I) and w13.dtype == w2.dtype
    assert w13.is_contiguous() and w2.is_contiguous() and x.stride(1) == 1
    assert topk_ids.dtype == torch.int32 and topk_ids.is_contiguous() and topk_w.shape == (B, k)
    topk_w = topk_w.float().contiguous()
    if out is None:
        out = torch.empty(B, D, dtype=x.dtype, device=x.device)
    assert out.shape == (B, D) and out.stride(1) == 1
    h = workspace if workspace is not None else torch.empty(B, k, I, dtype=torch.float32, device=x.device)
    assert h.shape == (B, k, I) and h.dtype == torch.float32 and h.is_contiguous()
    meta = dict(TOP_K=k, B_PAD=max(MIN_DOT_ROWS, _pow2(B)), K_PAD=_pow2(k), N_PAD=_pow2(B * k),
                **_dot_meta(w13.dtype))
    _expert_up_kernel[(B * k, triton.cdiv(I, UP_BLOCK_I))](
        x, w13, topk_ids, h, B, D, I, x.stride(0),
        BLOCK_I=UP_BLOCK_I, BLOCK_D=UP_BLOCK_D, ACT=ACTIVATIONS[activation],
        BETA=SITU_BETA, BETA_L=SITU_LINEAR_BETA, num_warps=UP_WARPS, **meta)
    if down == "fused":
        _expert_down_kernel[(triton.cdiv(D, DOWN_BLOCK_D),)](
            h, w2, topk_ids, topk_w, out, B, D, I, out.stride(0), BLOCK_D=DOWN_BLOCK_D, BLOCK_I=DOWN_BLOCK_I,
            num_warps=DOWN_WARPS, **meta)
    elif down == "partials":
        part = torch.empty(B, k, D, dtype=torch.float32, device=x.device)
        _expert_down_partials_kernel[(B * k, triton.cdiv(D, DOWN_BLOCK_D))](
            h, w2, topk_ids, topk_w, part, B, D, I, BLOCK_D=DOWN_BLOCK_D, BLOCK_I=DOWN_BLOCK_I,
            num_warps=DOWN_WARPS, **meta)
        _combine_kernel[(B, triton.cdiv(D, COMBINE_BLOCK_D))](
            part, out, D, out.stride(0), TOP_K=k, K_PAD=_pow2(k), BLOCK_D=COMBINE_BLOCK_D)
    else:
        raise ValueError(f"down must be 'fused' or 'partials', got {down!r}")
    return out


def moe_forward(x, gate_w, bias, w13, w2, top_k: int, renormalize: bool = True, scaling: float = 1.0,
                activation: str = "swiglu", out=None, down: str = "fused") -> torch.Tensor:
    """Routed part of the MoE layer (no shared expert): route then experts, 4 launches."""
    ids, w = moe_route(x, gate_w, bias, top_k, renormalize, scaling)
    return moe_experts(x, w13, w2, ids, w, activation=activation, out=out, down=down)


# ----------------------------------------------------------------------------- references (FP32)
def moe_route_ref(x, gate_w, bias, top_k: int, renormalize: bool = True, scaling: float = 1.0):
    """MODELS.md router in FP32; ties broken toward the lowest expert index (stable sort)."""
    s = torch.sigmoid(x.float() @ gate_w.float().t())
    choice = s + (bias.float() if bias is not None else 0.0)
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return ids.to(torch.int32), w * scaling


def moe_experts_ref(x, w13, w2, topk_ids, topk_w, activation: str = "swiglu") -> torch.Tensor:
    """Loop over tokens and their chosen experts, all in FP32. Returns FP32 [B, D]."""
    I = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for b in range(x.shape[0]):
        xb = x[b].float()
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[b, j])
            g = w13[e, :I].float() @ xb
            u = w13[e, I:].float() @ xb
            if activation == "swiglu":
                h = torch.nn.functional.silu(g) * u
            else:
                h = (SITU_BETA * torch.tanh(g / SITU_BETA) * torch.sigmoid(g)
                     * SITU_LINEAR_BETA * torch.tanh(u / SITU_LINEAR_BETA))
            out[b] += float(topk_w[b, j]) * (w2[e].float() @ h)
    return out
