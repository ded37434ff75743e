"""generation_config.json of a model folder: the ids that end a generation and the default
sampling settings the model was published with.

Instruct checkpoints often list several end ids (e.g. `<|im_end|>` and `[EOS]`) here while
config.json names one; generation stops at any of them. temperature / top_p / top_k become the
server's defaults for requests that set none (as vLLM does with `--generation-config auto`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

GENERATION_CONFIG = "generation_config.json"


def token_ids(v, where: str, key: str) -> tuple[int, ...]:
    """An id field that is an int, a list of ints, or null."""
    if v is None:
        return ()
    vals = v if isinstance(v, list) else [v]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in vals):
        raise ConfigError(f"{where}: field '{key}' must be a token id or a list of token ids, got {v!r}")
    return tuple(vals)


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    @classmethod
    def from_folder(cls, folder: Path | None) -> "GenerationConfig":
        if folder is None or not (Path(folder) / GENERATION_CONFIG).exists():
            return cls()
        p = Path(folder) / GENERATION_CONFIG
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {p}: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{p}: expected a JSON object")

        def num(key, ok):
            v = d.get(key)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
                raise ConfigError(f"{p}: field '{key}' has an invalid value {v!r}")
            return v
        tk = num("top_k", lambda v: isinstance(v, int) and v >= 0)
        t = num("temperature", lambda v: v >= 0)
        tp = num("top_p", lambda v: 0 < v <= 1)
        return cls(eos_token_ids=token_ids(d.get("eos_token_id"), str(p), "eos_token_id"),
                   temperature=None if t is None else float(t), top_p=None if tp is None else float(tp), top_k=tk)
