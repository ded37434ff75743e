"""KDA decode in one Triton launch per layer step (MODELS.md "KDA layer", steps 2-6 up to W_o).

One program per (sequence b, head h) keeps the head's whole d×d FP32 state in
registers for all T positions (T = 1 + speculative tokens): causal conv + SiLU
of its 3·d q|k|v channels, L2 norms, gate, delta-rule update, o = Sᵀq, the
per-head output RMSNorm and σ(r) gate. Each state row/conv channel is owned by
exactly one program, so the in-place cache updates need no cross-program sync.
State layout: state[slot, h, K, V] (row = key channel), as in peregrine/cache.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SOFTPLUS_LINEAR = tl.constexpr(20.0)  # softplus(x) == x in FP32 beyond this; avoids exp overflow
BIG_TILE = 128          # d at which the 64 KB state tile wants 8 warps (fewer spills)


@triton.jit
def _raw(x_ptr, cs_ptr, ch, m, i, stride_t, stride_cj, W: tl.constexpr):
    """Raw input of channels `ch` at position i (i < 0: from the conv state), as FP32."""
    a = tl.load(x_ptr + i * stride_t + ch, mask=m & (i >= 0), other=0.0).to(tl.float32)
    c = tl.load(cs_ptr + (W - 1 + i) * stride_cj + ch, mask=m & (i < 0), other=0.0).to(tl.float32)
    return a + c


@triton.jit
def _conv_silu(x_ptr, cs_ptr, cw_ptr, stride_cw, ch, m, t, stride_t, stride_cj, W: tl.constexpr):
    acc = tl.zeros(ch.shape, tl.float32)
    for j in tl.static_range(W):  # tap j multiplies x[t - (W-1) + j]
        w = tl.load(cw_ptr + ch * stride_cw + j, mask=m, other=0.0).to(tl.float32)
        acc += w * _raw(x_ptr, cs_ptr, ch, m, t - (W - 1) + j, stride_t, stride_cj, W)
    return acc * tl.sigmoid(acc)


@triton.jit
def _conv_after(x_ptr, cs_ptr, ch, m, n, stride_t, stride_cj, W: tl.constexpr, BLOCK_W: tl.constexpr):
    """The conv state after n positions (the last W-1 raw inputs, oldest first): [BLOCK_W, BLOCK_D]."""
    j = tl.arange(0, BLOCK_W)[:, None]
    i = n - (W - 1) + j
    mj = (j < W - 1) & m[None, :]
    a = tl.load(x_ptr + i * stride_t + ch[None, :], mask=mj & (i >= 0), other=0.0).to(tl.float32)
    c = tl.load(cs_ptr + (W - 1 + i) * stride_cj + ch[None, :], mask=mj & (i < 0), other=0.0).to(tl.float32)
    return a + c


@triton.jit
def _store_conv(dst_ptr, stride_dj, x, ch, m, W: tl.constexpr, BLOCK_W: tl.constexpr):
    j = tl.arange(0, BLOCK_W)[:, None]
    tl.store(dst_ptr + j * stride_dj + ch[None, :], x.to(dst_ptr.dtype.element_ty), mask=(j < W - 1) & m[None, :])


@triton.jit
def _kda_decode_kernel(
    qkv, f, bl, r, conv_w, A_log, dt_bias, onw, state, conv_state, slots, out, sck, cck,
    T, H, D,
    s_qkv_b, s_qkv_t, s_f_b, s_f_t, s_b_b, s_b_t, s_r_b, s_r_t, s_o_b, s_o_t, s_cw,
    s_st_s, s_st_h, s_st_k, s_cs_s, s_cs_j,
    s_sck_b, s_sck_t, s_sck_h, s_sck_k, s_cck_b, s_cck_t, s_cck_j,
    lower_bound, eps_qk, eps_o, q_scale,
    W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, SOFTPLUS: tl.constexpr, CKPT: tl.constexpr,
):
    pb = tl.program_id(0)
    h = tl.program_id(1)
    HD = H * D
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    ch_q = h * D + offs
    ch_k = HD + ch_q
    ch_v = 2 * HD + ch_q
    slot = tl.load(slots + pb).to(tl.int64)

    x_b = qkv + pb.to(tl.int64) * s_qkv_b
    cs = conv_state + slot * s_cs_s
    st = state + slot * s_st_s + h * s_st_h
    sp = st + offs[:, None] * s_st_k + offs[None, :]
    m2 = m[:, None] & m[None, :]
    S = tl.load(sp, mask=m2, other=0.0)

    a = tl.exp(tl.load(A_log + h).to(tl.float32))
    dtb = tl.load(dt_bias + ch_q, mask=m, other=0.0).to(tl.float32)
    nw = tl.load(onw + offs, mask=m, other=0.0).to(tl.float32)

    for t in range(T):
        q = _conv_silu(x_b, cs, conv_w, s_cw, ch_q, m, t, s_qkv_t, s_cs_j, W)
        k = _conv_silu(x_b, cs, conv_w, s_cw, ch_k, m, t, s_qkv_t, s_cs_j, W)
        v = _conv_silu(x_b, cs, conv_w, s_cw, ch_v, m, t, s_qkv_t, s_cs_j, W)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps_qk) * q_scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps_qk)

        g = tl.load(f + pb * s_f_b + t * s_f_t + ch_q, mask=m, other=0.0).to(tl.float32) + dtb
        if SOFTPLUS:
            sp_g = tl.where(g > SOFTPLUS_LINEAR, g, tl.log(1.0 + tl.exp(tl.minimum(g, SOFTPLUS_LINEAR))))
            gam = -a * sp_g
        else:
            gam = lower_bound * tl.sigmoid(a * g)
        beta = tl.sigmoid(tl.load(bl + pb * s_b_b + t * s_b_t + h).to(tl.float32))

        S = S * tl.exp(gam)[:, None]                  # decay rows (key channels)
        ks = tl.sum(k[:, None] * S, axis=0)           # Sᵀk over V
        u = beta * (v - ks)
        S = S + k[:, None] * u[None, :]
        o = tl.sum(q[:, None] * S, axis=0)            # Sᵀq over V

        o = o * tl.rsqrt(tl.sum(o * o, axis=0) / D + eps_o) * nw
        rg = tl.load(r + pb * s_r_b + t * s_r_t + ch_q, mask=m, other=0.0).to(tl.float32)
        o = o * tl.sigmoid(rg)
        tl.store(out + pb * s_o_b + t * s_o_t + ch_q, o.to(out.dtype.element_ty), mask=m)

        if CKPT:
            sk = sck + pb.to(tl.int64) * s_sck_b + t * s_sck_t + h * s_sck_h
            tl.store(sk + offs[:, None] * s_sck_k + offs[None, :], S, mask=m2)
            ck = cck + pb.to(tl.int64) * s_cck_b + t * s_cck_t
            for g3 in tl.static_range(3):  # q, k, v channel groups of this head
                chg = ch_q + g3 * HD
                cw = _conv_after(x_b, cs, chg, m, t + 1, s_qkv_t, s_cs_j, W, BLOCK_W)
                _store_conv(ck, s_cck_j, cw, chg, m, W, BLOCK_W)

    tl.store(sp, S, mask=m2)
    # In place: read every old entry before any thread overwrites one.
    nq = _conv_after(x_b, cs, ch_q, m, T, s_qkv_t, s_cs_j, W, BLOCK_W)
    nk = _conv_after(x_b, cs, ch_k, m, T, s_qkv_t, s_cs_j, W, BLOCK_W)
    nv = _conv_after(x_b, cs, ch_v, m, T, s_qkv_t, s_cs_j, W, BLOCK_W)
    tl.debug_barrier()
    _store_conv(cs, s_cs_j, nq, ch_q, m, W, BLOCK_W)
    _store_conv(cs, s_cs_j, nk, ch_k, m, W, BLOCK_W)
    _store_conv(cs, s_cs_j, nv, ch_v, m, W, BLOCK_W)


def _check(qkv, f, b, r, conv_w, state, conv_state, slots, state_ckpt, conv_ckpt):
    B, T, C3 = qkv.shape
    H = b.shape[-1]
    d = C3 // (3 * H)
    W = conv_w.shape[-1]
    assert C3 == 3 * H * d and f.shape == (B, T, H * d) and r.shape == (B, T, H * d) and b.shape == (B, T, H)
    assert state.shape[1:] == (H, d, d) and state.dtype == torch.float32
    assert conv_state.shape[1:] == (W - 1, C3) and slots.shape == (B,)
    assert (state_ckpt is None) == (conv_ckpt is None), "give both checkpoint buffers or neither"
    if state_ckpt is not None:
        assert state_ckpt.shape == (B, T, H, d, d) and conv_ckpt.shape == (B, T, W - 1, C3)
    return B, T, H, d, W


def kda_decode(qkv, f, b, r, conv_w, A_log, dt_bias, o_norm_w, state, conv_state, slots, *,
               gate="softplus", lower_bound=-5.0, eps_qk=1e-6, eps_o=1e-5, out=None,
               state_ckpt=None, conv_ckpt=None, num_warps=None):
    """One KDA layer step for B sequences × T positions; updates state/conv_state in place.

    qkv [B,T,3Hd], f/r [B,T,Hd], b [B,T,H] may be strided views of one GEMM output
    (last dim contiguous). Returns o [B,T,Hd] (before W_o) in qkv's dtype (or `out`).
    """
    assert gate in ("softplus", "bounded")
    conv_w = conv_w.reshape(conv_w.shape[0], -1)  # accept the checkpoint's [C,1,W]
    B, T, H, d, W = _check(qkv, f, b, r, conv_w, state, conv_state, slots, state_ckpt, conv_ckpt)
    A_log = A_log.reshape(-1).contiguous()
    conv_w, dt_bias, o_norm_w = conv_w.contiguous(), dt_bias.contiguous(), o_norm_w.contiguous()
    if out is None:
        out = torch.empty(B, T, H * d, dtype=qkv.dtype, device=qkv.device)
    for x in (qkv, f, b, r, out):
        assert x.stride(-1) == 1, "last dim must be contiguous"
    assert state.stride(-1) == 1 and conv_state.stride(-1) == 1
    ckpt = state_ckpt is not None
    sck = state_ckpt if ckpt else state
    cck = conv_ckpt if ckpt else conv_state
    if ckpt:
        assert state_ckpt.stride(-1) == 1 and conv_ckpt.stride(-1) == 1
    BLOCK_D = triton.next_power_of_2(d)
    _kda_decode_kernel[(B, H)](
        qkv, f, b, r, conv_w, A_log, dt_bias, o_norm_w, state, conv_state, slots, out, sck, cck,
        T, H, d,
        qkv.stride(0), qkv.stride(1), f.stride(0), f.stride(1), b.stride(0), b.stride(1),
        r.stride(0), r.stride(1), out.stride(0), out.stride(1), conv_w.stride(0),
        state.stride(0), state.stride(1), state.stride(2), conv_state.stride(0), conv_state.stride(1),
        sck.stride(0), sck.stride(1), sck.stride(2), sck.stride(3) if ckpt else 0,
        cck.stride(0), cck.stride(1), cck.stride(2) if ckpt else 0,
        float(lower_bound), float(eps_qk), float(eps_o), d ** -0.5,
        W=W, BLOCK_W=triton.next_power_of_2(W - 1), BLOCK_D=BLOCK_D, SOFTPLUS=gate == "softplus", CKPT=ckpt,
        num_warps=num_warps or (8 if BLOCK_D >= BIG_TILE else 4),
    )
    return out


def kda_decode_ref(qkv, f, b, r, conv_w, A_log, dt_bias, o_norm_w, state, conv_state, slots, *,
                   gate="softplus", lower_bound=-5.0, eps_qk=1e-6, eps_o=1e-5, out=None,
                   state_ckpt=None, conv_ckpt=None, num_warps=None):
    """Plain FP32 PyTorch, straight from MODELS.md; same in-place effects as kda_decode
    (num_warps is accepted and ignored, so both take the same arguments)."""
    conv_w = conv_w.reshape(conv_w.shape[0], -1).float()
    B, T, H, d, W = _check(qkv, f, b, r, conv_w, state, conv_state, slots, state_ckpt, conv_ckpt)
    a = A_log.reshape(-1).float().exp()                        # [H]
    res = torch.empty(B, T, H * d, dtype=torch.float32, device=qkv.device)
    for i in range(B):
        s = int(slots[i])
        hist = torch.cat([conv_state[s], qkv[i]], 0)           # raw inputs, oldest first [W-1+T, C]
        S = state[s].clone()                                   # [H, K, V]
        for t in range(T):
            win = hist[t:t + W].float()                        # x[t-(W-1)] .. x[t]
            y = (win.T * conv_w).sum(-1)                       # [C]
            y = y * torch.sigmoid(y)
            q, k, v = y.view(3, H, d)
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps_qk) * d ** -0.5
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps_qk)
            g = (f[i, t].float() + dt_bias.float()).view(H, d)
            if gate == "softplus":
                gam = -a[:, None] * F.softplus(g)
            else:
                gam = lower_bound * torch.sigmoid(a[:, None] * g)
            beta = torch.sigmoid(b[i, t].float())              # [H]
            S = S * gam.exp()[:, :, None]
            u = beta[:, None] * (v - (S * k[:, :, None]).sum(1))  # no matmul: no TF32 on GPU
            S = S + k[:, :, None] * u[:, None, :]
            o = (S * q[:, :, None]).sum(1)
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps_o) * o_norm_w.float()
            res[i, t] = (o * torch.sigmoid(r[i, t].float().view(H, d))).reshape(-1)
            if state_ckpt is not None:
                state_ckpt[i, t] = S
                conv_ckpt[i, t] = hist[t + 1:t + W]
        state[s] = S
        conv_state[s] = hist[T:T + W - 1]
    if out is None:
        return res.to(qkv.dtype)
    out.copy_(res)
    return out
