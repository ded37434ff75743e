"""Prefix caching (peregrine/prefix_cache.py) through the engine, with the FakeRunner.

The FakeRunner folds every token it is fed into a hash held in the KDA state slot and checks it
against the tokens read back through the MLA cache (tests/fake_runner.py): a reused block with the
wrong content, or a KDA snapshot of the wrong prefix, makes it count a mismatch and produce logits
that no longer match the cache-free reference. So "hit == miss" here means every output equals the
reference computed from the token list alone, and mismatches stay 0.
"""
from __future__ import annotations

import random

import pytest
import torch

from peregrine.cache import ModelCache
from peregrine.config import EngineConfig, resolve_model
from peregrine.engine import SamplingParams
from peregrine.engine.engine import LLMEngine
from peregrine.prefix_cache import PrefixCache
from fake_runner import FakeRunner
from test_engine import check_clean, ref_generate

CFG, _ = resolve_model("tiny-kimi-linear")
V = CFG.vocab_size
BS = 4


def make(num_blocks=96, num_slots=4, snapshots=16, hash_fn=None, **ecfg):
    cache = ModelCache(CFG, num_blocks=num_blocks, block_size=BS, num_slots=num_slots, dtype=torch.float32,
                       device="cpu", num_snapshots=snapshots)
    runner = FakeRunner(cache, V)
    ecfg.setdefault("max_model_len", 256)
    eng = LLMEngine(runner, CFG, EngineConfig(block_size=BS, **ecfg), cache)
    if hash_fn is not None:
        eng.prefix_cache.hash_fn = hash_fn
    return eng, runner, cache


def toks(n, seed):
    r = random.Random(seed)
    return [r.randrange(V) for _ in range(n)]


def run(eng, runner, prompt, max_tokens=6):
    runner.prompts = [tuple(prompt)]
    out = eng.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
    assert out == ref_generate(prompt, max_tokens, ignore_eos=True)[0]
    assert runner.mismatches == 0
    return out


def hits(eng):
    return eng.prefix_cache.stats["hit_tokens"]


def test_repeat_and_extend_reuse_and_equal_reference():
    eng, runner, cache = make(max_num_batched_tokens=8)
    a = toks(37, 1)
    run(eng, runner, a)
    assert hits(eng) == 0
    run(eng, runner, a)               # the same prompt: all but its last token may come from the cache
    assert hits(eng) == 36            # 36 = the last block end before token 36 (snapshot taken mid-chunk)
    before = hits(eng)
    run(eng, runner, a + toks(9, 2))  # turn 2: prompt + 9 new tokens; the first turn's output is not in it
    assert hits(eng) - before == 36
    before = hits(eng)
    first = run(eng, runner, a + toks(3, 3), max_tokens=12)
    b = a + toks(3, 3) + first        # prompt + answer + new: reuses up to the answer's decode snapshot
    run(eng, runner, b + toks(5, 4))
    assert hits(eng) - before >= 36 + 40
    check_clean(eng, runner, cache)


@pytest.mark.parametrize("flip", [0, 5, 17, 35])
def test_one_token_difference_reuses_only_before_it(flip):
    eng, runner, cache = make(max_num_batched_tokens=8)
    a = toks(40, 7)
    run(eng, runner, a)
    b = list(a)
    b[flip] = (b[flip] + 1) % V
    before = hits(eng)
    run(eng, runner, b)
    assert hits(eng) - before <= flip // BS * BS  # nothing at or past the changed block
    check_clean(eng, runner, cache)


def test_hash_collisions_never_reuse_wrong_blocks():
    eng, runner, cache = make(snapshots=32, max_num_batched_tokens=8, hash_fn=lambda parent, tokens: 0)  # all collide
    prompts = [toks(30, s) for s in range(4)]
    for p in prompts:
        run(eng, runner, p)
    for p in prompts:  # each still finds its own blocks among the colliding candidates
        before = hits(eng)
        run(eng, runner, p)
        assert hits(eng) - before >= 24
    check_clean(eng, runner, cache)


def test_eviction_under_pressure_then_reuse_is_still_right():
    eng, runner, cache = make(num_blocks=24, num_slots=2, snapshots=3, max_num_batched_tokens=8, max_model_len=64)
    first = toks(33, 11)
    run(eng, runner, first)
    for s in range(12, 20):  # distinct prompts that need the blocks (and snapshots) back
        run(eng, runner, toks(33, s))
    pc = eng.prefix_cache
    assert pc.stats["evicted_blocks"] > 0 and pc.stats["evicted_snapshots"] > 0
    run(eng, runner, first)  # its blocks are gone or partly reused: recomputed, still equal
    run(eng, runner, first)  # and cached again now
    check_clean(eng, runner, cache)


def test_concurrent_requests_share_a_prefix_and_all_complete():
    eng, runner, cache = make(max_num_batched_tokens=16, max_num_seqs=4)
    common = toks(24, 21)
    run(eng, runner, common + toks(4, 22))
    ps = [common + toks(4 + i, 30 + i) for i in range(4)]
    runner.prompts = [tuple(p) for p in ps]
    outs = eng.generate(ps, SamplingParams(max_tokens=5, ignore_eos=True))
    for p, o in zip(ps, outs):
        assert o == ref_generate(p, 5, ignore_eos=True)[0]
    assert runner.mismatches == 0 and hits(eng) >= 4 * 24
    check_clean(eng, runner, cache)


def test_disabled_never_reuses():
    eng, runner, cache = make(enable_prefix_caching=False)
    a = toks(30, 5)
    run(eng, runner, a)
    run(eng, runner, a)
    assert hits(eng) == 0 and not eng.prefix_cache.meta
    check_clean(eng, runner, cache)


def test_match_needs_a_snapshot_and_verifies_chain():
    from peregrine.cache import BlockAllocator
    pc = PrefixCache(BlockAllocator(8), 2, num_snapshots=2, needs_state=True)
    blocks = pc.allocate(3)
    t = [1, 2, 3, 4, 5, 6]
    hashes = []
    pc.register(blocks, hashes, t, 6)
    assert pc.match(t + [7], 6).num_blocks == 0  # no snapshot yet: KDA state unknown
    s = pc.new_snapshot()
    assert pc.attach(s, blocks[1])
    m = pc.match(t + [7], 6)
    assert m.blocks == blocks[:2] and m.snapshot == s
    assert pc.match([1, 2, 9, 4, 5, 6, 7], 6).num_blocks == 0  # block 1 differs: the snapshot after it is not ours
    pc.release(blocks)
    assert pc.num_free == 8
    fresh = pc.allocate(8)  # evicts every cached block; their snapshot goes with them
    assert pc.match(t + [7], 6).num_blocks == 0 and pc.stats["evicted_blocks"] == 3
    pc.release(fresh)


def test_decode_never_starved_while_a_long_prompt_prefills():
    """A running request gets a token every step while a 2000-token prompt prefills in chunks no larger
    than max_prefill_tokens_while_decoding; once nobody decodes, the prompt takes the larger budget."""
    eng, runner, cache = make(num_blocks=600, max_model_len=2100, max_num_batched_tokens=512,
                              max_prefill_tokens_while_decoding=64)
    short = toks(5, 40)
    long = toks(2000, 41)
    runner.prompts = [tuple(short), tuple(long)]
    got = {"a": 0}

    def count(o):
        got["a"] += len(o.new_token_ids)

    eng.add_request(short, SamplingParams(max_tokens=20, ignore_eos=True), "a", count)
    eng.step()
    eng.add_request(long, SamplingParams(max_tokens=2, ignore_eos=True), "b")
    steps = []
    while eng.has_unfinished():
        n0 = got["a"]
        a_decoding = any(s.request_id == "a" and not s.in_prefill for s in eng.scheduler.running)
        eng.step()
        steps.append((eng.last_step.num_prefill_tokens, got["a"] - n0, a_decoding))
    during = [(p, d) for p, d, _ in steps if p > 0]
    while_decoding = [(p, d) for p, d, a in steps if p > 0 and a]
    assert len(while_decoding) == 19 and all(p <= 64 and d == 1 for p, d in while_decoding)  # a token every step
    assert max(p for p, _ in during) == 512  # the rest in big chunks after "a" finished
    assert sum(p for p, _ in during) == 2000
    assert runner.mismatches == 0
    check_clean(eng, runner, cache)


def test_a_stale_decode_snapshot_never_frees_a_slot_someone_else_holds():
    """A sequence's decode-time snapshot can be evicted by the LRU and handed to another prefix; when
    that sequence later replaces "its" snapshot, the slot (now someone else's) must stay theirs."""
    from peregrine.cache import BlockAllocator
    pc = PrefixCache(BlockAllocator(8), 2, num_snapshots=1, needs_state=True)
    blocks = pc.allocate(4)
    toks = list(range(8))
    pc.register(blocks, [], toks, 8)
    s = pc.new_snapshot()
    assert pc.attach(s, blocks[0])           # sequence A's decode snapshot, at block 0's end
    mine = (s, blocks[0])
    other = pc.new_snapshot()                # the pool is full: A's snapshot is evicted and reused
    assert other == s and pc.match(toks, 7).num_blocks == 0
    pc.drop(*mine)                           # A replaces its (stale) decode snapshot
    assert pc.attach(other, blocks[2])       # the new owner keeps the slot
    assert pc.snap_of[blocks[2]] == other and other not in pc.free_snaps


def test_a_cold_prompt_is_hashed_once_and_only_its_first_block_before_its_forward():
    """Admission looks up a cold prompt's blocks only until the first miss (one hash before its first
    forward, not one per block), registration then hashes each further block once, and a repeat's
    lookup walks the whole chain: the reuse is the same as with the full chain hashed up front."""
    from peregrine.prefix_cache import chain_hash
    calls = []

    def counting(parent, tokens):
        calls.append(tokens)
        return chain_hash(parent, tokens)
    eng, runner, cache = make(max_num_batched_tokens=64, hash_fn=counting)
    a = toks(41, 11)  # 10 full blocks before the last prompt token (always computed)
    seen = []
    real_forward = runner.forward

    def forward(step):
        seen.append(len(calls))
        return real_forward(step)
    runner.forward = forward
    run(eng, runner, a, max_tokens=1)
    assert seen[0] == 1  # the first block's lookup missed: nothing else hashed before the forward
    assert sorted(calls) == sorted(tuple(a[i:i + BS]) for i in range(0, 40, BS))  # each full block once
    calls.clear()
    run(eng, runner, a, max_tokens=1)
    assert hits(eng) == 40 and len(calls) == 10  # the repeat: its 10 lookups hit, each block hashed once
    check_clean(eng, runner, cache)


def test_prompts_finishing_beside_each_other_with_the_snapshot_pool_spent():
    """More prompts end in one step than the snapshot pool can serve: those without a planned snapshot go on without
    one (a prompt row is never taken for a decode row passing a block end)."""
    eng, runner, cache = make(snapshots=1, max_num_batched_tokens=64, max_num_seqs=4)
    ps = [toks(10, 50 + i) for i in range(3)]
    runner.prompts = [tuple(p) for p in ps]
    outs = eng.generate(ps, SamplingParams(max_tokens=3, ignore_eos=True))
    assert outs == [ref_generate(p, 3, ignore_eos=True)[0] for p in ps]
    check_clean(eng, runner, cache)
