"""What a perfect prefix cache would reuse, computed from the requests alone: the yardstick of prefix-cache hits.

A request can reuse at most its longest common prefix with something computed before it: an earlier request's
prompt and reply (its last reply token is never written to the cache), in whole cache blocks, and never its own
last prompt token (always computed, for its logits). `theoretical_hits` sums that over the requests in the order
they were sent; the engine's own count (prefix_cache.stats["hit_tokens"], /metrics prefix_cache_hits) divided by
it is the share of the possible reuse a run got.
"""
from __future__ import annotations

from ..prefix_cache import common_prefix


def theoretical_hits(requests: list[tuple[list[int], list[int]]], block_size: int) -> list[int]:
    """requests: (prompt, reply) token ids in the order they were sent -> per request, the prompt tokens a
    perfect cache of this block size reuses."""
    seen: list[list[int]] = []
    out = []
    for prompt, reply in requests:
        limit = len(prompt) - 1
        best = max((common_prefix(prompt, s, limit) for s in seen), default=0)
        out.append(best // block_size * block_size)
        seen.append(list(prompt) + list(reply[:-1]))
    return out
