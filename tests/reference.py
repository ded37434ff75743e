"""An independent, naive FP64 forward of a Kimi-Linear model for one sequence,
written straight from MODELS.md against the checkpoint's tensor names
(a dict name -> tensor), token by token with explicit per-head loops.

It shares no code with peregrine.models: it is what the model tests compare to.
"""
from __future__ import annotations

import math

import torch


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean() + eps) * w


def _silu(x):
    return x / (1 + torch.exp(-x))


def _sig(x):
    return 1 / (1 + torch.exp(-x))


def reference_forward(W: dict, cfg, tokens: list[int]) -> torch.Tensor:
    """Logits [T, V] (float64) for every position of one sequence."""
    W = {k: v.double() for k, v in W.items()}
    D, eps = cfg.hidden_size, cfg.rms_norm_eps
    L = cfg.num_hidden_layers
    H, d, Wc = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    Hm, nope, rope, vd, r = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    # per-layer recurrent memory
    kda_S = {i: [torch.zeros(d, d, dtype=torch.float64) for _ in range(H)] for i in cfg.kda_layers}
    kda_hist = {i: [] for i in cfg.kda_layers}     # raw q|k|v projections of past tokens
    mla_lat = {i: [] for i in cfg.mla_layers}      # (c, k_r) per past token
    logits = []
    for tok in tokens:
        x = W["model.embed_tokens.weight"][tok].clone()
        for i in range(L):
            p = f"model.layers.{i}."
            h = _rms(x, W[p + "input_layernorm.weight"], eps)
            a = p + "self_attn."
            if i in cfg.kda_layers:
                raw = torch.cat([W[a + n + "_proj.weight"] @ h for n in "qkv"])
                kda_hist[i].append(raw)
                conv_w = torch.cat([W[a + n + "_conv1d.weight"][:, 0, :] for n in "qkv"])  # [3Hd, W]
                y = torch.zeros(3 * H * d, dtype=torch.float64)
                for j in range(Wc):
                    t = len(kda_hist[i]) - Wc + j
                    if t >= 0:
                        y += conv_w[:, j] * kda_hist[i][t]
                y = _silu(y)
                f = W[a + "f_b_proj.weight"] @ (W[a + "f_a_proj.weight"] @ h) + W[a + "dt_bias"]
                beta = _sig(W[a + "b_proj.weight"] @ h)
                gate_in = W[a + "g_b_proj.weight"] @ (W[a + "g_a_proj.weight"] @ h)
                A = torch.exp(W[a + "A_log"].flatten())
                outs = []
                for hh in range(H):
                    sl = slice(hh * d, (hh + 1) * d)
                    q = y[0 * H * d:][sl]
                    k = y[1 * H * d:][sl]
                    v = y[2 * H * d:][sl]
                    q = q / torch.sqrt((q * q).sum() + 1e-6) / math.sqrt(d)
                    k = k / torch.sqrt((k * k).sum() + 1e-6)
                    g = -A[hh] * torch.log1p(torch.exp(f[sl]))
                    S = kda_S[i][hh]
                    S = torch.diag(torch.exp(g)) @ S
                    u = beta[hh] * (v - S.T @ k)
                    S = S + torch.outer(k, u)
                    kda_S[i][hh] = S
                    o = S.T @ q
                    outs.append(_rms(o, W[a + "o_norm.weight"], eps) * _sig(gate_in[sl]))
                attn = W[a + "o_proj.weight"] @ torch.cat(outs)
            else:
                q = (W[a + "q_proj.weight"] @ h).view(Hm, nope + rope)
                kva = W[a + "kv_a_proj_with_mqa.weight"] @ h
                c = _rms(kva[:r], W[a + "kv_a_layernorm.weight"], cfg.mla_norm_eps)
                mla_lat[i].append((c, kva[r:]))
                kvb = W[a + "kv_b_proj.weight"].view(Hm, nope + vd, r)
                outs = []
                for hh in range(Hm):
                    keys = torch.stack([torch.cat([kvb[hh, :nope] @ cc, kr]) for cc, kr in mla_lat[i]])
                    vals = torch.stack([kvb[hh, nope:] @ cc for cc, _ in mla_lat[i]])
                    s = keys @ q[hh] / math.sqrt(nope + rope)
                    outs.append(torch.softmax(s, 0) @ vals)
                attn = W[a + "o_proj.weight"] @ torch.cat(outs)
            x = x + attn
            h = _rms(x, W[p + "post_attention_layernorm.weight"], eps)
            if cfg.is_moe(i):
                m = p + "block_sparse_moe."
                s = _sig(W[m + "gate.weight"] @ h)
                sel = torch.topk(s + W[m + "gate.e_score_correction_bias"], cfg.num_experts_per_token).indices
                wts = s[sel] / s[sel].sum() * cfg.routed_scaling_factor
                out = torch.zeros(D, dtype=torch.float64)
                for e, we in zip(sel.tolist(), wts):
                    ep = f"{m}experts.{e}."
                    out += we * (W[ep + "w2.weight"] @ (_silu(W[ep + "w1.weight"] @ h) * (W[ep + "w3.weight"] @ h)))
                sp = m + "shared_experts."
                out += W[sp + "down_proj.weight"] @ (_silu(W[sp + "gate_proj.weight"] @ h) * (W[sp + "up_proj.weight"] @ h))
            else:
                mp = p + "mlp."
                out = W[mp + "down_proj.weight"] @ (_silu(W[mp + "gate_proj.weight"] @ h) * (W[mp + "up_proj.weight"] @ h))
            x = x + out
        logits.append(W["lm_head.weight"] @ _rms(x, W["model.norm.weight"], eps))
    return torch.stack(logits)
