"""How a model splits over the ranks of a tensor-parallel group.

A rank's model is the same architecture with every split dimension divided by
the world size (shard_config): KDA and MLA heads, dense/shared/expert
intermediate width (tensor parallel inside the experts), vocab. Low-rank and
latent projections (KDA f_a/g_a, MLA kv_a and q_a), norms and the router are
replicated. The KDA conv, A_log and dt_bias follow their heads.

With slice_replicated (engine key tp_slice_replicated) the router (gate rows: experts)
and the MLA kv_a (and K3's q_a) rows are split too, where the world divides them: each
rank computes its slice of the logits / latent and one all-gather completes them
(slicing). The bias and the norms stay whole: they act on the gathered vectors. KDA's
f_a/g_a stay replicated (rank-128 outputs: the gather would cost more than their read).

Every checkpoint tensor of a rank is then a contiguous slice of the full tensor
along the one dimension whose size differs (slice_of): the loader reads only
that slice and dummy init generates the full tensor (same seed, same order as
one rank) and keeps the slice, so TP = N holds exactly TP = 1's numbers.

The models build their shards from this module; parallel/shard.py reports what each rank holds.
"""
from __future__ import annotations

import dataclasses

import torch

from ..config import ModelConfig
from ..errors import ConfigError
from .group import TPGroup

MXFP4_GROUP = 32  # an MXFP4 scale covers 32 values: a split must not cut one


def shard_config(cfg: ModelConfig, tp: TPGroup) -> ModelConfig:
    """The config of one rank's shard; errors name the field that does not divide."""
    if tp.world == 1:
        return cfg
    kda_h = tp.split(cfg.kda_num_heads, "linear_attn_config.num_heads")
    mla_h = tp.split(cfg.mla_num_heads, "num_attention_heads")
    inter = tp.split(cfg.intermediate_size, "intermediate_size")
    moe_i = tp.split(cfg.moe_intermediate_size, "moe_intermediate_size")
    vocab = tp.split(cfg.vocab_size, "vocab_size")
    if cfg.expert_quant == "mxfp4" and moe_i % MXFP4_GROUP:
        raise ConfigError(f"tensor parallel size {tp.world} leaves 'moe_intermediate_size' {cfg.moe_intermediate_size} "
                          f"as {moe_i} per rank, not a multiple of the MXFP4 group {MXFP4_GROUP}")
    if cfg.routed_expert_hidden_size is not None:
        tp.split(cfg.routed_expert_hidden_size, "routed_expert_hidden_size")  # the latent up_proj is split by columns
    return dataclasses.replace(cfg, kda_num_heads=kda_h, mla_num_heads=mla_h, intermediate_size=inter,
                               moe_intermediate_size=moe_i, vocab_size=vocab)


SLICEABLE = {  # replicated projection -> (its output width, the config field named when it does not divide)
    "router": (lambda c: c.num_experts, "num_experts"),
    "kv_a": (lambda c: c.latent_dim, "kv_lora_rank + qk_rope_head_dim"),
    "q_a": (lambda c: c.q_lora_rank, "q_lora_rank"),
}


def slicing(cfg: ModelConfig, tp: TPGroup) -> dict[str, str | None]:
    """With tp.slice_replicated: each projection the model has -> None (sliced) or why it stays replicated."""
    if not tp.slice_replicated:
        return {}
    out = {}
    for what, (width, field) in SLICEABLE.items():
        n = width(cfg)
        if n:
            out[what] = None if n % tp.world == 0 else f"'{field}' ({n}) is not divisible by {tp.world}: replicated"
    return out


def slice_of(name: str, full: tuple[int, ...], local: tuple[int, ...], tp: TPGroup) -> tuple[int, int] | None:
    """(dim, start) of the rank's slice of a tensor of shape `full` held as `local`; None: replicated."""
    if tuple(full) == tuple(local):
        return None
    diff = [d for d, (a, b) in enumerate(zip(full, local)) if a != b]
    if len(full) != len(local) or len(diff) != 1 or full[diff[0]] != tp.world * local[diff[0]]:
        raise ValueError(f"{name}: rank shape {tuple(local)} is not a 1/{tp.world} slice of {tuple(full)}")
    d = diff[0]
    return d, tp.rank * local[d]


def take(t: torch.Tensor, sl: tuple[int, int] | None, local_shape) -> torch.Tensor:
    """The rank's slice of the full tensor t (a view)."""
    if sl is None:
        return t
    d, start = sl
    return t.narrow(d, start, local_shape[d])
