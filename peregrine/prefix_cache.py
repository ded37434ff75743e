"""Prefix caching for the hybrid cache: MLA latent blocks by content, KDA state snapshots at block ends.

A full block of a sequence's cached tokens is registered under a chain hash of its parent's hash and
its own tokens, so a later prompt that starts with the same tokens finds it. A registered block's MLA
entries never change again, so sequences share it read-only (reference counted).

KDA is recurrent: reusing p tokens also needs the state after token p - 1. Snapshots of a slot's
recurrent state and conv window are taken at block ends (chosen prefill positions, and as a sequence
decodes past a block end) and attached to the block they end. A prompt reuses its prefix up to the
deepest matched block that carries a snapshot; that block's snapshot is copied into its own slot.

Forks: a prompt computed beside a registered twin of its prefix (the same tokens under the same parent, computed
again because no snapshot lay at the fork) keeps its own blocks, but the chain goes on through the twin: its
later blocks register as the twin's children, and a snapshot it takes inside the shared part attaches to the
twin (the state at a block end depends on the tokens only), so the next prompt of that fork reuses up to it.

Never a wrong reuse: a hash only nominates candidates. A block is reused only if its stored tokens
equal the prompt's and its parent is the block just matched, named by a registration id that is never
reused (an evicted and re-registered block id gets a new one, so stale children stop matching).

Eviction: blocks nobody reads wait in an LRU (a finished sequence's tail first, so a chain shrinks from
its end); allocation takes never-registered free blocks first, then evicts the least recently used.
A snapshot goes with its block, or alone (LRU) when the snapshot pool is full.

A listener (kv_events.BlockEvents, `serve --kv-events-config`) hears of each registration, of each block whose
prefix becomes reusable (a snapshot attached; every registration without KDA layers) or stops being so (its
snapshot dropped or evicted), and of each eviction, by registration id.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from .cache import BlockAllocator, CacheFull

ROOT_HASH = 0x9E3779B97F4A7C15  # chain hash "before" the first block (any fixed value)
ROOT_UID = -1                   # parent of a sequence's first block


def common_prefix(a: list[int], b: list[int], limit: int | None = None) -> int:
    """Length of the common prefix of a and b (at most limit): a bisection of C-speed slice compares (a Python
    loop over a 12K-token prompt would cost milliseconds)."""
    hi = min(len(a), len(b)) if limit is None else min(limit, len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo, hi = 0, hi - 1  # a[:lo] == b[:lo]; they differ before hi + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """Hash of a block given its parent's: Python's tuple hash (ints hash the same in every process)."""
    return hash((parent, tokens))


@dataclass
class _Meta:
    uid: int                 # registration id, unique for the life of the cache
    parent_uid: int
    hash: int
    tokens: tuple[int, ...]


@dataclass
class Match:
    """A prompt's reusable prefix: shared blocks, the snapshot at their end, the chain hashes."""
    blocks: list[int] = field(default_factory=list)
    snapshot: int | None = None
    hashes: list[int] = field(default_factory=list)
    depth: int = 0  # blocks whose content matched, with or without a snapshot at their end (>= len(blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class PrefixCache:
    """Owns the block allocator's policy (refcounts, registration, LRU eviction) and the snapshot pool.
    enabled=False: plain allocate/free, no registration, matches are always empty."""

    def __init__(self, allocator: BlockAllocator, block_size: int, num_snapshots: int, needs_state: bool,
                 enabled: bool = True, hash_fn=chain_hash):
        self.alloc, self.bs, self.enabled, self.hash_fn = allocator, block_size, enabled, hash_fn
        self.needs_state = needs_state  # a KDA model: a prefix is usable only up to a snapshot
        self.ref: dict[int, int] = {}
        self.meta: dict[int, _Meta] = {}
        self.by_hash: dict[int, list[int]] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.twin: dict[int, tuple[int, int]] = {}  # an unregistered block -> (block, uid) registered with its content
        self._uid = 0
        self.snap_of: dict[int, int] = {}         # block -> snapshot slot at its end
        self.block_of: dict[int, int] = {}        # snapshot slot -> block
        self.snap_lru: OrderedDict[int, None] = OrderedDict()
        self.free_snaps = list(range(num_snapshots - 1, -1, -1)) if enabled else []
        self.listener = None  # kv_events.BlockEvents, or None
        self.stats = {"queries": 0, "query_tokens": 0, "hit_tokens": 0, "evicted_blocks": 0, "snapshots": 0,
                      "evicted_snapshots": 0}

    # ---- blocks ----
    @property
    def num_free(self) -> int:
        """Blocks an allocation can get now: free ones and evictable cached ones."""
        return self.alloc.num_free + len(self.evictable)

    def can_allocate(self, n: int, reuse: list[int]) -> bool:
        """Whether n new blocks fit once the `reuse` blocks are referenced (they stop being evictable)."""
        held = sum(1 for b in reuse if b in self.evictable)
        return self.num_free - held >= n

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise CacheFull(f"need {n} blocks, {self.num_free} free or evictable")
        take = min(n, self.alloc.num_free)
        out = self.alloc.allocate(take)
        while len(out) < n:
            b, _ = self.evictable.popitem(last=False)
            self._unregister(b)
            self.stats["evicted_blocks"] += 1
            out.append(b)
        for b in out:
            self.ref[b] = 1
        return out

    def acquire(self, blocks: list[int]) -> None:
        """Reference matched blocks (they leave the LRU while read)."""
        for b in blocks:
            self.ref[b] = self.ref.get(b, 0) + 1
            self.evictable.pop(b, None)

    def release(self, blocks: list[int]) -> None:
        """A sequence is done with its blocks: registered ones become the most recently used evictable
        ones, its tail ahead of its head (a chain loses its last blocks first); the rest are free."""
        for b in reversed(blocks):
            n = self.ref.get(b, 0) - 1
            if n > 0:
                self.ref[b] = n
                continue
            self.ref.pop(b, None)
            if b in self.meta:
                self.evictable[b] = None  # appended in reverse: the LRU's front (evicted first) gets the tail
            else:
                self.twin.pop(b, None)
                self.alloc.free([b])

    def _unregister(self, b: int) -> None:
        m = self.meta.pop(b, None)
        if m is None:
            return
        if self.listener is not None:
            self.listener.unregistered(m.uid)
        cands = self.by_hash.get(m.hash, [])
        if b in cands:
            cands.remove(b)
        if not cands:
            self.by_hash.pop(m.hash, None)
        s = self.snap_of.pop(b, None)
        if s is not None:
            self._free_snap(s)

    # ---- registration and lookup ----
    def register(self, blocks: list[int], hashes: list[int], token_ids: list[int], n_cached: int,
                 known: list[int] = ()) -> None:
        """Register every full block of a sequence's first n_cached tokens not yet registered.
        hashes (the sequence's chain so far) is extended in place, from `known` (the prompt's chain as far
        as its admission's lookup made it) where that reaches."""
        if not self.enabled:
            return
        bs = self.bs
        while (len(hashes) + 1) * bs <= n_cached:
            i = len(hashes)
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            h = known[i] if i < len(known) else self._next_hash(hashes, toks)
            hashes.append(h)
            b = blocks[i]
            if b in self.meta:  # a block this sequence reused
                continue
            parent_uid = self._uid_of(blocks[i - 1]) if i else ROOT_UID
            if parent_uid is None:
                continue  # its parent is neither registered nor a registered block's twin: nobody can reach it
            twin = self._find(h, toks, parent_uid)
            if twin is not None:  # the same content is registered already (a fork recomputed, or side by side):
                self.twin[b] = (twin, self.meta[twin].uid)  # keep one; the chain goes on through it
                continue
            self._uid += 1
            self.meta[b] = _Meta(self._uid, parent_uid, h, toks)
            self.by_hash.setdefault(h, []).append(b)
            if self.listener is not None:
                self.listener.registered(self._uid, None if parent_uid == ROOT_UID else parent_uid, toks)

    def _registered(self, b: int) -> int | None:
        """The registered block holding b's content: b itself, or its twin while that registration lasts."""
        if b in self.meta:
            return b
        t = self.twin.get(b)
        if t is not None and t[0] in self.meta and self.meta[t[0]].uid == t[1]:
            return t[0]
        return None

    def _uid_of(self, b: int) -> int | None:
        r = self._registered(b)
        return None if r is None else self.meta[r].uid

    def _find(self, h: int, toks: tuple[int, ...], parent_uid: int) -> int | None:
        for b in self.by_hash.get(h, ()):
            m = self.meta[b]
            if m.tokens == toks and m.parent_uid == parent_uid:
                return b
        return None

    def _next_hash(self, hashes: list[int], toks: tuple[int, ...]) -> int:
        """The chain hash of the block after `hashes` (a chain from the root), holding toks."""
        return self.hash_fn(hashes[-1] if hashes else ROOT_HASH, toks)

    def match(self, token_ids: list[int], limit: int, hashes: list[int] | None = None) -> Match:
        """The longest reusable prefix of at most `limit` tokens (whole blocks; for a KDA model it ends
        at a block with a snapshot). hashes: a prefix of the blocks' chain hashes, extended in place only
        as far as the lookup goes (a cold prompt's first block misses: its other blocks are hashed when
        they are registered, after its forward is queued, not before its first kernel). Pure lookup:
        nothing is referenced or moved."""
        if not self.enabled:
            return Match()
        bs, parent_uid = self.bs, ROOT_UID
        hs = hashes if hashes is not None else []
        blocks, best = [], (0, None)  # matched blocks; (blocks reusable, the snapshot at their end)
        for i in range(limit // bs):
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            if i == len(hs):
                hs.append(self._next_hash(hs, toks))
            b = self._find(hs[i], toks, parent_uid)
            if b is None:
                break
            blocks.append(b)
            parent_uid = self.meta[b].uid
            if not self.needs_state or b in self.snap_of:
                best = (len(blocks), self.snap_of.get(b))
        n = best[0]
        return Match(blocks[:n], best[1], list(hs[:n]), depth=len(blocks))

    def note_query(self, prompt_len: int, hit: Match) -> None:
        self.stats["queries"] += 1
        self.stats["query_tokens"] += prompt_len
        self.stats["hit_tokens"] += hit.num_blocks * self.bs
        if hit.snapshot is not None:
            self.snap_lru.move_to_end(hit.snapshot)

    # ---- snapshots ----
    @property
    def can_snapshot(self) -> bool:
        return self.enabled and bool(self.free_snaps or self.snap_lru)

    def new_snapshot(self) -> int | None:
        """A snapshot slot to write (evicting the least recently used one), or None without a pool."""
        if not self.enabled:
            return None
        if not self.free_snaps:
            if not self.snap_lru:
                return None
            s, _ = self.snap_lru.popitem(last=False)
            b = self.block_of.pop(s)
            self.snap_of.pop(b, None)
            self.stats["evicted_snapshots"] += 1
            if self.listener is not None and b in self.meta:
                self.listener.unreusable(self.meta[b].uid)
            return s
        return self.free_snaps.pop()

    def attach(self, s: int, block: int) -> bool:
        """The snapshot s holds the state at `block`'s end: keep it at the registered block of that content
        (the block, or its twin) if there is one, else free it."""
        block = self._registered(block)
        if block is None:
            self.free_snaps.append(s)
            return False
        old = self.snap_of.get(block)
        if old is not None and old != s:
            self._free_snap(old)  # a newer copy of the same state
        self.snap_of[block] = s
        self.block_of[s] = block
        self.snap_lru[s] = None
        self.snap_lru.move_to_end(s)
        self.stats["snapshots"] += 1
        if old is None and self.listener is not None:
            self.listener.reusable(self.meta[block].uid)
        return True

    def unplan(self, s: int) -> None:
        """Give back a snapshot slot this step planned and will not attach."""
        self.free_snaps.append(s)

    def drop(self, s: int, block: int) -> None:
        """Drop the snapshot s at `block`'s end, if it is still there: the LRU may have evicted it and
        handed the slot to another prefix since, and then the slot is no longer the caller's."""
        if self.block_of.get(s) == block:
            del self.snap_of[block]
            self._free_snap(s)
            if self.listener is not None and block in self.meta:
                self.listener.unreusable(self.meta[block].uid)

    def _free_snap(self, s: int) -> None:
        self.block_of.pop(s, None)
        self.snap_lru.pop(s, None)
        self.free_snaps.append(s)
