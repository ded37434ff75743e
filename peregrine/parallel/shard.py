"""What each rank holds: the one-rank model's tensor table the loader slices (full_table), and each
rank's summary for the startup log and the tests (holdings, describe). How the model splits over the
ranks is parallel/slicing.py.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..models.kimi import KimiModel
from .slicing import slicing


def full_table(cfg: ModelConfig) -> list:
    """The one-rank model's hf_params table, on the meta device (names, view shapes, no memory)."""
    with torch.device("meta"):
        return KimiModel(cfg, torch.bfloat16).hf_params()


def holdings(model) -> dict:
    """A summary of what this rank holds, for the startup log and the tests."""
    tp, full, cfg = model.tp, model.full_cfg, model.cfg
    span = lambda n, k: f"{tp.rank * k}-{(tp.rank + 1) * k - 1} of {n}"  # noqa: E731
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "rank": tp.rank, "world": tp.world,
        "kda_heads": span(full.kda_num_heads, cfg.kda_num_heads),
        "mla_heads": span(full.mla_num_heads, cfg.mla_num_heads),
        "dense_rows": span(full.intermediate_size, cfg.intermediate_size),
        "experts": f"all {full.num_experts}, rows {span(full.moe_intermediate_size, cfg.moe_intermediate_size)} of each",
        "vocab_rows": span(full.vocab_size, cfg.vocab_size),
        "sliced": {k: v or "sliced" for k, v in slicing(full, tp).items()},
        "params": sum(p.numel() for p in model.parameters()), "bytes": nbytes,
    }


def describe(h: dict) -> str:
    return (f"rank {h['rank']}/{h['world']}: KDA heads {h['kda_heads']}, MLA heads {h['mla_heads']}, "
            f"dense rows {h['dense_rows']}, experts {h['experts']}, vocab rows {h['vocab_rows']}; "
            + "".join(f"{k} {v}; " for k, v in h.get("sliced", {}).items())
            + f"{h['params'] / 1e9:.3f}B params, {h['bytes'] / 2**30:.2f} GiB")
