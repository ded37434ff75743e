"""Roofline model: the bytes a decode step must move, from ModelConfig alone.

Decode at small batch is bandwidth-bound, so step time >= bytes / bandwidth.
Bytes = non-routed weights + distinct routed experts x expert bytes + MLA
latent cache reads/writes + KDA state and conv state read+write + logits.
Weights are counted as stored on the GPU: BF16 everywhere except MXFP4
routed experts (K3). Small vectors (norms, biases) are counted as BF16 too.

Tensor parallel (tp > 1), the assumption until the sharded runtime exists:
every weight splits evenly over the ranks except norms, the router and the
AttnRes vectors (replicated); routed experts split evenly, so a rank reads
distinct/tp of them on average; KDA state and conv split by heads; the MLA
latent cache is replicated (all heads of a rank read the whole latent).
"""
from __future__ import annotations

from ..config import ModelConfig

BF16 = 2                 # bytes per weight / activation in the model dtype
FP32 = 4                 # KDA state, logits, FP8 per-token scale
MXFP4_GROUP = 32         # values sharing one E8M0 scale byte
MXFP4_BYTES = 0.5        # two E2M1 values per byte
H200_SPEC_GBPS = 4800.0  # H200 HBM3e datasheet bandwidth
H200_COPY_GBPS = 4260.0  # measured device-to-device copy on the lent H200s (docs/development.md)
REPLICATED = ("router", "norms", "attn_res")  # categories every TP rank keeps whole


def _kda_layer_params(cfg: ModelConfig) -> int:
    D, H, d = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    hd, rank = H * d, d  # low-rank f/g width = head_dim (as in the checkpoints)
    p = 3 * hd * D                    # q, k, v
    p += rank * D + hd * rank         # f_a, f_b
    p += H * D                        # b
    p += hd * D if cfg.kda_full_rank_gate else rank * D + hd * rank  # g or g_a, g_b
    p += D * hd                       # o_proj
    p += 3 * hd * cfg.kda_conv_size   # depthwise conv on q|k|v
    p += H + hd                       # A_log, dt_bias
    return p


def _kda_layer_norm_params(cfg: ModelConfig) -> int:
    return cfg.kda_head_dim           # o_norm


def _mla_layer_params(cfg: ModelConfig) -> int:
    D, H = cfg.hidden_size, cfg.mla_num_heads
    if cfg.q_lora_rank:
        p = cfg.q_lora_rank * D + H * cfg.qk_head_dim * cfg.q_lora_rank  # q_a, q_b
    else:
        p = H * cfg.qk_head_dim * D                                      # q_proj
    p += cfg.latent_dim * D                                              # kv_a_proj_with_mqa
    p += H * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank  # kv_b
    p += D * H * cfg.v_head_dim                                          # o_proj
    if cfg.mla_output_gate:
        p += H * cfg.v_head_dim * D                                      # g_proj
    return p


def _mla_layer_norm_params(cfg: ModelConfig) -> int:
    return cfg.kv_lora_rank + (cfg.q_lora_rank or 0)  # kv_a_layernorm (+ q_a_layernorm)


def expert_hidden(cfg: ModelConfig) -> int:
    """Width routed experts read and write (K3: the latent MoE space)."""
    return cfg.routed_expert_hidden_size or cfg.hidden_size


def expert_bytes(cfg: ModelConfig) -> float:
    """One routed expert (w1, w3, w2)."""
    n = 3 * cfg.moe_intermediate_size * expert_hidden(cfg)
    if cfg.expert_quant == "mxfp4":
        return n * (MXFP4_BYTES + 1 / MXFP4_GROUP)
    return n * BF16


def weight_bytes(cfg: ModelConfig) -> dict[str, float]:
    """Stored bytes by category, summed over layers (routed experts: all of them)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    n_moe = len(cfg.moe_layers)
    n_dense = cfg.num_hidden_layers - n_moe
    n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    swiglu = 3 * D  # gate, up, down per unit of intermediate width
    latent = 0
    if cfg.routed_expert_hidden_size:
        R = cfg.routed_expert_hidden_size
        latent = n_moe * 2 * R * D  # routed_expert_down_proj, routed_expert_up_proj
    norms = cfg.num_hidden_layers * 2 * D + D  # input/post-attention norms + final norm
    norms += n_kda * _kda_layer_norm_params(cfg) + n_mla * _mla_layer_norm_params(cfg)
    if cfg.routed_expert_hidden_size:
        norms += n_moe * cfg.routed_expert_hidden_size  # routed_expert_norm
    attn_res = 0
    if cfg.attn_res_block_size:
        attn_res = cfg.num_hidden_layers * 4 * D + 2 * D  # 2 norms + 2 projs a layer, output pair
    p = {
        "embedding": V * D,
        "lm_head": 0 if cfg.tie_word_embeddings else V * D,
        "attention_kda": n_kda * _kda_layer_params(cfg),
        "attention_mla": n_mla * _mla_layer_params(cfg),
        "dense_ffn": n_dense * swiglu * cfg.intermediate_size,
        "shared_experts": n_moe * swiglu * cfg.num_shared_experts * cfg.moe_intermediate_size,
        "latent_moe": latent,
        "router": n_moe * (cfg.num_experts * D + cfg.num_experts),  # gate + e_score_correction_bias
        "norms": norms,
        "attn_res": attn_res,
    }
    out = {k: float(v * BF16) for k, v in p.items()}
    out["routed_experts"] = n_moe * cfg.num_experts * expert_bytes(cfg)
    return out


def total_weight_bytes(cfg: ModelConfig) -> float:
    return sum(weight_bytes(cfg).values())


def total_params(cfg: ModelConfig) -> float:
    """Parameter count (an MXFP4 expert still holds 3 * I * H weights)."""
    wb = weight_bytes(cfg)
    routed = len(cfg.moe_layers) * cfg.num_experts * 3 * cfg.moe_intermediate_size * expert_hidden(cfg)
    return sum(v for k, v in wb.items() if k != "routed_experts") / BF16 + routed


def per_rank_weight_bytes(cfg: ModelConfig, tp: int = 1) -> float:
    wb = weight_bytes(cfg)
    return sum(v if k in REPLICATED else v / tp for k, v in wb.items())


def non_routed_step_bytes(cfg: ModelConfig, batch: int, tp: int = 1) -> float:
    """Weights every decode step reads except routed experts; only B embedding rows."""
    wb = weight_bytes(cfg)
    wb["embedding"] = batch * cfg.hidden_size * BF16
    del wb["routed_experts"]
    return sum(v if k in REPLICATED else v / tp for k, v in wb.items())


def latent_bytes_per_token(cfg: ModelConfig, kv_cache_dtype: str = "auto") -> float:
    """One MLA cache entry in one layer ("auto" = the BF16 model dtype on GPU)."""
    if kv_cache_dtype == "fp8":
        return cfg.latent_dim * 1 + FP32  # e4m3 values + one FP32 scale
    return cfg.latent_dim * BF16


def kda_state_bytes_per_seq(cfg: ModelConfig) -> float:
    return len(cfg.kda_layers) * cfg.kda_num_heads * cfg.kda_head_dim ** 2 * FP32


def conv_bytes_per_seq(cfg: ModelConfig) -> float:
    return len(cfg.kda_layers) * (cfg.kda_conv_size - 1) * 3 * cfg.kda_dim * BF16


def expected_distinct(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts touched by B tokens under uniform routing (planning only)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def step_breakdown(cfg: ModelConfig, batch: int, distinct_experts_per_layer: list[float] | float,
                   context_len: float, kv_cache_dtype: str = "auto", tp: int = 1) -> dict[str, float]:
    """Bytes one decode step of B sequences must move, per rank, by component.

    distinct_experts_per_layer: one count per MoE layer (as routed in the run), or
    one number used for every MoE layer. context_len: tokens each sequence holds
    in its MLA cache after this step (the new token included).
    """
    n_moe = len(cfg.moe_layers)
    if isinstance(distinct_experts_per_layer, (int, float)):
        routed = n_moe * float(distinct_experts_per_layer)
    else:
        if len(distinct_experts_per_layer) != n_moe:
            raise ValueError(f"need {n_moe} per-MoE-layer expert counts, got {len(distinct_experts_per_layer)}")
        routed = float(sum(distinct_experts_per_layer))
    n_mla = len(cfg.mla_layers)
    tok = latent_bytes_per_token(cfg, kv_cache_dtype)
    return {
        "non_routed_weights": non_routed_step_bytes(cfg, batch, tp),
        "routed_experts": routed * expert_bytes(cfg) / tp,
        "latent_read": batch * context_len * tok * n_mla,
        "latent_write": batch * tok * n_mla,
        "kda_state": batch * kda_state_bytes_per_seq(cfg) * 2 / tp,  # read + write
        "conv_state": batch * conv_bytes_per_seq(cfg) * 2 / tp,      # read + write
        "logits": batch * cfg.vocab_size * FP32 / tp,
    }


def step_bytes(cfg: ModelConfig, batch: int, distinct_experts_per_layer: list[float] | float,
               context_len: float, kv_cache_dtype: str = "auto", tp: int = 1) -> float:
    return sum(step_breakdown(cfg, batch, distinct_experts_per_layer, context_len, kv_cache_dtype, tp).values())


def floor_ms(nbytes: float, gbps: float) -> float:
    """Lower bound on step time at a bandwidth in GB/s (1e9 bytes)."""
    return nbytes / (gbps * 1e9) * 1e3
