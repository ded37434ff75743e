"""Drafters propose up to k next tokens for each decoding sequence.

Interface (the draft model in draft_model.py implements the same):
  propose(seqs, ks) -> one list of at most ks[i] token ids per sequence
  verified(seq, drafted, accepted)  after the verify step, before the new tokens are appended
  release(seq)                      the sequence finished or was aborted
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramDrafter:
    """Prompt lookup (no weights): find the sequence's last n tokens earlier in its own
    prompt + output (longest n first, max_n .. min_n) and propose what followed them.
    Of the earlier occurrences, the latest one that still has k tokens after it wins
    (recent context predicts best; a full continuation wastes no verify slot), else the latest."""

    def __init__(self, max_n: int, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        L = len(tokens)
        if k <= 0 or L < 2:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            win = sliding_window_view(arr[:-1], n)          # win[p] = arr[p:p+n], p + n <= L - 1
            hits = np.flatnonzero((win == arr[L - n:]).all(axis=1))
            if hits.size == 0:
                continue
            full = hits[hits + n + k <= L]
            p = int(full[-1] if full.size else hits[-1])
            return arr[p + n: p + n + k].tolist()
        return []

    def propose(self, seqs, ks: list[int]) -> list[list[int]]:
        return [self.lookup(s.token_ids, k) for s, k in zip(seqs, ks)]

    def verified(self, seq, drafted: int, accepted: int) -> None:
        pass

    def release(self, seq) -> None:
        pass
