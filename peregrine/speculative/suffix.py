"""Suffix decoding (model-free; SuffixDecoding, Snowflake, NeurIPS 2025; vLLM's "method": "suffix").

Two bounded-depth suffix tries count which token followed every context of up to `max_tree_depth` tokens:
one per request over its prompt and output (agents copy from their context), one global over the outputs of
the last `max_cached_requests` finished requests (agents repeat themselves across calls). To draft, each
suffix of the sequence found in a trie (its match length m) is followed greedily along its most frequent
continuation while the path's probability (the product of count(child) / count(children)) stays at or above
`min_token_prob`, for at most min(k, ceil(max_spec_factor * m)) tokens: longer matches speculate further. Of
all these candidates, over every match length and both tries, the one with the most expected accepted tokens
(the sum of its path probabilities) wins, as in Arctic's. Every match length, not only the longest: a trie of
depth D continues a context of m tokens by at most D - m tokens, so the longest match (m near D once a copy
runs) could only ever draft one or two. The path probabilities are also the drafts' survival for the verify
width chooser (width.py).

Written here rather than taken from `arctic-inference` (Snowflake's implementation): it ships as a source
package only, whose C++ build needs cmake, nanobind, protobuf and grpc tooling and a torch to build against,
and it installs as a vLLM plugin; the GPU machine has no network and Python 3.12, so every such build would
have to travel as a wheel made elsewhere. A trie in dicts does the same counting at O(depth) per token.
"""
from __future__ import annotations

import math
from collections import OrderedDict

from ..prefix_cache import common_prefix

DEFAULTS = {"suffix_decoding_max_tree_depth": 24, "suffix_decoding_max_cached_requests": 10000,
            "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}  # vLLM's
# The tries are uncompressed: about 5-6 KiB of host memory per token at depth 24 (measured with tracemalloc
# over source text and random ids), so a 32K-token request's own trie holds ~190 MB while it runs. The global
# trie is held to GLOBAL_MAX_TOKENS output tokens (~100 MB) besides vLLM's request cap. A compressed suffix
# tree (O(tokens) nodes, as arctic-inference's) is the fix for long contexts.
GLOBAL_MAX_TOKENS = 16384
# A finished request's own trie is kept for a next request whose prompt starts with its tokens (an agent's next
# turn resends the conversation): only the new tokens are then counted, not the whole context again (~0.7 s of
# host time for 30K tokens on the CI machine, and a prefix-cached turn's prefill is too short to hide it). At most
# KEPT_TOKENS_PER_SEQ tokens' tries per request the engine runs at once are kept (~160 MB each), and KEPT_MAX_TOKENS
# (~330 MB) at least, the oldest dropped first: c agents taking turns each find their last turn's trie. A kept trie
# whose last REUSE_SLACK tokens differ from the new prompt (a re-rendered ending) has them uncounted first.
KEPT_MAX_TOKENS = 65536
KEPT_TOKENS_PER_SEQ = 32768
REUSE_SLACK = 64


class SuffixTrie:
    """Counts of every context of up to `depth` tokens and what followed it, over one or more sequences.

    Nodes are ints: node n's children are kids[n] ({token: child}, None for a leaf) and its count count[n].
    Dicts of ints are not tracked by Python's cyclic garbage collector, so millions of nodes cost a collection
    nothing (as objects each node was tracked, and a full collection walked them all: 0.2-0.3 s pauses inside
    decode steps once a request's trie held 30K tokens). Uncounted nodes go to a free list for reuse."""

    def __init__(self, depth: int):
        self.depth, self.root = depth, 0
        self.kids: list[dict[int, int] | None] = [None]
        self.count: list[int] = [0]
        self.free: list[int] = []

    @property
    def live(self) -> int:
        """Nodes in use, the root included."""
        return len(self.count) - len(self.free)

    def child(self, node: int, t: int) -> int | None:
        k = self.kids[node]
        return None if k is None else k.get(t)

    def counts(self, node: int) -> dict[int, int]:
        """{token: how often it followed node's context}."""
        return {t: self.count[c] for t, c in (self.kids[node] or {}).items()}

    def _drop(self, node: int) -> None:
        """Free node and everything below it."""
        stack, kids, count, free = [node], self.kids, self.count, self.free
        while stack:
            n = stack.pop()
            if kids[n]:
                stack.extend(kids[n].values())
            kids[n], count[n] = None, 0
            free.append(n)

    def step(self, active: list[int], t: int, sign: int = 1) -> list[int]:
        """Count (sign 1) or uncount (-1) token t after the root and after each context in `active` (the nodes of
        the contexts ending at the previous token, shortest first); -> the same for the contexts ending at t."""
        kids, count, nxt = self.kids, self.count, []
        if sign == 1:  # counting, the hot path (every fed token): no removals to check
            add, free = nxt.append, self.free
            for node in (0, *active[:self.depth - 1]):  # a context at the depth is not extended further
                k = kids[node]
                if k is None:
                    k = kids[node] = {}
                c = k.get(t)
                if c is None:
                    if free:
                        c = free.pop()
                    else:
                        c = len(count)
                        count.append(0)
                        kids.append(None)
                    k[t] = c
                count[c] += 1
                add(c)
            return nxt
        gone = []  # freed after the walk: a longer context of this token may lie below one that just emptied
        for node in (0, *active[:self.depth - 1]):  # (a repeated token: [a] empties, then [a a] is walked)
            k = kids[node]
            c = None if k is None else k.get(t)
            if c is None:
                raise ValueError(f"uncounting a context the trie does not hold (token {t})")
            count[c] -= 1
            if count[c] == 0:  # its right extensions occur nowhere either
                del k[t]
                if not k:
                    kids[node] = None
                gone.append(c)
            else:
                nxt.append(c)
        for c in gone:
            self._drop(c)
        return nxt

    def add(self, tokens, sign: int = 1) -> None:
        """Count (sign 1) or uncount (-1) every context of `tokens` up to the depth."""
        active: list[int] = []
        for t in tokens:
            active = self.step(active, t, sign)

    def matches(self, tokens) -> list[tuple[int, int]]:
        """(node, m) of each suffix of `tokens` of m <= depth tokens seen before with a continuation, shortest first.
        The trie counts every context's suffixes too, so once a suffix is missing (or has no continuation) every
        longer one is: the walk stops there."""
        out, kids = [], self.kids
        for m in range(1, min(self.depth, len(tokens)) + 1):
            node = 0
            for t in tokens[len(tokens) - m:]:
                k = kids[node]
                node = None if k is None else k.get(t)
                if node is None:
                    return out
            if not kids[node]:
                return out
            out.append((node, m))
        return out

    def match(self, tokens) -> tuple[int | None, int]:
        """The node of the longest suffix of `tokens` (up to the depth) that has continuations, and its length."""
        return (self.matches(tokens) or [(None, 0)])[-1]


class _Request:
    """A request's own trie, kept current as tokens are appended (O(depth) a token)."""

    def __init__(self, depth: int):
        self.trie, self.tokens, self.active = SuffixTrie(depth), [], []

    @property
    def seen(self) -> int:
        return len(self.tokens)

    def update(self, tokens) -> None:
        new = tokens[len(self.tokens):]
        for t in new:
            self.active = self.trie.step(self.active, t)
        self.tokens.extend(new)

    def truncate(self, n: int) -> None:
        """Uncount the contexts ending at positions n.. (the last first: a context's right extensions are gone
        before it), so the trie counts tokens[:n] alone; O(depth^2) a dropped token."""
        toks, tr, D = self.tokens, self.trie, self.trie.depth
        kids, count = tr.kids, tr.count
        for p in range(len(toks) - 1, n - 1, -1):
            for m in range(1, min(D, p + 1) + 1):
                parent, node = 0, 0
                for t in toks[p - m + 1:p + 1]:
                    parent, node = node, kids[node][t]
                count[node] -= 1
                if count[node] == 0:
                    del kids[parent][toks[p]]
                    if not kids[parent]:
                        kids[parent] = None
                    tr._drop(node)
        del toks[n:]
        self.active = []
        for m in range(1, min(D, n) + 1):  # the contexts ending at the new last token, shortest first
            node = 0
            for t in toks[n - m:]:
                node = kids[node][t]
            self.active.append(node)

    def matches(self) -> list[tuple[int, int]]:
        """SuffixTrie.matches of the request's own tokens, read off the nodes update already holds: active[m - 1]
        is the context of the last m tokens."""
        kids = self.trie.kids
        return [(n, m) for m, n in enumerate(self.active, 1) if kids[n]]

    def match(self) -> tuple[int | None, int]:
        return (self.matches() or [(None, 0)])[-1]


def follow(trie: SuffixTrie, node: int, limit: int, min_prob: float) -> tuple[list[int], list[float]]:
    """Greedy path from node along its most frequent continuation: (tokens, survival), survival[j] being the
    product of the conditional frequencies up to token j; stops below min_prob or at limit tokens."""
    toks, surv, p = [], [], 1.0
    kids, count = trie.kids, trie.count
    while kids[node] and len(toks) < limit:
        k = kids[node]
        total = sum(count[c] for c in k.values())
        t, c = max(k.items(), key=lambda kv: (count[kv[1]], -kv[0]))  # ties: the lowest id
        p *= count[c] / total
        if p < min_prob:
            break
        toks.append(t)
        surv.append(p)
        node = c
    return toks, surv


class SuffixDrafter:
    """The drafter interface (drafters.py) over the two tries; `survival` holds each proposal's path
    probabilities (by sequence) for the width chooser."""

    host_only = True  # proposes on the host alone: the engine may ask it ahead of a step (SpecDecoder.plain_next)

    def __init__(self, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float,
                 max_num_seqs: int = 1):
        self.depth, self.max_cached = max_tree_depth, max_cached_requests
        self.kept_budget = max(KEPT_MAX_TOKENS, KEPT_TOKENS_PER_SEQ * max_num_seqs)  # tokens of kept tries
        self.factor, self.min_prob = max_spec_factor, min_token_prob
        self.requests: dict[int, _Request] = {}       # by id(seq), while it runs
        self.glob = SuffixTrie(max_tree_depth)         # outputs of finished requests
        self.cached: OrderedDict[int, list[int]] = OrderedDict()  # what glob counts, oldest first
        self._n = 0  # keys of self.cached (ids of finished sequences can be reused)
        self.cached_tokens = 0
        self.survival: dict[int, list[float]] = {}
        self.kept: OrderedDict[int, _Request] = OrderedDict()  # finished requests' tries, oldest first
        self.reused = 0  # requests that started from a kept trie

    def _best(self, trie: SuffixTrie, matches, k: int) -> tuple[list[int], list[float]]:
        """The candidate with the most expected accepted tokens over these matches (ties: the longer match).
        Longest first: a match whose length cap cannot beat the best so far (each token adds at most 1) is not
        followed; the short ones, whose nodes have the most children to scan, rarely are."""
        best, got = ([], []), 0.0
        for node, m in reversed(matches):
            limit = min(k, math.ceil(self.factor * m))
            if best[0] and limit <= got:
                continue
            cand = follow(trie, node, limit, self.min_prob)
            total = sum(cand[1])
            if cand[0] and (not best[0] or total > got):
                best, got = cand, total
        return best

    def _request(self, s) -> _Request:
        """The sequence's own trie (a kept one reused, or a new one, at its first call), counted through its tokens."""
        r = self.requests.get(id(s))
        if r is None:
            r = self.requests[id(s)] = self._start(s.token_ids)
        r.update(s.token_ids)
        return r

    def propose(self, seqs, ks: list[int]) -> list[list[int]]:
        out = []
        for s, k in zip(seqs, ks):
            r = self._request(s)
            # the request's own trie counts the sequence's end too: its deepest suffix has no continuation
            # there, so match finds the longest suffix seen before with one
            best = max((self._best(r.trie, r.matches(), k), self._best(self.glob, self.glob.matches(s.token_ids), k)),
                       key=lambda d: sum(d[1]))
            self.survival[id(s)] = best[1]
            out.append(best[0])
        return out

    def prepare(self, seqs) -> None:
        """Requests in prefill: their tries counted now, while the GPU runs the prefill the engine has just launched,
        rather than inside their first decode step (a fresh 30K-token context is ~0.3-0.7 s of host work)."""
        for s in seqs:
            self._request(s)

    def _start(self, tokens) -> _Request:
        """A new request's trie: the kept one sharing the longest prefix with its tokens (all but at most REUSE_SLACK
        of the kept tokens), cut to that prefix; else an empty one."""
        best, key, n = None, None, 0
        for k, r in self.kept.items():
            c = common_prefix(r.tokens, tokens)
            if c > n and c >= r.seen - REUSE_SLACK:
                best, key, n = r, k, c
        if best is None:
            return _Request(self.depth)
        del self.kept[key]
        best.truncate(n)
        self.reused += 1
        return best

    def verified(self, seq, drafted: int, accepted: int) -> None:
        pass

    def release(self, seq) -> None:
        """A finished (or aborted) request's output joins the global trie; the oldest leaves past the cap."""
        r = self.requests.pop(id(seq), None)
        self.survival.pop(id(seq), None)
        if r is not None and r.seen <= self.kept_budget:
            self._n += 1
            self.kept[self._n] = r
            while sum(k.seen for k in self.kept.values()) > self.kept_budget:
                self.kept.popitem(last=False)
        if self.max_cached <= 0:
            return
        out = list(seq.token_ids[seq.prompt_len:])[-GLOBAL_MAX_TOKENS:]
        if not out:
            return
        self.glob.add(out)
        self._n += 1
        self.cached[self._n] = out
        self.cached_tokens += len(out)
        while len(self.cached) > self.max_cached or self.cached_tokens > GLOBAL_MAX_TOKENS:
            _, old = self.cached.popitem(last=False)
            self.glob.add(old, sign=-1)
            self.cached_tokens -= len(old)
