"""The engine's TokenLogprob lists in OpenAI's two response shapes.

Completions (legacy): {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}.
Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
A token is shown as its bytes decoded as UTF-8 (a character split over tokens shows U+FFFD; chat's
`bytes` keeps the exact bytes). A prompt's first token has no logprob: null, as OpenAI's echo does.
"""
from __future__ import annotations

import math

NEG_INF_LOGPROB = -9999.0  # JSON has no -Infinity: a token of probability 0 gets this (vLLM does the same)


def _lp(v: float) -> float:
    return v if math.isfinite(v) else NEG_INF_LOGPROB


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._cache: dict[int, str] = {}

    def token_bytes(self, i: int) -> bytes:
        return self.tok.token_bytes(i)

    def token_str(self, i: int) -> str:
        s = self._cache.get(i)
        if s is None:
            s = self._cache[i] = self.token_bytes(i).decode("utf-8", errors="replace")
        return s

    def completion(self, entries: list, offset: int = 0) -> tuple[dict, int]:
        """entries: TokenLogprob or None (the prompt's first token, given as (None, token id)).
        -> (the logprobs object, text offset after the last token)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            tid, tl = (e[1], None) if isinstance(e, tuple) else (e.token_id, e)
            s = self.token_str(tid)
            out["tokens"].append(s)
            out["text_offset"].append(offset)
            offset += len(s)
            if tl is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                out["token_logprobs"].append(_lp(tl.logprob))
                out["top_logprobs"].append({self.token_str(i): _lp(v) for i, v in tl.top})
        return out, offset

    def chat(self, entries: list) -> dict:
        def one(i, v):
            return {"token": self.token_str(i), "logprob": _lp(v), "bytes": list(self.token_bytes(i))}
        return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(i, v) for i, v in e.top]}
                            for e in entries]}


def prompt_entries(prompt_ids: list[int], prompt_logprobs: list | None) -> list:
    """Echo: the prompt's TokenLogprobs, its first token as (None, id)."""
    lps = prompt_logprobs or [None] * len(prompt_ids)
    return [(None, t) if lp is None else lp for t, lp in zip(prompt_ids, lps)]
