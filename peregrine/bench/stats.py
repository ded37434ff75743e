"""Step selection and summary statistics for the decode benchmark (docs/benchmarks.md §1)."""
from __future__ import annotations

import math


def _get(rec, key, default=None):
    return rec.get(key, default) if isinstance(rec, dict) else getattr(rec, key, default)


def is_pure_decode(rec, batch_size: int) -> bool:
    """Exactly B sequences ran and every one of them was in decode (no prefill token)."""
    if _get(rec, "num_seqs") != batch_size or _get(rec, "num_prefill_tokens") != 0:
        return False
    nd = _get(rec, "num_decode_seqs")
    return nd is None or nd == batch_size


def decode_steps(step_records, batch_size: int) -> list[float]:
    """duration_s of the steps where exactly B sequences ran, all in decode (units kept: seconds).

    step_records: dicts or objects with num_seqs, num_prefill_tokens, duration_s
    (and optionally num_decode_seqs)."""
    return [float(_get(r, "duration_s")) for r in step_records if is_pure_decode(r, batch_size)]


def percentile(samples, q: float) -> float:
    """q-th percentile (0..100) by linear interpolation between closest ranks
    (numpy's default 'linear' method): position q/100 * (n - 1) in sorted order."""
    xs = sorted(samples)
    if not xs:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in 0..100, got {q}")
    pos = q / 100 * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(samples) -> dict:
    """{median, p50, p90, p99, mean, min, max, n}; values None when there are no samples."""
    xs = [float(x) for x in samples]
    if not xs:
        return {"median": None, "p50": None, "p90": None, "p99": None, "mean": None, "min": None, "max": None, "n": 0}
    p50 = percentile(xs, 50)
    return {"median": p50, "p50": p50, "p90": percentile(xs, 90), "p99": percentile(xs, 99),
            "mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
