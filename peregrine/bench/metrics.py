"""A server's /metrics page read back by the serving benchmarks (bench serve, the AgentX replay)."""
from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*?)(?:_total)?(?:\{[^}]*\})? ([-+0-9.eEinfNa]+)$")  # one sample line


def parse_counters(text: str, names) -> dict:
    """{name: value summed over its labels} of a Prometheus text page, for the given names (a `_total` suffix
    dropped)."""
    out: dict = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in names:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out
