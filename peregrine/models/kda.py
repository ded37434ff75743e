"""KDA (Kimi Delta Attention): gated delta-rule linear attention, FP32 state.

The recurrent form here is the reference for both prefill and decode
(MODELS.md "KDA layer"); decode sequences of a step are processed together,
prefill sequences one at a time over their tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .layers import HFParam, param, rms_norm, split_rows

QK_NORM_EPS = 1e-6  # eps of the q/k L2 norms (MODELS.md)


def causal_conv(x_ext: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU. x_ext [B, W-1+T, C] (state then new inputs), w [C, W] -> [B, T, C] FP32."""
    W = w.shape[1]
    win = x_ext.float().unfold(1, W, 1)  # [B, T, C, W], tap j is input t-(W-1)+j
    return F.silu((win * w.float()).sum(-1))


def l2norm(x: torch.Tensor, eps: float = QK_NORM_EPS) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, H: int, lower_bound: float | None) -> torch.Tensor:
    """Log-space decay per key channel, [..., H, d]."""
    f = (f.float() + dt_bias.float()).unflatten(-1, (H, -1))
    a = torch.exp(A_log.float()).view(H, 1)
    if lower_bound is None:
        return -a * F.softplus(f)
    return lower_bound * torch.sigmoid(a * f)


def delta_step(S: torch.Tensor, q, k, v, g, beta) -> torch.Tensor:
    """One token for a batch of heads, in place on S [B, H, K, V]; q,k,g [B,H,K], v [B,H,V], beta [B,H]."""
    S.mul_(torch.exp(g).unsqueeze(-1))
    u = beta.unsqueeze(-1) * (v - torch.einsum("bhkv,bhk->bhv", S, k))
    S.add_(k.unsqueeze(-1) * u.unsqueeze(-2))
    return torch.einsum("bhkv,bhk->bhv", S, q)


class KDA(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        H, d, D = cfg.kda_num_heads, cfg.kda_head_dim, cfg.hidden_size
        self.H, self.d = H, d
        self.rank = d  # low-rank gate width (f_a / g_a) = head_dim in the published checkpoints
        g_w = H * d if cfg.kda_full_rank_gate else self.rank
        # one GEMM for everything that reads x: q | k | v | f_a | g_a (or g) | b
        self.splits = [3 * H * d, self.rank, g_w, H]
        self.in_proj = param(sum(self.splits), D, dtype=dtype)
        self.f_b = param(H * d, self.rank, dtype=dtype)
        self.g_b = None if cfg.kda_full_rank_gate else param(H * d, self.rank, dtype=dtype)
        self.conv_w = param(3 * H * d, cfg.kda_conv_size, dtype=dtype)
        self.A_log = param(H, dtype=torch.float32)
        self.dt_bias = param(H * d, dtype=torch.float32)
        self.o_norm = param(d, dtype=dtype)
        self.o_proj = param(D, H * d, dtype=dtype)

    def hf_params(self, prefix: str) -> list[HFParam]:
        H, d, D, W = self.H, self.d, self.cfg.hidden_size, self.cfg.kda_conv_size
        gname = ("g_proj.weight", H * d) if self.cfg.kda_full_rank_gate else ("g_a_proj.weight", self.rank)
        out = split_rows(self.in_proj, prefix, [("q_proj.weight", H * d), ("k_proj.weight", H * d), ("v_proj.weight", H * d),
                                                ("f_a_proj.weight", self.rank), gname, ("b_proj.weight", H)], (D,))
        conv = self.conv_w.view(3 * H * d, 1, W)
        out += split_rows(conv, prefix, [("q_conv1d.weight", H * d), ("k_conv1d.weight", H * d), ("v_conv1d.weight", H * d)], (1, W))
        out += [(prefix + "f_b_proj.weight", self.f_b, (H * d, self.rank))]
        if self.g_b is not None:
            out += [(prefix + "g_b_proj.weight", self.g_b, (H * d, self.rank))]
        out += [(prefix + "A_log", self.A_log, (1, 1, H, 1)), (prefix + "dt_bias", self.dt_bias, (H * d,)),
                (prefix + "o_norm.weight", self.o_norm, (d,)), (prefix + "o_proj.weight", self.o_proj, (D, H * d))]
        return out

    def project(self, x: torch.Tensor):
        """x [N, D] -> qkv (raw, pre-conv) [N, 3Hd], f [N, Hd], beta logits [N, H], r [N, Hd]."""
        qkv, fa, ga, b = (x @ self.in_proj.T).split(self.splits, dim=-1)
        f = fa @ self.f_b.T
        r = ga if self.g_b is None else ga @ self.g_b.T
        return qkv, f, b, r

    def mix(self, y: torch.Tensor, f, b, S: torch.Tensor) -> torch.Tensor:
        """y [B, T, 3Hd] conv outputs for B sequences of T tokens; S [B,H,K,V] updated in place -> o [B,T,H,d] FP32."""
        H, d = self.H, self.d
        q, k, v = y.unflatten(-1, (3, H, d)).unbind(2)
        q, k = l2norm(q) * d ** -0.5, l2norm(k)
        g = kda_gate(f, self.A_log, self.dt_bias, H, self.cfg.kda_gate_lower_bound)
        beta = torch.sigmoid(b.float())
        return torch.stack([delta_step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t]) for t in range(y.shape[1])], 1)

    def output(self, o: torch.Tensor, r: torch.Tensor, dtype) -> torch.Tensor:
        """o [..., H, d] FP32, r [..., Hd] -> W_o (RMSNorm(o)·w ⊙ σ(r))."""
        o = rms_norm(o, self.o_norm, self.cfg.rms_norm_eps).float() * torch.sigmoid(r.float()).unflatten(-1, (self.H, self.d))
        return o.flatten(-2).to(dtype) @ self.o_proj.T

    def forward(self, x: torch.Tensor, step, cache) -> torch.Tensor:
        kl = cache.kda_index[self.layer]
        state, conv = cache.state[kl], cache.conv[kl]
        qkv, f, b, r = self.project(x)
        W1 = self.cfg.kda_conv_size - 1
        out = torch.empty(x.shape[0], self.H * self.d, dtype=torch.float32, device=x.device)
        dec = [i for i, q in enumerate(step.q_lens) if q == 1]
        offs = torch.tensor([0] + step.q_lens, device="cpu").cumsum(0).tolist()
        if dec:  # decode sequences together: one token each
            tok = torch.tensor([offs[i] for i in dec], device=x.device) if len(dec) < len(step.q_lens) else None
            sel = (lambda t: t) if tok is None else (lambda t: t[tok])  # noqa: E731
            slots = step.kda_slots if tok is None else step.kda_slots[torch.tensor(dec, device=x.device)]
            x_ext = torch.cat([conv[slots], sel(qkv).unsqueeze(1).to(conv.dtype)], 1)
            conv[slots] = x_ext[:, 1:]
            S = state[slots]
            o = self.mix(causal_conv(x_ext, self.conv_w), sel(f).unsqueeze(1), sel(b).unsqueeze(1), S)
            state[slots] = S
            o = o[:, 0].flatten(-2)
            if tok is None:
                out = o
            else:
                out[tok] = o
        for i, q in enumerate(step.q_lens):
            if q == 1:
                continue
            a, e = offs[i], offs[i + 1]
            s = step.kda_slots[i:i + 1]
            x_ext = torch.cat([conv[s], qkv[a:e].unsqueeze(0).to(conv.dtype)], 1)
            conv[s] = x_ext[:, -W1:]
            S = state[s]
            o = self.mix(causal_conv(x_ext, self.conv_w), f[a:e].unsqueeze(0), b[a:e].unsqueeze(0), S)
            state[s] = S
            out[a:e] = o[0].flatten(-2)
        return self.output(out.unflatten(-1, (self.H, self.d)), r, x.dtype)
