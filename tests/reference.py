"""An independent, naive FP64 forward of a Kimi-Linear or K3 model for one sequence,
written straight from docs/models.md against the checkpoint's tensor names
(a dict name -> tensor), token by token with explicit per-head loops.

It shares no code with peregrine.models: it is what the model tests compare to.
K3: names without `language_model.`, routed experts as dense `w{1,2,3}.weight`
(the caller dequantizes MXFP4 itself).
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


def _act(cfg, g, u):
    if cfg.hidden_act == "situ":
        b, bl = cfg.situ_beta, cfg.situ_linear_beta
        return b * torch.tanh(g / b) * _sig(g) * bl * torch.tanh(u / bl)
    return _silu(g) * u


def _mlp(W, cfg, pre, h):
    return W[pre + "down_proj.weight"] @ _act(cfg, W[pre + "gate_proj.weight"] @ h, W[pre + "up_proj.weight"] @ h)


def _attn_res(W, norm, proj, p, blocks, eps):
    V = blocks + [p]
    scores = torch.stack([(v / torch.sqrt((v * v).mean() + eps) * W[norm] * W[proj][0]).sum() for v in V])
    alpha = torch.softmax(scores, 0)
    return sum(a * v for a, v in zip(alpha, V))


def reference_forward(W: dict, cfg, tokens: list[int]) -> torch.Tensor:
    """Logits [T, V] (float64) for every position of one sequence."""
    W = {k: v.double() for k, v in W.items()}
    D, eps = cfg.hidden_size, cfg.rms_norm_eps
    L = cfg.num_hidden_layers
    H, d, Wc = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    Hm, nope, rope, vd, r = cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    bs, latent = cfg.attn_res_block_size, cfg.routed_expert_hidden_size is not None
    # per-layer recurrent memory
    kda_S = {i: [torch.zeros(d, d, dtype=torch.float64) for _ in range(H)] for i in cfg.kda_layers}
    kda_hist = {i: [] for i in cfg.kda_layers}     # raw q|k|v projections of past tokens
    mla_lat = {i: [] for i in cfg.mla_layers}      # (c, k_r) per past token
    logits = []
    for tok in tokens:
        x = W["model.embed_tokens.weight"][tok].clone()
        blocks = []  # AttnRes block list of this token (K3)
        for i in range(L):
            p = f"model.layers.{i}."
            start = bs is not None and i % bs == 0
            xin = _attn_res(W, p + "self_attention_res_norm.weight", p + "self_attention_res_proj.weight", x, blocks, eps) \
                if bs is not None and blocks else x
            if start:
                blocks.append(x)
            h = _rms(xin, W[p + "input_layernorm.weight"], eps)
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
                if cfg.kda_full_rank_gate:
                    gate_in = W[a + "g_proj.weight"] @ h
                else:
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
                    if cfg.kda_gate_lower_bound is None:
                        g = -A[hh] * torch.log1p(torch.exp(f[sl]))
                    else:
                        g = cfg.kda_gate_lower_bound * _sig(A[hh] * f[sl])
                    S = kda_S[i][hh]
                    S = torch.diag(torch.exp(g)) @ S
                    u = beta[hh] * (v - S.T @ k)
                    S = S + torch.outer(k, u)
                    kda_S[i][hh] = S
                    o = S.T @ q
                    outs.append(_rms(o, W[a + "o_norm.weight"], eps) * _sig(gate_in[sl]))
                attn = W[a + "o_proj.weight"] @ torch.cat(outs)
            else:
                if cfg.q_lora_rank:
                    qa = _rms(W[a + "q_a_proj.weight"] @ h, W[a + "q_a_layernorm.weight"], cfg.mla_norm_eps)
                    q = (W[a + "q_b_proj.weight"] @ qa).view(Hm, nope + rope)
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
                o = torch.cat(outs)
                if cfg.mla_output_gate:
                    o = o * _sig(W[a + "g_proj.weight"] @ h)
                attn = W[a + "o_proj.weight"] @ o
            x = attn if start else x + attn
            if bs is not None:
                h = _rms(_attn_res(W, p + "mlp_res_norm.weight", p + "mlp_res_proj.weight", x, blocks, eps),
                         W[p + "post_attention_layernorm.weight"], eps)
            else:
                h = _rms(x, W[p + "post_attention_layernorm.weight"], eps)
            if cfg.is_moe(i):
                m = p + "block_sparse_moe."
                s = _sig(W[m + "gate.weight"] @ h)
                sel = torch.topk(s + W[m + "gate.e_score_correction_bias"], cfg.num_experts_per_token).indices
                wts = s[sel] / s[sel].sum() * cfg.routed_scaling_factor
                z = W[m + "routed_expert_down_proj.weight"] @ h if latent else h
                out = torch.zeros(z.shape[0], dtype=torch.float64)
                for e, we in zip(sel.tolist(), wts):
                    ep = f"{m}experts.{e}."
                    out += we * (W[ep + "w2.weight"] @ _act(cfg, W[ep + "w1.weight"] @ z, W[ep + "w3.weight"] @ z))
                if latent:
                    out = W[m + "routed_expert_up_proj.weight"] @ _rms(out, W[m + "routed_expert_norm.weight"], eps)
                out += _mlp(W, cfg, m + "shared_experts.", h)
            else:
                out = _mlp(W, cfg, p + "mlp.", h)
            x = x + out
        if bs is not None:
            x = _attn_res(W, "model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight", x, blocks, eps)
        logits.append(W["lm_head.weight"] @ _rms(x, W["model.norm.weight"], eps))
    return torch.stack(logits)
