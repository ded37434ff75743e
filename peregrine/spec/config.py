"""--speculative-config, in vLLM's spelling:
  {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
  {"method": "draft_model", "model": PRESET|DIR, "num_speculative_tokens": 4, "dummy_weights": false}
("model" alone implies draft_model, as in vLLM.) Speculation serves greedy requests only:
requests with temperature > 0 ride along in a verify step but are never drafted for.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..config import ConfigError

METHODS = ("ngram", "draft_model")
MAX_SPEC_TOKENS = 15  # k + 1 query tokens per sequence: the KDA decode keeps T positions in one program
NGRAM_MAX_DEFAULT = 4  # longest suffix n-gram matched (vLLM makes this required; 4 is its usual example)


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = NGRAM_MAX_DEFAULT
    prompt_lookup_min: int = 1
    model: str | None = None         # draft model: preset or folder with the target's vocabulary
    dummy_weights: bool = False      # draft model: seeded random weights (presets without a checkpoint)

    @classmethod
    def parse(cls, text_or_dict) -> "SpeculativeConfig | None":
        d = text_or_dict
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if isinstance(d, str):
            if not d.strip():
                return None
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not valid JSON: {e.msg}") from None
        if not isinstance(d, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "dummy_weights"}
        bad = sorted(set(d) - known)
        if bad:
            raise ConfigError(f"--speculative-config: unknown key(s) {', '.join(bad)} (valid: {', '.join(sorted(known))})")
        method = d.get("method") or ("draft_model" if d.get("model") else None)
        if method not in METHODS:
            raise ConfigError(f"--speculative-config: method must be one of {', '.join(METHODS)}, got {method!r}")
        cfg = cls(method=method, num_speculative_tokens=d.get("num_speculative_tokens"),
                  prompt_lookup_max=d.get("prompt_lookup_max", NGRAM_MAX_DEFAULT),
                  prompt_lookup_min=d.get("prompt_lookup_min", 1), model=d.get("model"),
                  dummy_weights=d.get("dummy_weights", False))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def int_in(name, lo, hi):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ConfigError(f"--speculative-config: {name} must be an int in {lo}..{hi}, got {v!r}")
        int_in("num_speculative_tokens", 1, MAX_SPEC_TOKENS)
        if self.method == "ngram":
            int_in("prompt_lookup_min", 1, 64)
            int_in("prompt_lookup_max", self.prompt_lookup_min, 64)
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ConfigError("--speculative-config: draft_model needs \"model\": a preset name or model folder")
            if not isinstance(self.dummy_weights, bool):
                raise ConfigError(f"--speculative-config: dummy_weights must be true or false, got {self.dummy_weights!r}")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens
