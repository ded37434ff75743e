"""The Kimi hybrid family model, driven by ModelConfig: KDA / MLA attention,
dense layer 0 then MoE, pre-norm residuals, final norm, untied lm_head.
K3 adds AttnRes block residual mixing (docs/models.md "K3 AttnRes") and names its
tensors under ``language_model.``."""
from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..config import ModelConfig
from .kda import KDA
from .layers import DenseMLP, HFParam, RMSNorm, add_rms_norm, linear, param
from .mla import MLA
from .moe import MoE, activation
from ..parallel.group import SINGLE
from ..parallel.slicing import shard_config

K3_PREFIX = "language_model."  # K3 (a multimodal checkpoint) keeps its text model under this


class AttnRes(nn.Module):
    """Softmax mix over the block list and the current stream: one score per entry from
    its RMS-normalised values against w_n ⊙ w_p (FP32)."""

    def __init__(self, dim: int, eps: float, dtype):
        super().__init__()
        self.norm, self.proj, self.eps = param(dim, dtype=dtype), param(1, dim, dtype=dtype), eps

    def hf_params(self, norm_name: str, proj_name: str) -> list[HFParam]:
        D = self.norm.shape[0]
        return [(norm_name + ".weight", self.norm, (D,)), (proj_name + ".weight", self.proj, (1, D))]

    def forward(self, p: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
        V = torch.stack([*blocks, p]).float()  # [n+1, N, D]
        k = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.norm.float() * self.proj.float()[0]
        if kernels.batch_invariant():  # a token's weights computed along its own row: a matrix-vector product's kernel
            # and a softmax over dim 0 (vectorised across tokens, its tail scalar) change with the number of tokens
            alpha = torch.softmax((k * w).sum(-1).T.contiguous(), -1).T  # [n+1, N]
        else:
            alpha = torch.softmax(k @ w, 0)  # [n+1, N]
        return (alpha.unsqueeze(-1) * V).sum(0).to(p.dtype)


class DecoderLayer(nn.Module):
    """With tensor parallelism the attention and MLP outputs are partial sums (row-parallel
    output projections): tp.all_reduce completes them before the residual add."""

    def __init__(self, cfg: ModelConfig, i: int, dtype, tp=SINGLE):
        super().__init__()
        self.tp = tp
        self.is_kda, self.is_moe = cfg.is_kda(i), cfg.is_moe(i)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = KDA(cfg, i, dtype) if self.is_kda else MLA(cfg, i, dtype, tp)
        self.mlp = MoE(cfg, dtype, tp) if self.is_moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, act=activation(cfg))
        self.res = cfg.attn_res_block_size is not None
        if self.res:
            self.attn_res = AttnRes(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.mlp_res = AttnRes(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.block_start = i % cfg.attn_res_block_size == 0

    def hf_params(self, prefix: str) -> list[HFParam]:
        D = self.input_layernorm.weight.shape[0]
        out = [(prefix + "input_layernorm.weight", self.input_layernorm.weight, (D,)),
               (prefix + "post_attention_layernorm.weight", self.post_attention_layernorm.weight, (D,))]
        if self.res:
            out += self.attn_res.hf_params(prefix + "self_attention_res_norm", prefix + "self_attention_res_proj")
            out += self.mlp_res.hf_params(prefix + "mlp_res_norm", prefix + "mlp_res_proj")
        return (out + self.attn.hf_params(prefix + "self_attn.")
                + self.mlp.hf_params(prefix + ("block_sparse_moe." if self.is_moe else "mlp.")))

    def forward(self, x, step, cache):
        pre = self.attn.pre(self.input_layernorm(x))
        return self.finish(x, self.attn.core(pre, step, cache), pre)

    def finish(self, x, o, pre):
        """The token-parallel rest of the layer after its attention core: W_o, residual, MLP, residual. On one
        rank the first residual add runs in the norm's pass and the second in the MoE's combine (the same
        roundings: bitwise the same result, two fewer passes over the [N, D] stream)."""
        a = self.tp.all_reduce(self.attn.post(o, pre))
        if self.tp.world > 1:  # TP: the all-reduce's output may be its own buffer
            h = x + a
            return h + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(h)))
        y, h = add_rms_norm(x, a, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        return self.mlp(y, residual=h) if self.is_moe else h + self.mlp(y)

    def forward_res(self, p, blocks: list, step, cache):
        """AttnRes layer: p is the block's residual stream, `blocks` (appended to here) the block list."""
        x = self.attn_res(p, blocks) if blocks else p
        if self.block_start:
            blocks.append(p)
        a = self.tp.all_reduce(self.attn(self.input_layernorm(x), step, cache))
        p = a if self.block_start else p + a
        return p + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(self.mlp_res(p, blocks))))


class KimiModel(nn.Module):
    """Create under `with torch.device(dev):` so parameters are allocated where they will live.

    tp: this rank's place in a tensor-parallel group; the model then holds the rank's shard
    (parallel/slicing.py): `cfg` is the shard's config, `full_cfg` the model's."""

    def __init__(self, cfg: ModelConfig, dtype=torch.float32, tp=SINGLE):
        super().__init__()
        self.tp, self.full_cfg = tp, cfg
        cfg = shard_config(cfg, tp)
        self.cfg, self.dtype = cfg, dtype
        self.embed_tokens = param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.output_res = AttnRes(cfg.hidden_size, cfg.rms_norm_eps, dtype) if cfg.attn_res_block_size else None
        self._blocks: list[torch.Tensor] = []  # AttnRes block list of the last hidden_states call
        self.taps = None  # a DFlash drafter's TapWriter (speculative/dflash.py): fed the tapped layers' outputs

    def hf_params(self) -> list[HFParam]:
        V, D = self.embed_tokens.shape
        top = K3_PREFIX if self.cfg.is_k3 else ""
        out = [(top + "model.embed_tokens.weight", self.embed_tokens, (V, D))]
        for i, layer in enumerate(self.layers):
            out += layer.hf_params(f"{top}model.layers.{i}.")
        if self.output_res is not None:
            out += self.output_res.hf_params(top + "model.output_attn_res_norm", top + "model.output_attn_res_proj")
        return out + [(top + "model.norm.weight", self.norm.weight, (D,)), (top + "lm_head.weight", self.lm_head, (V, D))]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; vocab-parallel: each rank looks up the ids in its row range, zeros elsewhere, summed."""
        if self.tp.world == 1:
            return self.embed_tokens[ids]
        V = self.embed_tokens.shape[0]
        loc = ids - self.tp.rank * V
        mine = (loc >= 0) & (loc < V)
        x = torch.where(mine.unsqueeze(-1), self.embed_tokens[loc.clamp(0, V - 1)], 0.0)
        return self.tp.all_reduce(x)

    def hidden_states(self, step, cache, record: list | None = None) -> torch.Tensor:
        """Final residual stream [N, D]; with AttnRes the block list is kept for compute_logits."""
        x = self.embed(step.input_ids)
        if self.taps is not None:
            self.taps.take(-1, x, step)
        blocks: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x = layer.forward_res(x, blocks, step, cache) if layer.res else layer(x, step, cache)
            if record is not None:
                record.append(x)
            if self.taps is not None:
                self.taps.take(i, x, step)
        self._blocks = blocks
        return x

    def compute_logits(self, h: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """h: rows of the last hidden_states call (idx selects rows of it, AttnRes mixes them with their blocks)."""
        if self.output_res is not None:
            blocks = self._blocks if idx is None else [b[idx] for b in self._blocks]
            h = self.output_res(h, blocks)
        return self.tp.all_gather(linear(self.norm(h), self.lm_head).float(), -1)  # vocab-parallel lm_head

    def forward(self, step, cache, record: list | None = None) -> torch.Tensor:
        """Logits [S, V] FP32 of each sequence's last new token."""
        return self._logits(self.hidden_states(step, cache, record), step)

    def _logits(self, h: torch.Tensor, step) -> torch.Tensor:
        if step.is_decode:
            return self.compute_logits(h)
        idx = step.logits_indices
        return self.compute_logits(h[idx], idx)

    def segment(self, j: int, x, o=None, pre=None):
        """Token-parallel segment j of a forward (no AttnRes): j = 0 embeds the ids `x`; j > 0 finishes layer
        j-1 from its core's output o and its pre; then layer j's pre. -> (x, pre of layer j or None).
        A forward is segment 0, then core i and segment i+1 per layer (the prefill graphs' unit)."""
        if j == 0:
            x = self.embed(x)
        else:
            x = self.layers[j - 1].finish(x, o, pre)
        if j == len(self.layers):
            return x, None
        layer = self.layers[j]
        return x, layer.attn.pre(layer.input_layernorm(x))

    def forward_pieces(self, step, cache, layers_per_piece: int):
        """forward() as a generator over groups of layers: yields None after each group but the last,
        then the logits. Between two pieces other steps may run, on other sequences' cache entries."""
        x = self.embed(step.input_ids)
        if self.taps is not None:
            self.taps.take(-1, x, step)
        blocks: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x = layer.forward_res(x, blocks, step, cache) if layer.res else layer(x, step, cache)
            if self.taps is not None:
                self.taps.take(i, x, step)
            if (i + 1) % layers_per_piece == 0 and i + 1 < len(self.layers):
                yield None
        self._blocks = blocks  # (set here: a step run between two pieces has its own)
        yield self._logits(x, step)
