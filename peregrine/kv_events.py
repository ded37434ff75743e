"""KV cache events in vLLM's format: what each replica's prefix cache holds, for a KV-aware router.

`peregrine serve --kv-events-config JSON` (vLLM's spelling: enable_kv_cache_events, publisher "zmq", endpoint,
replay_endpoint, buffer_steps, hwm, max_queue_size, topic) publishes batches of BlockStored / BlockRemoved /
AllBlocksCleared events as vLLM does, so `vllm-router --policy kv_aware --kv-event-source URL=ENDPOINT` routes
each request to the replica that holds its longest reusable prefix.

Wire format (vLLM >= 0.28's msgspec encoding, checked against vllm-router 0.1.17):
  - ZMQ PUB, one multipart message per batch: [topic (utf-8), seq (8-byte big-endian, 0, 1, ... per process),
    payload]. The replay socket (ROUTER, optional) answers [identity, b"", start seq] with every buffered
    [identity, b"", seq, payload] from start on, then [identity, b"", -1 (8 bytes, signed), b""].
  - payload: msgpack of the batch as an array [ts (float64), [events], data_parallel_rank (0)];
    each event a map, its tag first and vLLM's fields in vLLM's order:
      {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
       "medium", "lora_name"}
      {"type": "BlockRemoved", "block_hashes", "medium"}
      {"type": "AllBlocksCleared"}
    (vLLM omits its defaulted fields extra_keys, group_idx, ... when unset, and so does peregrine.)
  - block hashes: a chain, digest_i = sha256(digest_{i-1} || the block's token ids as uint32 little-endian),
    digest_{-1} = 32 zero bytes; published as vLLM publishes a hash as an integer: the digest's last 8 bytes,
    big-endian (int.from_bytes(digest, "big") & (2**64 - 1)). A consumer (vllm-router) takes them as opaque ids
    (parent links, removals) and hashes the token ids itself.
  - medium "GPU": vLLM's name for the engine's own KV cache tier (also on a CPU host), the tier a router
    credits in full.

What a block event means for peregrine's hybrid cache (prefix_cache.py): MLA blocks are stored by content, but
a KDA layer needs the recurrent state at the prefix's end, so a prefix is reusable only up to a block that
carries a KDA state snapshot. A block is announced when the prefix it ends becomes reusable: when a snapshot
attaches to it, it is stored together with its not yet announced ancestors (one BlockStored, parent first,
parent_block_hash naming the deepest announced ancestor), because a router credits a chain from its root.
Blocks stay announced while a reusable prefix runs through them; when the last snapshot at or below a block goes
(evicted, replaced by a later decode snapshot) or the block is evicted, it and the announced blocks that depended
on it are removed (BlockRemoved, deepest first). The snapshots themselves are never announced. Without KDA layers
every registered block ends a reusable prefix and is announced as it is registered. Each process's first batch
is AllBlocksCleared: a restarted replica holds nothing.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import queue
import struct
import threading
import time
from collections import deque

from .errors import ConfigError

log = logging.getLogger(__name__)

ROOT_DIGEST = bytes(32)   # the parent digest of a chain's first block
MEDIUM = "GPU"            # vLLM's MEDIUM_GPU: the engine's own cache
END_SEQ = (-1).to_bytes(8, "big", signed=True)
SCHEMA_VERSION = 1        # what /kv_event_sources declares (vllm-router 0.1.17 takes 1, encoding "msgpack")
EXTRA = "fleet"           # the extra that brings pyzmq and msgpack


# ---- configuration: vLLM's KVEventsConfig ----
@dataclasses.dataclass
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None          # "zmq" or "null"; unset: "zmq" when enabled
    endpoint: str = "tcp://*:5557"        # vLLM's rule: "*", "::", ipc:// or inproc:// binds, else connects
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000            # batches kept for replay
    hwm: int = 100_000                    # the PUB socket's high-water mark
    max_queue_size: int = 100_000         # batches waiting for the publisher thread
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @property
    def binds(self) -> bool:
        e = self.endpoint
        return "*" in e or "::" in e or e.startswith(("ipc://", "inproc://"))


_TYPES = {"enable_kv_cache_events": (bool, "true or false"), "publisher": (str, 'a string ("zmq" or "null")'),
          "endpoint": (str, "a string"), "replay_endpoint": ((str, type(None)), "a string or null"),
          "buffer_steps": (int, "an integer"), "hwm": (int, "an integer"), "max_queue_size": (int, "an integer"),
          "topic": (str, "a string")}


def parse_kv_events_config(text: str | None) -> KVEventsConfig | None:
    """--kv-events-config's JSON -> the config, or None when events are off. ConfigError names the field."""
    if text is None:
        return None
    where = "--kv-events-config"
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(raw).__name__}")
    for k, v in raw.items():
        if k not in _TYPES:
            raise ConfigError(f"{where}: unknown field '{k}' (fields: {', '.join(_TYPES)})")
        types, what = _TYPES[k]
        if not isinstance(v, types) or (isinstance(v, bool) and types is int):
            raise ConfigError(f"{where}: '{k}' must be {what}, got {json.dumps(v)}")
    cfg = KVEventsConfig(**raw)
    if cfg.publisher is None:
        cfg.publisher = "zmq" if cfg.enable_kv_cache_events else "null"
    if cfg.publisher not in ("zmq", "null"):
        raise ConfigError(f"{where}: 'publisher' must be \"zmq\" or \"null\", got {json.dumps(cfg.publisher)}")
    for k, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
        if getattr(cfg, k) < low:
            raise ConfigError(f"{where}: '{k}' must be >= {low}, got {getattr(cfg, k)}")
    for k in ("endpoint", "replay_endpoint"):
        e = getattr(cfg, k)
        if e is not None and not e.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"{where}: '{k}' must be a ZMQ address (tcp://HOST:PORT, ipc://PATH or "
                              f"inproc://NAME), got {json.dumps(e)}")
    if cfg.enable_kv_cache_events and cfg.publisher == "null":
        log.info("%s: publisher \"null\": no events are published", where)
    return cfg if cfg.enabled else None


# ---- block hashes ----
def block_digest(parent: bytes, tokens) -> bytes:
    """The block's chain digest: sha256 of the parent's digest and its token ids as uint32 little-endian."""
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}I", *tokens)).digest()


def external_hash(digest: bytes) -> int:
    """The integer vLLM publishes for a block hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): its low 64 bits."""
    return int.from_bytes(digest[-8:], "big")


# ---- what the prefix cache announces (engine thread) ----
class _Ann:
    __slots__ = ("parent", "children", "snap")

    def __init__(self, parent: int | None):
        self.parent, self.children, self.snap = parent, set(), False


class BlockEvents:
    """The prefix cache's listener: turns registrations, snapshots and evictions into stored / removed events
    over registration ids (uids). Events wait in `pending` until take(); the publisher turns uids into hashes.
    needs_state: a KDA model (a block is announced when a snapshot makes the prefix it ends reusable)."""

    def __init__(self, needs_state: bool):
        self.needs_state = needs_state
        self.known: dict[int, tuple[int | None, tuple]] = {}  # every registered block: uid -> (parent uid, tokens)
        self.ann: dict[int, _Ann] = {}                        # announced blocks
        self.pending: list[tuple] = []
        self._lock = threading.Lock()

    # hooks (prefix_cache.py calls them)
    def registered(self, uid: int, parent: int | None, tokens: tuple) -> None:
        with self._lock:
            self.known[uid] = (parent, tokens)
            if not self.needs_state:
                self._announce(uid)

    def reusable(self, uid: int) -> None:
        """A snapshot now ends at this block."""
        if not self.needs_state:  # every registered block is announced already
            return
        with self._lock:
            self._announce(uid)

    def unreusable(self, uid: int) -> None:
        """The block lost its snapshot (it stays registered)."""
        if not self.needs_state:
            return
        with self._lock:
            a = self.ann.get(uid)
            if a is not None:
                a.snap = False
                self._prune(uid, [])

    def unregistered(self, uid: int) -> None:
        """The block was evicted: it and every announced block below it go."""
        with self._lock:
            self.known.pop(uid, None)
            a = self.ann.get(uid)
            if a is None:
                return
            order, stack = [], [uid]
            while stack:  # the announced subtree, each block before its children
                u = stack.pop()
                order.append(u)
                stack.extend(self.ann[u].children)
            gone = []
            for u in reversed(order):  # deepest first
                self.ann.pop(u)
                gone.append(u)
            if a.parent is not None and a.parent in self.ann:
                self.ann[a.parent].children.discard(uid)
                self._prune(a.parent, gone)
            else:
                self.pending.append(("removed", gone))

    def take(self) -> list[tuple]:
        with self._lock:
            out, self.pending = self.pending, []
            return out

    # internals (lock held)
    def _announce(self, uid: int) -> None:
        a = self.ann.get(uid)
        if a is not None:
            a.snap = True
            return
        chain, u = [], uid
        while u is not None and u not in self.ann:
            k = self.known.get(u)
            if k is None:  # an ancestor is gone: nothing can reach this block (prefix_cache's stale children)
                return
            chain.append(u)
            u = k[0]
        top = u  # the deepest announced ancestor, or None (the root)
        blocks = []
        for c in reversed(chain):
            parent = self.known[c][0]
            self.ann[c] = _Ann(parent)
            if parent is not None:
                self.ann[parent].children.add(c)
            blocks.append((c, self.known[c][1]))
        self.ann[uid].snap = True
        self.pending.append(("stored", top, blocks))

    def _prune(self, uid: int, gone: list[int]) -> None:
        """Remove uid and its ancestors while nothing reusable runs through them."""
        while uid is not None:
            a = self.ann.get(uid)
            if a is None or a.snap or a.children:
                break
            self.ann.pop(uid)
            gone.append(uid)
            if a.parent is not None and a.parent in self.ann:
                self.ann[a.parent].children.discard(uid)
            uid = a.parent
        if gone:
            self.pending.append(("removed", gone))


# ---- the ZMQ publisher (its own thread) ----
def _import_transport():
    try:
        import msgpack
        import zmq
    except ImportError as e:
        raise ConfigError(f"--kv-events-config needs pyzmq and msgpack ({e.name} is missing): "
                          f"pip install 'peregrine[{EXTRA}]'") from None
    return zmq, msgpack


class KVEventPublisher:
    """Binds (or connects) the PUB socket and the optional replay ROUTER socket at once, so a bad or busy address
    fails before the model loads; batches are encoded and sent on a thread of its own, in order, each with the
    next sequence number. block_size is set once the engine is built (attach)."""

    def __init__(self, cfg: KVEventsConfig, say=None):
        zmq, self._msgpack = _import_transport()
        self.cfg, self.block_size = cfg, None
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        what = f"{'bind' if cfg.binds else 'connect'} 'endpoint' {cfg.endpoint}"
        try:
            if cfg.binds:
                self._pub.bind(cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
            if cfg.replay_endpoint is not None:
                what = f"bind 'replay_endpoint' {cfg.replay_endpoint}"
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(f"--kv-events-config: cannot {what}: {e}") from None
        if say is not None:
            how = (f"publishing on {cfg.endpoint}" if cfg.binds else
                   f"connecting to {cfg.endpoint} (vLLM's rule: an address without '*' or '::' connects to a "
                   f"listener; vllm-router's subscriber connects too, so give it tcp://*:PORT to be found)")
            say(f"KV cache events: {how}, topic {cfg.topic!r}"
                + (f", replay on {cfg.replay_endpoint} ({cfg.buffer_steps} batches)" if cfg.replay_endpoint else ""))
        self._queue: queue.Queue = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque = deque(maxlen=cfg.buffer_steps)
        self._digest: dict[int, bytes] = {}  # announced uid -> its chain digest
        self._seq = 0
        self.batches = 0
        self._thread = threading.Thread(target=self._run, name="peregrine-kv-events", daemon=True)
        self._thread.start()
        self._queue.put([("cleared",)])  # a new process holds nothing

    # ---- engine side ----
    def publish(self, events: list[tuple]) -> None:
        if events:
            self._queue.put(events)

    def sources(self) -> dict:
        """/kv_event_sources: this replica's publisher per data-parallel rank, as vllm-router discovers it."""
        c = self.cfg
        return {"0": {"endpoint": c.endpoint, "replay_endpoint": c.replay_endpoint, "topic": c.topic, "hwm": c.hwm,
                      "buffer_steps": c.buffer_steps, "publisher": "zmq", "encoding": "msgpack",
                      "schema_version": SCHEMA_VERSION, "enable_kv_cache_events": True}}

    def close(self, timeout: float = 2.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(0)
        self._ctx.term()

    # ---- publisher thread ----
    def encode(self, events: list[tuple]) -> list[dict]:
        """Tracker events over uids -> vLLM's event maps (block hashes computed here, off the engine thread)."""
        out = []
        for ev in events:
            if ev[0] == "stored":
                _, top, blocks = ev
                parent = self._digest[top] if top is not None else ROOT_DIGEST
                hashes, tokens = [], []
                for uid, toks in blocks:
                    parent = self._digest[uid] = block_digest(parent, toks)
                    hashes.append(external_hash(parent))
                    tokens.extend(toks)
                out.append({"type": "BlockStored", "block_hashes": hashes,
                            "parent_block_hash": external_hash(self._digest[top]) if top is not None else None,
                            "token_ids": tokens, "block_size": self.block_size, "lora_id": None, "medium": MEDIUM,
                            "lora_name": None})
            elif ev[0] == "removed":
                hashes = [external_hash(self._digest.pop(uid)) for uid in ev[1] if uid in self._digest]
                if hashes:
                    out.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM})
            else:
                self._digest.clear()
                out.append({"type": "AllBlocksCleared"})
        return out

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    log.exception("KV event replay request failed")
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            try:
                batch = self.encode(events)
                if not batch:
                    continue
                payload = self._msgpack.packb([time.time(), batch, 0], use_bin_type=True)
                seq = self._seq.to_bytes(8, "big")
                self._pub.send_multipart([self.cfg.topic.encode(), seq, payload])
                self._buffer.append((self._seq, payload))
                self._seq += 1
                self.batches += 1
            except Exception:
                log.exception("publishing a KV event batch failed")

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV event replay: a request must be [identity, b'', start seq], got %d frames", len(frames))
            return
        ident, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([ident, b"", END_SEQ, b""])
