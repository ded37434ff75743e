"""The Kimi hybrid family model, driven by ModelConfig: KDA / MLA attention,
dense layer 0 then MoE, pre-norm residuals, final norm, untied lm_head."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ConfigError, ModelConfig
from .kda import KDA
from .layers import DenseMLP, HFParam, RMSNorm, param
from .mla import MLA
from .moe import MoE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, dtype):
        super().__init__()
        self.is_kda, self.is_moe = cfg.is_kda(i), cfg.is_moe(i)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = KDA(cfg, i, dtype) if self.is_kda else MLA(cfg, i, dtype)
        self.mlp = MoE(cfg, dtype) if self.is_moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype)

    def hf_params(self, prefix: str) -> list[HFParam]:
        D = self.input_layernorm.weight.shape[0]
        return ([(prefix + "input_layernorm.weight", self.input_layernorm.weight, (D,)),
                 (prefix + "post_attention_layernorm.weight", self.post_attention_layernorm.weight, (D,))]
                + self.attn.hf_params(prefix + "self_attn.")
                + self.mlp.hf_params(prefix + ("block_sparse_moe." if self.is_moe else "mlp.")))

    def forward(self, x, step, cache):
        h = x + self.attn(self.input_layernorm(x), step, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class KimiModel(nn.Module):
    """Create under `with torch.device(dev):` so parameters are allocated where they will live."""

    def __init__(self, cfg: ModelConfig, dtype=torch.float32):
        super().__init__()
        if cfg.is_k3:
            raise ConfigError(f"{cfg.name}: running kimi_k3 models is not implemented yet "
                              "(its config parses and `peregrine plan` covers it)")
        self.cfg, self.dtype = cfg, dtype
        self.embed_tokens = param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)

    def hf_params(self) -> list[HFParam]:
        V, D = self.embed_tokens.shape
        out = [("model.embed_tokens.weight", self.embed_tokens, (V, D))]
        for i, layer in enumerate(self.layers):
            out += layer.hf_params(f"model.layers.{i}.")
        return out + [("model.norm.weight", self.norm.weight, (D,)), ("lm_head.weight", self.lm_head, (V, D))]

    def hidden_states(self, step, cache, record: list | None = None) -> torch.Tensor:
        x = self.embed_tokens[step.input_ids]
        for layer in self.layers:
            x = layer(x, step, cache)
            if record is not None:
                record.append(x)
        return x

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return (self.norm(h) @ self.lm_head.T).float()

    def forward(self, step, cache, record: list | None = None) -> torch.Tensor:
        """Logits [S, V] FP32 of each sequence's last new token."""
        h = self.hidden_states(step, cache, record)
        return self.compute_logits(h if step.is_decode else h[step.logits_indices])
