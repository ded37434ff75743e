"""`peregrine plan`: memory and decode roofline per rank, from the config alone (no weights, no GPU).

Routed experts per step are planned with the uniform-routing estimate
E·(1 − (1 − k/E)^B); real routing touches fewer, so these floors are upper-ish
bounds on bytes. TP splitting follows roofline.py's stated assumption.
"""
from __future__ import annotations

from ..config import KV_CACHE_DTYPES, ConfigError, ModelConfig
from . import roofline as rl

H200_MEMORY_BYTES = 141e9   # H200 HBM3e capacity (datasheet, decimal GB)
MEMORY_UTILIZATION = 0.90   # share the engine may use (EngineConfig.gpu_memory_utilization default)
PLAN_BATCHES = range(1, 17)  # the specialized path's batch sizes
SHORT_CONTEXT = 1           # "empty cache" step: weights + state only (docs/models.md figures)
GB = 1e9


def plan(cfg: ModelConfig, tp: int = 1, kv_cache_dtype: str = "auto", context: int = 8192,
         measured_gbps: float | None = None) -> dict:
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"--tp must be a positive integer, got {tp!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if context < 1:
        raise ConfigError(f"--context must be >= 1, got {context}")
    if measured_gbps is not None and measured_gbps <= 0:
        raise ConfigError(f"--measured-gbps must be > 0, got {measured_gbps}")
    wb = rl.weight_bytes(cfg)
    rank_w = rl.per_rank_weight_bytes(cfg, tp)
    n_mla = len(cfg.mla_layers)
    cache = {
        "mla_latent": context * rl.latent_bytes_per_token(cfg, kv_cache_dtype) * n_mla,  # replicated per rank
        "kda_state": rl.kda_state_bytes_per_seq(cfg) / tp,
        "conv_state": rl.conv_bytes_per_seq(cfg) / tp,
    }
    cache_seq = sum(cache.values())
    free = H200_MEMORY_BYTES * MEMORY_UTILIZATION - rank_w
    steps = []
    for B in PLAN_BATCHES:
        dist = rl.expected_distinct(cfg.num_experts, cfg.num_experts_per_token, B)
        short = rl.step_bytes(cfg, B, dist, SHORT_CONTEXT, kv_cache_dtype, tp)
        full = rl.step_bytes(cfg, B, dist, context, kv_cache_dtype, tp)
        steps.append({
            "batch": B, "distinct_experts_per_layer": dist,
            "bytes_short": short, "bytes": full,
            "floor_ms_spec_short": rl.floor_ms(short, rl.H200_SPEC_GBPS),
            "floor_ms_spec": rl.floor_ms(full, rl.H200_SPEC_GBPS),
            "floor_ms_measured": rl.floor_ms(full, measured_gbps) if measured_gbps else None,
        })
    return {
        "model": cfg.name, "tp": tp, "kv_cache_dtype": kv_cache_dtype, "context": context,
        "spec_gbps": rl.H200_SPEC_GBPS, "measured_gbps": measured_gbps,
        "params": rl.total_params(cfg), "weight_bytes_total": sum(wb.values()),
        "weight_bytes_by_category": wb, "weight_bytes_per_rank": rank_w,
        "expert_bytes": rl.expert_bytes(cfg),
        "cache_bytes_per_seq": cache, "cache_bytes_per_seq_total": cache_seq,
        "fits_h200": free > 0,
        "max_seqs_at_context": max(0, int(free // cache_seq)) if free > 0 else 0,
        "steps": steps,
    }


def format_plan(p: dict) -> str:
    """Markdown tables for the terminal and for issue notes."""
    L = [f"## plan: {p['model']}  tp={p['tp']}  kv-cache={p['kv_cache_dtype']}  context={p['context']}", "",
         f"- parameters: {p['params'] / 1e9:.1f} B; weights total {p['weight_bytes_total'] / GB:.1f} GB; "
         f"per rank {p['weight_bytes_per_rank'] / GB:.2f} GB "
         f"({'fits' if p['fits_h200'] else 'does NOT fit'} in {MEMORY_UTILIZATION:.0%} of a {H200_MEMORY_BYTES / GB:.0f} GB H200)",
         f"- one routed expert: {p['expert_bytes'] / 1e6:.2f} MB",
         "- cache per sequence at context {}: {} = {:.1f} MB per rank; at most {} sequences per rank".format(
             p["context"], ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in p["cache_bytes_per_seq"].items()),
             p["cache_bytes_per_seq_total"] / 1e6, p["max_seqs_at_context"]), "",
         "| weights (all ranks) | GB |", "|---|---:|"]
    L += [f"| {k} | {v / GB:.3f} |" for k, v in p["weight_bytes_by_category"].items() if v]
    meas = p["measured_gbps"]
    head = (f"| B | experts/layer | GB/step ctx {SHORT_CONTEXT} | floor ms @{p['spec_gbps']:.0f} GB/s | "
            f"GB/step ctx {p['context']} | floor ms @{p['spec_gbps']:.0f} GB/s |")
    head += f" floor ms @{meas:.0f} GB/s |" if meas else ""
    L += ["", "Per-rank decode step (uniform-routing expert estimate):", "", head,
          "|" + "---:|" * (7 if meas else 6)]
    for s in p["steps"]:
        row = (f"| {s['batch']} | {s['distinct_experts_per_layer']:.1f} | {s['bytes_short'] / GB:.2f} | "
               f"{s['floor_ms_spec_short']:.2f} | {s['bytes'] / GB:.2f} | {s['floor_ms_spec']:.2f} |")
        row += f" {s['floor_ms_measured']:.2f} |" if meas else ""
        L.append(row)
    return "\n".join(L) + "\n"
