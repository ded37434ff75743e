"""KV cache events (peregrine/kv_events.py) and readiness (server/app.py's Lifecycle).

- --kv-events-config: every mistake is one error line naming the field, before the model is built.
- What is announced: random prefix-cache histories (shared prefixes, snapshots attached and dropped, LRU
  evictions) replayed through the events give exactly the blocks that lie on a reusable prefix, recomputed here
  from the cache's own state; without KDA layers every registered block.
- The wire: a real `peregrine serve` publishing, read back with pyzmq and decoded with msgpack here; the frames,
  the batch array and each event map's keys in vLLM's documented field order (vllm/distributed/kv_events.py:
  EventBatch array_like, KVCacheEvent tagged maps); block hashes recomputed here with hashlib; the replay socket
  answers as vLLM's does; the announced chain is what a request then reuses.
- Readiness: /health and every endpoint answer 503 (vLLM's body) while the model loads and while draining; the
  in-flight request finishes; one still running after the drain timeout ends with a 503.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from peregrine import cli
from peregrine.cache import BlockAllocator
from peregrine.kv_events import BlockEvents, parse_kv_events_config
from peregrine.prefix_cache import ROOT_UID, PrefixCache

T = 60.0
zmq = pytest.importorskip("zmq", reason="the fleet extra (pyzmq) is not installed")
msgpack = pytest.importorskip("msgpack", reason="the fleet extra (msgpack) is not installed")

# vLLM's layout (vllm/distributed/kv_events.py, v0.28+): the batch an array [ts, events, data_parallel_rank];
# each event a map, the msgspec tag "type" first, then the struct's fields in declaration order, defaulted ones
# (extra_keys, group_idx, kv_cache_spec_*) left out when unset
VLLM_FIELDS = {"BlockStored": ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name"],
               "BlockRemoved": ["type", "block_hashes", "medium"],
               "AllBlocksCleared": ["type"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- configuration ----
@pytest.mark.parametrize("value,names", [
    ("{bad", "not valid JSON"),
    ("[1]", "JSON object"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:5557"}', "endpont"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps"),
    ('{"enable_kv_cache_events": true, "hwm": true}', "hwm"),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "endpoint"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": 5558}', "replay_endpoint"),
])
def test_a_bad_config_is_one_error_line_naming_the_field(no_build, capsys, value, names):
    assert cli.main(["serve", "--kv-events-config", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--kv-events-config" in err and names in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_events_need_the_prefix_cache_and_a_free_address(no_build, capsys):
    on = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:%d"}'
    assert cli.main(["serve", "--no-enable-prefix-caching", "--kv-events-config", on % free_port()]) == 2
    assert "--no-enable-prefix-caching" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["serve", "--kv-events-config", on % port]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and "'endpoint'" in err and str(port) in err, err


def test_vllm_defaults():
    assert parse_kv_events_config('{"enable_kv_cache_events": false}') is None
    assert parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    c = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert (c.publisher, c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm, c.max_queue_size, c.topic) == \
        ("zmq", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")


# ---- what is announced ----
class View:
    """A router's view of one replica, built from the events alone: announced block -> parent."""

    def __init__(self):
        self.parent: dict[int, int | None] = {}

    def apply(self, events):
        for ev in events:
            if ev[0] == "stored":
                parent = ev[1]
                assert parent is None or parent in self.parent, "stored under a parent never announced"
                for uid, _ in ev[2]:
                    assert uid not in self.parent, "announced twice"
                    self.parent[uid], parent = parent, uid
            elif ev[0] == "removed":
                for uid in ev[1]:
                    assert uid in self.parent, "removed a block never announced"
                    del self.parent[uid]
                    assert uid not in self.parent.values(), "a removed block still has announced children"


def reusable_blocks(pc: PrefixCache) -> set[int]:
    """Reference, from the cache's own state: every registered block on a prefix a prompt can reuse (an
    ancestor-or-self of a block that ends a reusable prefix, reachable from the root)."""
    by_uid = {m.uid: m for m in pc.meta.values()}
    out = set()
    ends = [pc.meta[b].uid for b in pc.snap_of] if pc.needs_state else list(by_uid)
    for uid in ends:
        chain, u = [], uid
        while u != ROOT_UID and u in by_uid:
            chain.append(u)
            u = by_uid[u].parent_uid
        if u == ROOT_UID:
            out.update(chain)
    return out


@pytest.mark.parametrize("needs_state", [True, False])
def test_announced_blocks_are_exactly_the_reusable_ones(needs_state):
    rng = random.Random(5)
    bs = 4
    pc = PrefixCache(BlockAllocator(24), bs, num_snapshots=5, needs_state=needs_state)
    ev = BlockEvents(needs_state)
    pc.listener = ev
    view = View()
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    live: list[tuple[list[int], object]] = []  # sequences still holding their blocks (and a decode snapshot)
    kinds = {"stored": 0, "removed": 0}
    for step in range(400):
        if live and rng.random() < 0.4:  # a sequence ends: its blocks become evictable
            blocks, snap = live.pop(rng.randrange(len(live)))
            if snap is not None and rng.random() < 0.5:
                pc.drop(*snap)  # a later decode snapshot replaced it
            pc.release(blocks)
        else:
            toks = rng.choice(stems)[:rng.randrange(0, 13)] + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            n = len(toks) // bs * bs
            m = pc.match(toks, n)
            need = (len(toks) + bs - 1) // bs - m.num_blocks
            if not pc.can_allocate(need, m.blocks):
                continue
            pc.acquire(m.blocks)
            blocks = m.blocks + pc.allocate(need)
            pc.register(blocks, [], toks, n, m.hashes)
            snap = None
            for k in sorted(rng.sample(range(1, n // bs + 1), min(2, n // bs))):  # snapshots at some block ends
                s = pc.new_snapshot()
                if s is not None and pc.attach(s, blocks[k - 1]):
                    snap = (s, blocks[k - 1])
            live.append((blocks, snap))
        events = ev.take()
        for e in events:
            kinds[e[0]] = kinds.get(e[0], 0) + 1
        view.apply(events)
        assert set(view.parent) == reusable_blocks(pc), f"step {step}"
    assert kinds["stored"] > 20 and kinds["removed"] > 5, kinds  # the history exercised both


# ---- the wire, from a real server ----
def digest_chain(tokens: list[int], bs: int) -> list[int]:
    """Independent: sha256(parent digest || uint32 little-endian ids), 32 zero bytes before the first block;
    each published as the digest's low 64 bits, big-endian."""
    out, parent = [], bytes(32)
    for i in range(0, len(tokens) // bs * bs, bs):
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(4, "little") for t in tokens[i:i + bs])).digest()
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


def decode_batch(frames: list[bytes], topic: bytes) -> tuple[int, list[dict]]:
    assert len(frames) == 3 and frames[0] == topic and len(frames[1]) == 8, frames[:2]
    batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
    assert isinstance(batch, list) and len(batch) == 3, batch
    ts, events, rank = batch
    assert isinstance(ts, float) and abs(ts - time.time()) < 600 and rank == 0
    for e in events:
        assert list(e) == VLLM_FIELDS[e["type"]], list(e)
        if e["type"] == "BlockStored":
            assert e["lora_id"] is None and e["lora_name"] is None and e["medium"] == "GPU"
        if e["type"] == "BlockRemoved":
            assert e["medium"] == "GPU"
    return int.from_bytes(frames[1], "big"), events


def test_wire_format_from_a_real_server():
    """peregrine-tiny (block size 64), one KDA snapshot only (the next prompt evicts it): its events read back here."""
    from conftest import start_server
    ev_port, replay_port = free_port(), free_port()
    topic = "kv@peregrine"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev_port}",
           "replay_endpoint": f"tcp://*:{replay_port}", "topic": topic, "buffer_steps": 50}
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{ev_port}")
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    proc, url = start_server(["--model", "peregrine-tiny", "--log-level", "warning", "--kv-events-config",
                              json.dumps(cfg), "--additional-config", '{"prefix_cache_snapshots": 1}'])
    try:
        info = httpx.get(url + "/get_server_info", timeout=T).json()
        bs = info["kv_block_size"]
        assert bs == 64 and info["model_id"] == "peregrine-tiny"
        src = httpx.get(url + "/kv_event_sources", timeout=T).json()
        assert src["0"]["endpoint"] == cfg["endpoint"] and src["0"]["encoding"] == "msgpack"
        rng = random.Random(3)
        a = "".join(rng.choice("abcdefgh") for _ in range(150))
        b = "".join(rng.choice("pqrstuvw") for _ in range(150))

        def complete(prompt):
            r = httpx.post(url + "/v1/completions", json={"model": "peregrine-tiny", "prompt": prompt,
                                                          "max_tokens": 2, "temperature": 0}, timeout=T)
            assert r.status_code == 200, r.text

        def hits():
            m = httpx.get(url + "/metrics", timeout=T).text
            return float(next(l.split()[-1] for l in m.splitlines() if l.startswith("peregrine:prefix_cache_hits_total")))
        complete(a)
        h0 = hits()
        complete(a[:128] + "zz")  # reuses what a's events announced
        reused_a = hits() - h0
        complete(b)  # b's snapshots evict a's: a's blocks are no longer reusable
        time.sleep(0.5)
        live = []
        while sub.poll(1000):
            live.append(decode_batch(sub.recv_multipart(), topic.encode()))
        # the replay socket gives every batch from seq 0 (AllBlocksCleared, published before anyone listened)
        req = ctx.socket(zmq.DEALER)  # vLLM's replay answers one request with many messages: a DEALER, as the router
        req.connect(f"tcp://127.0.0.1:{replay_port}")
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert req.poll(int(T * 1000)), "the replay socket did not answer"
            empty, seq_b, payload = req.recv_multipart()
            seq = int.from_bytes(seq_b, "big", signed=True)
            assert empty == b""
            if seq == -1:
                assert payload == b""
                break
            replayed.append((seq, msgpack.unpackb(payload, raw=False)[1]))
        req.close(0)
        assert [s for s, _ in replayed] == list(range(len(replayed))) and replayed[0][1] == [{"type": "AllBlocksCleared"}]
        assert live and live == replayed[-len(live):], "the live stream and the replay disagree"
        events = [e for _, evs in replayed for e in evs]
        stored = [e for e in events if e["type"] == "BlockStored"]
        removed = [e for e in events if e["type"] == "BlockRemoved"]
        a_ids, b_ids = list(a.encode()), list(b.encode())
        ha, hb = digest_chain(a_ids, bs), digest_chain(b_ids, bs)
        # a: 150 tokens, a snapshot at its last block end (128): blocks 1 and 2 stored in one BlockStored
        held: dict[int, list[int]] = {}
        for e in stored:
            assert e["block_size"] == bs and len(e["token_ids"]) == bs * len(e["block_hashes"])
            parent = e["parent_block_hash"]
            assert parent is None or parent in held
            for i, h in enumerate(e["block_hashes"]):
                toks = (held[parent] if parent is not None else []) + e["token_ids"][i * bs:(i + 1) * bs]
                assert digest_chain(toks, bs)[-1] == h, "a block hash is not the chain of its tokens"
                held[h], parent = toks, h
        assert held[ha[1]] == a_ids[:128] and held[hb[1]] == b_ids[:128]
        assert reused_a == 128, "the second request did not reuse what was announced"
        gone = [h for e in removed for h in e["block_hashes"]]
        assert sorted(gone) == sorted(ha[:2]), "a's blocks were not removed when its snapshots were evicted"
        assert gone.index(ha[1]) < gone.index(ha[0]), "removals go deepest first"
    finally:
        ctx.destroy(linger=0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(T) == 0


# ---- readiness ----
def _tiny():
    from peregrine.config import EngineConfig
    from peregrine.engine.build import build_engine
    return build_engine("peregrine-tiny", EngineConfig(max_model_len=2048), log=lambda *a, **k: None)


def test_503_while_loading_and_while_draining():
    from peregrine.server import BackgroundServer, create_app
    gate = threading.Event()

    def loader():
        assert gate.wait(T)
        eng, tok = _tiny()
        return dict(engine=eng, tokenizer=tok, served_model_name="tiny")
    app = create_app(loader=loader, drain_timeout=T)
    life = app.state.life
    with BackgroundServer(app) as s, httpx.Client(base_url=s.url, timeout=T) as c:
        for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("GET", "/metrics"),
                             ("POST", "/v1/completions"), ("POST", "/v1/completions/render")):
            r = c.request(method, path, json={"model": "tiny", "prompt": "a"} if method == "POST" else None)
            assert r.status_code == 503, (path, r.status_code)
            err = r.json()["error"]
            assert err["code"] == 503 and err["type"] == "ServiceUnavailableError" and "loading" in err["message"]
        gate.set()
        deadline = time.monotonic() + T
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline and life.phase != "failed", life.detail
            time.sleep(0.02)
        body = {"model": "tiny", "prompt": "copy:peregrine|", "max_tokens": 64, "ignore_eos": True,
                "temperature": 0, "stream": True}
        got = {}

        def stream():
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=T) as r:
                got["lines"] = [l for l in r.iter_lines() if l.startswith("data: ")]
        t = threading.Thread(target=stream)
        t.start()
        while life.inflight < 1:
            time.sleep(0.01)
        life.begin_drain()
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 1})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert c.get("/metrics").status_code == 200
        t.join(T)
        assert got["lines"][-1] == "data: [DONE]", got["lines"][-3:]
        chunks = [json.loads(l[6:]) for l in got["lines"][:-1]]
        assert all("error" not in c for c in chunks), chunks[-1]
        assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"


def test_a_request_still_running_after_the_drain_timeout_ends_with_a_503():
    from peregrine.server import BackgroundServer, create_app
    eng, tok = _tiny()
    app = create_app(eng, tok, "tiny", drain_timeout=0.2)
    life = app.state.life
    drained = threading.Event()
    life.on_drained = drained.set
    with BackgroundServer(app) as s:
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("r", httpx.post(
            s.url + "/v1/completions", json={"model": "tiny", "prompt": "copy:peregrine|", "max_tokens": 1900,
                                             "ignore_eos": True}, timeout=T)))
        t.start()
        while life.inflight < 1:
            time.sleep(0.01)
        life.begin_drain()
        t.join(T)
        assert drained.wait(T)
        r = box["r"]
        assert r.status_code == 503, r.text[:300]
        assert "--drain-timeout" in r.json()["error"]["message"]
