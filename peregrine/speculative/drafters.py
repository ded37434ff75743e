"""Drafters propose up to k next tokens for each decoding sequence.

Interface (the draft model in draft_model.py implements the same):
  propose(seqs, ks) -> one list of at most ks[i] token ids per sequence
  verified(seq, drafted, accepted)  after the verify step, before the new tokens are appended
  release(seq)                      the sequence finished or was aborted
"""
from __future__ import annotations

import numpy as np


class NgramDrafter:
    """Prompt lookup (no weights): find the sequence's last n tokens earlier in its own
    prompt + output (longest n first, max_n .. min_n) and propose what followed them.
    Of the earlier occurrences, the latest one that still has k tokens after it wins
    (recent context predicts best; a full continuation wastes no verify slot), else the latest.

    Each sequence's tokens are kept in a numpy buffer appended to as it grows (a 30K-token list converted every
    step was ~1 ms), and the search starts from the positions holding its last token (one pass over the context)
    instead of comparing every window for every n (another ~1 ms at 30K)."""

    host_only = True  # proposes on the host alone: the engine may ask it ahead of a step (SpecDecoder.plain_next)

    def __init__(self, max_n: int, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.bufs: dict[int, tuple[np.ndarray, int]] = {}  # id(seq) -> (tokens buffer, tokens in it)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        return self._lookup(np.asarray(tokens, dtype=np.int64), len(tokens), k)

    def _lookup(self, arr: np.ndarray, L: int, k: int) -> list[int]:
        """lookup over arr[:L]."""
        if k <= 0 or L < 2:
            return []
        top = min(self.max_n, L - 1)
        ends = [np.flatnonzero(arr[:L - 1] == arr[L - 1])]  # ends[n-1]: where an earlier copy of the last n ends
        for j in range(1, top):
            e = ends[-1]
            e = e[e >= j]
            ends.append(e[arr[e - j] == arr[L - 1 - j]])
        for n in range(top, self.min_n - 1, -1):
            hits = ends[n - 1] - (n - 1)  # start positions, ascending
            if hits.size == 0:
                continue
            full = hits[hits + n + k <= L]
            p = int(full[-1] if full.size else hits[-1])
            return arr[p + n:min(p + n + k, L)].tolist()  # (arr may be a buffer longer than L)
        return []

    def _tokens(self, seq) -> tuple[np.ndarray, int]:
        toks = seq.token_ids
        buf, n = self.bufs.get(id(seq), (None, 0))
        if buf is None or n > len(toks):
            buf, n = np.empty(max(64, 2 * len(toks)), dtype=np.int64), 0
        if len(toks) > buf.size:
            buf = np.concatenate([buf[:n], np.empty(len(toks) + buf.size, dtype=np.int64)])
        if len(toks) > n:
            buf[n:len(toks)] = toks[n:]
            n = len(toks)
        self.bufs[id(seq)] = (buf, n)
        return buf, n

    def propose(self, seqs, ks: list[int]) -> list[list[int]]:
        return [self._lookup(*self._tokens(s), k) for s, k in zip(seqs, ks)]

    def verified(self, seq, drafted: int, accepted: int) -> None:
        pass

    def release(self, seq) -> None:
        self.bufs.pop(id(seq), None)
