"""--speculative-config, in vLLM's spelling:
  {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
  {"method": "draft_model", "model": PRESET|DIR, "num_speculative_tokens": 4, "dummy_weights": false}
  {"method": "dflash" | "dspark", "model": DIR, "num_speculative_tokens": 15}   (dflash.py: a DFlash or DSpark
   drafter folder, z-lab's or DeepSpec's layout; k defaults to the drafts of its block)
  {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 24,
   "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0,
   "suffix_decoding_min_token_prob": 0.1}     (suffix.py; vLLM's keys and defaults)
("model" alone implies draft_model, as in vLLM.) Greedy and sampled requests are drafted for (sampled ones
by speculative sampling, decoder.py); requests with logprobs or penalties ride along undrafted.

Synthetic acceptance, for benchmarking only (vLLM's keys and meaning):
  {"method": "ngram", "num_speculative_tokens": 7, "rejection_sample_method": "synthetic",
   "synthetic_acceptance_length": 3.78}          (or "synthetic_acceptance_rates": [1, 1, 0.78, 0, 0, 0, 0])
Every row then verifies k drafts a step (ids that route like text: decoder.py) and accepts a count drawn from
the rates: the speed of a drafter with that acceptance, with output that is not the model's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..config import ConfigError

METHODS = ("ngram", "draft_model", "suffix", "dflash", "dspark")
DRAFTER_FOLDERS = ("dflash", "dspark")  # methods whose "model" is a drafter folder (speculative/dflash.py)
REJECTION = ("standard", "synthetic")
SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
MAX_SPEC_TOKENS = 15  # k + 1 query tokens per sequence: the KDA decode keeps T positions in one program
NGRAM_MAX_DEFAULT = 4  # longest suffix n-gram matched (vLLM makes this required; 4 is its usual example)


def _drafts_in(folder: str) -> int:
    """Drafts a block of the DFlash / DSpark drafter in folder gives (its config.json), or a ConfigError."""
    from .dflash import DFlashConfig, drafter_dir
    p = drafter_dir(folder) / "config.json"
    if not p.is_file():
        raise ConfigError(f"--speculative-config: drafter folder {folder!r} has no config.json")
    try:
        return DFlashConfig.from_dict(json.loads(p.read_text()), f"drafter {folder}").num_drafts
    except json.JSONDecodeError as e:
        raise ConfigError(f"--speculative-config: {p} is not valid JSON ({e.msg})") from None


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = NGRAM_MAX_DEFAULT
    prompt_lookup_min: int = 1
    model: str | None = None         # draft model: preset or folder with the target's vocabulary
    dummy_weights: bool = False      # draft model: seeded random weights (presets without a checkpoint)
    rejection_sample_method: str = "standard"  # "synthetic": accepted counts drawn from synthetic_acceptance_rates
    synthetic_acceptance_length: float | None = None  # mean tokens a verify yields, the bonus token counted
    synthetic_acceptance_rates: list | None = None    # P(draft position j accepted), unconditional, non-increasing
    suffix_decoding_max_tree_depth: int = 24          # suffix: longest context counted (vLLM's default)
    suffix_decoding_max_cached_requests: int = 10000  # suffix: finished requests' outputs in the global trie
    suffix_decoding_max_spec_factor: float = 1.0      # suffix: drafts per matched token
    suffix_decoding_min_token_prob: float = 0.1       # suffix: a draft path stops below this probability

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
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "dummy_weights",
                 "rejection_sample_method", "synthetic_acceptance_length", "synthetic_acceptance_rates",
                 *SUFFIX_KEYS}
        bad = sorted(set(d) - known)
        if bad:
            raise ConfigError(f"--speculative-config: unknown key(s) {', '.join(bad)} (valid: {', '.join(sorted(known))})")
        method = d.get("method") or ("draft_model" if d.get("model") else None)
        if method not in METHODS:
            raise ConfigError(f"--speculative-config: method must be one of {', '.join(METHODS)}, got {method!r}")
        k = d.get("num_speculative_tokens")
        if k is None and method == "suffix":  # vLLM: the tree depth; here at most what a verify step takes
            k = min(d.get("suffix_decoding_max_tree_depth", 24), MAX_SPEC_TOKENS)
        if k is None and method in DRAFTER_FOLDERS and isinstance(d.get("model"), str):  # the drafter's block
            k = min(_drafts_in(d["model"]), MAX_SPEC_TOKENS)
        cfg = cls(method=method, num_speculative_tokens=k,
                  prompt_lookup_max=d.get("prompt_lookup_max", NGRAM_MAX_DEFAULT),
                  prompt_lookup_min=d.get("prompt_lookup_min", 1), model=d.get("model"),
                  dummy_weights=d.get("dummy_weights", False),
                  rejection_sample_method=d.get("rejection_sample_method", "standard"),
                  synthetic_acceptance_length=d.get("synthetic_acceptance_length"),
                  synthetic_acceptance_rates=d.get("synthetic_acceptance_rates"),
                  **{key: d[key] for key in SUFFIX_KEYS if key in d})
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def int_in(name, lo, hi):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ConfigError(f"--speculative-config: {name} must be an int in {lo}..{hi}, got {v!r}")
        if self.method == "ngram":
            int_in("prompt_lookup_min", 1, 64)
            int_in("prompt_lookup_max", self.prompt_lookup_min, 64)
        elif self.method == "suffix":
            int_in("suffix_decoding_max_tree_depth", 1, 1024)
            int_in("suffix_decoding_max_cached_requests", 0, 10**7)
            f, p = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 64:
                raise ConfigError(f"--speculative-config: suffix_decoding_max_spec_factor must be a number in (0, 64], "
                                  f"got {f!r}")
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
                raise ConfigError(f"--speculative-config: suffix_decoding_min_token_prob must be a number in [0, 1], "
                                  f"got {p!r}")
        elif self.method in DRAFTER_FOLDERS:
            if not isinstance(self.model, str) or not self.model:
                raise ConfigError(f"--speculative-config: {self.method} needs \"model\": the drafter's folder")
            int_in("num_speculative_tokens", 1, min(MAX_SPEC_TOKENS, _drafts_in(self.model)))
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ConfigError("--speculative-config: draft_model needs \"model\": a preset name or model folder")
            if not isinstance(self.dummy_weights, bool):
                raise ConfigError(f"--speculative-config: dummy_weights must be true or false, got {self.dummy_weights!r}")
        int_in("num_speculative_tokens", 1, MAX_SPEC_TOKENS)  # after the method's own keys (suffix derives k)
        self._validate_synthetic()

    def _validate_synthetic(self) -> None:
        m, k = self.rejection_sample_method, self.num_speculative_tokens
        if m not in REJECTION:
            raise ConfigError(f"--speculative-config: rejection_sample_method must be one of {', '.join(REJECTION)}, "
                              f"got {m!r}")
        length, rates = self.synthetic_acceptance_length, self.synthetic_acceptance_rates
        if m == "standard":
            if length is not None or rates is not None:
                raise ConfigError("--speculative-config: synthetic_acceptance_length / _rates need "
                                  "\"rejection_sample_method\": \"synthetic\"")
            return
        if (length is None) == (rates is None):
            raise ConfigError("--speculative-config: synthetic acceptance needs exactly one of "
                              "synthetic_acceptance_length and synthetic_acceptance_rates")
        if length is not None:
            if isinstance(length, bool) or not isinstance(length, (int, float)) or not 1 <= length <= k + 1:
                raise ConfigError(f"--speculative-config: synthetic_acceptance_length must be a number in 1..{k + 1} "
                                  f"(the bonus token counts: num_speculative_tokens + 1 at most), got {length!r}")
            return
        ok = isinstance(rates, list) and len(rates) == k and all(
            isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r <= 1 for r in rates)
        if not ok or any(b > a for a, b in zip(rates, rates[1:])):
            raise ConfigError(f"--speculative-config: synthetic_acceptance_rates must be {k} numbers in [0, 1], one per "
                              f"draft position, non-increasing (a position is reached only past the one before), "
                              f"got {rates!r}")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @property
    def synthetic(self) -> bool:
        return self.rejection_sample_method == "synthetic"

    def acceptance_rates(self) -> list[float]:
        """Per draft position, the unconditional probability that it is accepted: the rates as given, or the
        length's minimum-variance schedule (acceptance_rates_for)."""
        if self.synthetic_acceptance_rates is not None:
            return [float(r) for r in self.synthetic_acceptance_rates]
        return acceptance_rates_for(float(self.synthetic_acceptance_length), self.k)


def acceptance_rates_for(length: float, k: int) -> list[float]:
    """A mean acceptance length (the bonus token counted) as per-position rates, as vLLM and SGLang spend it:
    the earliest positions first, so 3.78 at k = 7 is [1, 1, 0.78, 0, 0, 0, 0] (2 drafts always, a 3rd with
    probability 0.78: the schedule of least variance for that mean)."""
    left = length - 1.0
    rates = []
    for _ in range(k):
        r = min(1.0, max(0.0, left))
        rates.append(round(r, 12))  # 3.78 - 1 - 2 is 0.78 up to float dust
        left -= r
    return rates
