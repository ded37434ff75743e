"""Differentiable, batched full-sequence forward over KimiModel's own parameters.

The inference forward writes caches in place and runs KDA token by token; this
path trains the same modules (same hf_params names, so a saved checkpoint loads
into KimiModel) over right-padded [B, T] batches:
  KDA  chunked gated delta rule (exact, see chunk_kda), zero initial state
  MLA  plain causal attention with the latents expanded through kv_b
  MoE  the same sigmoid router; experts computed densely, weighted by the routing.
Sequences start at position 0 with empty caches, like a fresh request, and
padding sits after the real tokens, so causality keeps it from leaking back.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.kda import CHUNK, causal_conv, chunk_kda, kda_gate, l2norm
from ..models.layers import rms_norm, swiglu
from ..models.moe import route

def kda_forward(attn, x: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """KDA layer over x [B, T, D] from zero conv/recurrent state."""
    H, d = attn.H, attn.d
    qkv, f, b, r = attn.project(x)
    W1 = attn.cfg.kda_conv_size - 1
    y = causal_conv(F.pad(qkv, (0, 0, W1, 0)), attn.conv_w)    # zero conv state, like a fresh slot
    q, k, v = y.unflatten(-1, (3, H, d)).unbind(2)
    q, k = l2norm(q) * d ** -0.5, l2norm(k)
    g = kda_gate(f, attn.A_log, attn.dt_bias, H, attn.cfg.kda_gate_lower_bound)
    with torch.autocast(x.device.type, enabled=False):  # the decay products and solve need FP32
        o, _ = chunk_kda(q, k, v, g, torch.sigmoid(b.float()), chunk=chunk)
    return attn.output(o, r, x.dtype)


def mla_forward(attn, x: torch.Tensor) -> torch.Tensor:
    """MLA layer over x [B, T, D]: non-absorbed causal attention (NoPE)."""
    B, T, _ = x.shape
    H, nope, vd, r = attn.H, attn.nope, attn.vd, attn.r
    q, kva = (x @ attn.in_proj.T).split([attn.q_dim, attn.cfg.latent_dim], dim=-1)
    c = rms_norm(kva[..., :r], attn.kv_norm, attn.cfg.mla_norm_eps)
    kv = (c @ attn.kv_b.T).view(B, T, H, nope + vd)
    kr = kva[..., r:].unsqueeze(2).expand(B, T, H, attn.rope)
    k = torch.cat([kv[..., :nope], kr], -1)
    q = q.view(B, T, H, -1)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), kv[..., nope:].transpose(1, 2),
                                       is_causal=True, scale=attn.sm_scale)
    return o.transpose(1, 2).reshape(B, T, H * vd) @ attn.o_proj.T


def moe_forward(moe, x: torch.Tensor, loads: list | None = None) -> torch.Tensor:
    """MoE over x [..., D]; appends each call's per-expert token counts to `loads` (for balancing).

    Every expert runs on every token, weighted 0 where not routed: with a few small experts
    the wasted FLOPs cost less than per-expert gathers, and nothing syncs with the host.
    Zero weights also give zero gradient, so each expert learns only from its own tokens.
    """
    c = moe.cfg
    E, I, D = c.num_experts, c.moe_intermediate_size, c.hidden_size
    xf = x.reshape(-1, D)
    with torch.autocast(x.device.type, enabled=False):  # FP32 router, as at inference
        ids, w = route(xf, moe.gate_w, moe.bias, c.num_experts_per_token, c.moe_renormalize, c.routed_scaling_factor)
    if loads is not None:
        loads.append(torch.bincount(ids.flatten(), minlength=E).detach())
    wmat = torch.zeros(xf.shape[0], E, device=x.device).scatter(1, ids, w)         # [N, E]
    h = swiglu((xf @ moe.w13.reshape(E * 2 * I, D).T).view(-1, E, 2 * I))          # [N, E, I]
    h = (h * wmat.unsqueeze(-1).to(h.dtype)).reshape(-1, E * I)
    y = (h @ moe.w2.permute(0, 2, 1).reshape(E * I, D)).view_as(x)
    return y + moe.shared(x) if moe.shared is not None else y


def hidden_states(model, ids: torch.Tensor, loads: list | None = None, chunk: int = CHUNK,
                  record: list | None = None) -> torch.Tensor:
    """ids [B, T] -> final hidden states [B, T, D] (before the final norm). record: gets the embedding output,
    then each layer's output (a drafter's taps: record[L + 1] is layer L's)."""
    c = model.cfg
    if c.is_k3 or c.q_lora_rank is not None or c.mla_output_gate or c.attn_res_block_size or c.hidden_act != "silu":
        raise NotImplementedError("the training forward covers Kimi-Linear models only (no K3 q-LoRA / gate / AttnRes / SiTU)")
    x = model.embed_tokens[ids]
    if record is not None:
        record.append(x)
    for layer in model.layers:
        a = layer.input_layernorm(x)
        h = x + (kda_forward(layer.attn, a, chunk) if layer.is_kda else mla_forward(layer.attn, a))
        m = layer.post_attention_layernorm(h)
        x = h + (moe_forward(layer.mlp, m, loads) if layer.is_moe else layer.mlp(m))
        if record is not None:
            record.append(x)
    return x


def train_logits(model, ids: torch.Tensor, loads: list | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """ids [B, T] -> logits [B, T, V] FP32 at every position."""
    return model.compute_logits(hidden_states(model, ids, loads, chunk))
