"""Suffix decoding (peregrine/speculative/suffix.py): the tries against counts taken by brute force here, the drafts'
rules (depth, match-scaled length, probability floor, the global trie and its cap), and the engine exact."""
import math
import random
from types import SimpleNamespace

import pytest

from peregrine.config import ConfigError
from peregrine.speculative.config import SpeculativeConfig
from peregrine.speculative.suffix import SuffixDrafter, SuffixTrie, follow
from test_spec import greedy, tiny


def continuations(seqs, ctx):
    """Brute force: how often each token followed `ctx` across the sequences."""
    out = {}
    for s in seqs:
        for i in range(len(s) - len(ctx)):
            if s[i:i + len(ctx)] == ctx:
                t = s[i + len(ctx)]
                out[t] = out.get(t, 0) + 1
    return out


def node_of(trie, ctx):
    node = trie.root
    for t in ctx:
        node = trie.child(node, t)
    return node


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_trie_counts_equal_brute_force_and_uncount_cleanly(depth):
    rng = random.Random(depth)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(5, 40))] for _ in range(4)]
    trie = SuffixTrie(depth)
    for s in seqs:
        trie.add(s)
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, depth):  # contexts shorter than the depth have their continuations counted
                ctx = s[i:i + n]
                if len(ctx) < n:
                    continue
                want = continuations(seqs, ctx)
                got = trie.counts(node_of(trie, ctx))
                assert got == want, (ctx, got, want)
    size = len(trie.count)
    for s in seqs:
        trie.add(s, sign=-1)
    assert trie.counts(trie.root) == {} and trie.live == 1  # every node back on the free list
    for s in seqs:  # and reused: counting the same again takes no new nodes
        trie.add(s)
    assert len(trie.count) == size


def test_trie_nodes_are_not_tracked_by_the_garbage_collector():
    """A trie node per context and token (~24 a token at depth 24): as objects, a 30K-token request's trie put
    ~700K objects under the cyclic collector, whose full passes then paused decode steps for 0.2-0.3 s."""
    import gc
    rng = random.Random(0)
    gc.collect()
    before = len(gc.get_objects())
    trie = SuffixTrie(24)
    trie.add([rng.randrange(50) for _ in range(2000)])
    assert trie.live > 10_000
    assert len(gc.get_objects()) - before < 100  # the trie's few lists (as objects: one per node, 10K+)


def test_follow_stops_at_the_probability_floor_and_the_limit():
    trie = SuffixTrie(8)
    for s in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6], [1, 7]):
        trie.add(s)
    node = node_of(trie, [1])  # after 1: 2 (3 times), 7 (once)
    toks, surv = follow(trie, node, 10, 0.1)
    assert toks == [2, 3, 4] and surv == pytest.approx([0.75, 0.5, 0.5])  # 2: 3/4; 3 after 1 2: 2/3 -> 0.5
    assert follow(trie, node, 10, 0.6) == ([2], [0.75])
    assert follow(trie, node, 1, 0.0)[0] == [2]


def seq(tokens, prompt_len=None):
    return SimpleNamespace(token_ids=list(tokens), prompt_len=len(tokens) if prompt_len is None else prompt_len)


def test_drafts_copy_from_the_request_and_scale_with_the_match():
    d = SuffixDrafter(max_tree_depth=24, max_cached_requests=10, max_spec_factor=1.0, min_token_prob=0.1)
    text = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    s = seq(text + [1, 2] + text[:3])  # the context ends on 5 6 7, seen before followed by 8 9 10 ...
    (draft,) = d.propose([s], [15])
    assert draft == [8, 9, 10]  # 3 matched tokens, factor 1: 3 drafts
    assert d.survival[id(s)] == [1.0, 1.0, 1.0]
    d2 = SuffixDrafter(24, 10, 2.0, 0.1)
    assert d2.propose([s], [15])[0] == [8, 9, 10, 11, 12, 13]  # factor 2
    assert d2.propose([seq(s.token_ids)], [4])[0] == [8, 9, 10, 11]  # k caps it
    assert d.propose([seq([1, 2, 3])], [5])[0] == []  # nothing seen before


def test_a_long_copy_drafts_k_tokens_from_a_shorter_match_than_the_trie_depth():
    """Once a copy runs past the depth, the longest match (m = depth) has one token left below it in the trie; a
    shorter match continues k tokens, and the candidate with the most expected tokens is the draft. (The
    longest-match-only rule drafted 1 token a step here: 1.98 accepted a verify on the replay sessions' text.)"""
    depth, k = 8, 4  # a trie of depth 8 drafts at most 4 (m = 4, 4 tokens below it)
    d = SuffixDrafter(max_tree_depth=depth, max_cached_requests=10, max_spec_factor=1.0, min_token_prob=0.1)
    text = list(range(100, 140))
    s = seq(text + [1] + text[:20])  # copying text: the last 20 tokens were seen before, followed by 120..
    assert d.propose([s], [k])[0] == list(range(120, 120 + k))
    assert d.survival[id(s)] == [1.0] * k
    r = d.requests[id(s)]
    longest, m = r.match()
    assert m == depth - 1 and follow(r.trie, longest, k, 0.1)[0] == [120]  # the longest match alone: one draft


def test_the_global_trie_serves_a_repeated_request_and_keeps_its_cap():
    d = SuffixDrafter(max_tree_depth=8, max_cached_requests=2, max_spec_factor=4.0, min_token_prob=0.1)
    prompt = [3, 1, 4, 1, 5]
    first = seq(prompt + [9, 2, 6, 5, 3, 5], prompt_len=5)
    d.propose([first], [4])
    d.release(first)  # its output 9 2 6 5 3 5 joins the global trie
    again = seq(prompt + [9, 2], prompt_len=5)
    assert d.propose([again], [4])[0] == [6, 5, 3, 5]
    for n in range(2):  # two more finished requests push the first out (cap 2)
        r = seq([40 + n, 41 + n, 42 + n], prompt_len=0)
        d.propose([r], [2])
        d.release(r)
    assert len(d.cached) == 2
    assert d.propose([seq(prompt + [9, 2], prompt_len=5)], [4])[0] == []


def test_config_keys_defaults_and_errors():
    c = SpeculativeConfig.parse({"method": "suffix"})
    assert (c.k, c.suffix_decoding_max_tree_depth, c.suffix_decoding_max_cached_requests,
            c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob) == (15, 24, 10000, 1.0, 0.1)
    assert SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_max_tree_depth": 6}).k == 6
    for bad, match in (({"suffix_decoding_min_token_prob": 1.5}, "min_token_prob"),
                       ({"suffix_decoding_max_spec_factor": 0}, "max_spec_factor"),
                       ({"suffix_decoding_max_tree_depth": 0}, "max_tree_depth")):
        with pytest.raises(ConfigError, match=match):
            SpeculativeConfig.parse({"method": "suffix", **bad})


def test_suffix_in_the_engine_exact_and_accepting_a_repeated_request():
    """Greedy output equals plain; the same prompt a second time is drafted from the first answer (the global
    trie) and accepts most of it; the width chooser reads the drafter's own path probabilities."""
    ps = [[7, 3, 9, 1, 4, 4, 2, 8, 5, 6, 0, 3]]
    want = tiny().generate(ps, greedy(24))
    e = tiny({"method": "suffix", "num_speculative_tokens": 7, "suffix_decoding_max_spec_factor": 4.0})
    assert e.generate(ps, greedy(24)) == want
    before = dict(e.spec.stats)
    assert e.generate(ps, greedy(24)) == want
    st = e.spec.stats
    accepted = st["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert accepted >= 15, st  # most of the 24 tokens came from drafts the second time
    s = SimpleNamespace(token_ids=[1])
    e.spec.drafter.survival[id(s)] = [0.9, 0.4]
    assert e.spec._survival(s, [5, 6]) == [0.9, 0.4]


# ---- replay (#43 item 4) ----
def test_forced_replies_are_emitted_and_verified_against():
    """engine.forced: the request emits the recorded tokens whatever the model says (plain steps and verify
    steps alike); a drafter proposing that recording with its j-th token wrong gets exactly min(j, k) accepted."""
    from spec_helpers import ScriptedDrafter
    prompt = [5, 9, 2, 7, 7, 1]
    forced = [(3 * i + 1) % 250 for i in range(20)]
    e = tiny()
    e.forced["r"] = forced
    got = []
    e.add_request(prompt, greedy(len(forced)), request_id="r", on_token=lambda o: o.finished and got.append(o.output_token_ids))
    while e.has_unfinished():
        e.step()
    assert got == [forced]
    s = tiny({"method": "ngram", "num_speculative_tokens": 3})
    dr = ScriptedDrafter({tuple(prompt): forced}, [2, 0, 3], 320)
    s.enable_speculation({"method": "ngram", "num_speculative_tokens": 3}, drafter=dr)
    s.forced["r"] = forced
    got = []
    s.add_request(prompt, greedy(len(forced)), request_id="r", on_token=lambda o: o.finished and got.append(o.output_token_ids))
    while s.has_unfinished():
        s.step()
    assert got == [forced] and s.spec.stats["num_accepted_tokens"] == dr.expected > 0


def test_replay_sessions_measure_drafters_on_copied_text():
    """Agent-shaped sessions from this package's source: the reply quotes the context, so suffix decoding
    and n-gram lookup are accepted on it with the model's noise replaced by the recording."""
    from peregrine.speculative.replay import agent_sessions, replay
    two = agent_sessions(1, 2, seed=1, max_chars=3000)
    assert len(two[0]) == 2 and two[0][1][0].startswith(two[0][0][0])  # the context grows turn by turn
    for ctx, reply in two[0]:
        first = reply.split("```python\n")[1].split("\n")[0].strip()  # the quoted function's def line, renamed
        assert "```python" in reply and first.replace("_v2", "") in ctx.replace("_v2", "")
    sess = agent_sessions(1, 1, seed=2, max_chars=1200)  # one short turn through the engine (the interpreter's cost)
    e = tiny(max_model_len=2048)
    enc = lambda t: [b % 250 for b in t.encode()]  # noqa: E731  (the tiny vocabulary)
    plain = replay(e, sess, enc, "plain", log=lambda m: None)
    e.enable_speculation({"method": "suffix", "num_speculative_tokens": 5})
    suf = replay(e, sess, enc, "suffix", log=lambda m: None)
    assert plain["drafts"] == 0 and suf["drafts"] > 0 and suf["acceptance_length"] > 2.0, suf
    assert [t["output_tokens"] for t in suf["turns"]] == [t["output_tokens"] for t in plain["turns"]]
    # without a cost table (CPU) the width chooser never runs: every draft is verified, no step counted by width
    assert plain["turns"][0]["width_steps"] == [] and suf["turns"][0]["width_steps"] == [0] * 6
    # with one, the turn records the widths it chose: plain steps where verifying costs far more, never plain where
    # it is free (each step then verifies as far as a draft's survival is worth 2 %: suffix drafts vary in length)
    e.spec.observe = lambda *a: None  # the table as given: CPU steps' wall times would move it (decoder.observe)
    e.spec.costs = {1: {1: 1.0, **{T: 100.0 for T in range(2, 7)}}}
    cheap = replay(e, sess, enc, "suffix", log=lambda m: None)["turns"][0]
    assert cheap["drafts"] == 0 and cheap["width_steps"][0] > 0 and sum(cheap["width_steps"][1:]) == 0, cheap
    e.spec.costs = {1: {T: 1.0 for T in range(1, 7)}}
    free = replay(e, sess, enc, "suffix", log=lambda m: None)["turns"][0]
    assert free["drafts"] > 0 and free["width_steps"][0] == 0 and sum(free["width_steps"][2:]) > 0, free


def test_replay_tokens_are_pieces_where_the_model_has_only_the_byte_stand_in():
    """A dummy-weights folder without its tokenizer gets the byte-level stand-in, 3-4x finer than a real BPE on
    code: the replay tokenises by pre-tokenised pieces instead (they concatenate back to the text; the same piece
    is the same id; ids clear of bytes and of the vocabulary's top), and keeps a real tokenizer where there is one."""
    from peregrine.speculative.replay import FIRST_PIECE_ID, PIECE, PieceTokenizer, agent_sessions, replay_encoder
    from peregrine.tokenizer import ByteTokenizer
    ctx, reply = agent_sessions(1, 2, seed=3, max_chars=20000)[0][1]
    assert "".join(PIECE.findall(ctx)) == ctx and "".join(PIECE.findall(reply)) == reply
    enc = replay_encoder(ByteTokenizer(163840), 163840)
    assert isinstance(enc, PieceTokenizer)
    ids = enc.encode(ctx)
    assert len(ctx) / len(ids) > 2.5  # bytes would be 1.0
    assert min(ids) >= FIRST_PIECE_ID and max(ids) < 163840 // 2
    again = enc.encode(ctx + reply)
    assert again[:len(ids)] == ids or again[:len(ids) - 1] == ids[:-1]  # a piece may extend across the join
    assert enc.encode(" def") == enc.encode(" def") and len(enc.encode("def foo(x):")) == 5
    tiny = ByteTokenizer(320)
    assert replay_encoder(tiny, 320) is tiny
    with pytest.raises(ValueError, match="distinct pieces"):
        PieceTokenizer(FIRST_PIECE_ID * 2 + 4).encode(" ".join(f"w{i:x}" for i in range(100)).replace("0", "q"))


def _same_trie(ta, tb, a=0, b=0) -> bool:
    """Two tries count the same contexts the same number of times (structure and counts), from nodes a and b."""
    ka, kb = ta.kids[a] or {}, tb.kids[b] or {}
    if ta.count[a] != tb.count[b] or set(ka) != set(kb):
        return False
    return all(_same_trie(ta, tb, ka[t], kb[t]) for t in ka)


def test_a_truncated_request_trie_equals_one_built_on_the_prefix():
    from peregrine.speculative.suffix import _Request
    rng = random.Random(11)
    for depth in (1, 3, 8):
        toks = [rng.randrange(5) for _ in range(120)]
        for n in (119, 100, 60, 1, 0):
            r = _Request(depth)
            r.update(toks)
            r.truncate(n)
            fresh = _Request(depth)
            fresh.update(toks[:n])
            assert r.tokens == toks[:n] and _same_trie(r.trie, fresh.trie), (depth, n)
            assert ([(m, r.trie.count[nd]) for nd, m in r.matches()]
                    == [(m, fresh.trie.count[nd]) for nd, m in fresh.matches()])
            r.update(toks)  # and it counts on from there as if never cut
            full = _Request(depth)
            full.update(toks)
            assert _same_trie(r.trie, full.trie)


def test_an_agents_next_turn_starts_from_the_last_turns_trie(monkeypatch):
    """A finished request's trie is kept; a request whose prompt starts with its tokens takes it over (a differing
    tail of up to REUSE_SLACK tokens is uncounted first) and counts only what is new: the trie equals one built
    on the whole prompt. Another prompt starts empty; kept tries are held to their token budget."""
    import peregrine.speculative.suffix as sx
    rng = random.Random(12)
    d = SuffixDrafter(max_tree_depth=6, max_cached_requests=10, max_spec_factor=1.0, min_token_prob=0.1)
    turn1 = seq([rng.randrange(9) for _ in range(300)], prompt_len=250)
    d.propose([turn1], [3])
    turn1.token_ids += [rng.randrange(9) for _ in range(5)]  # tokens emitted after its last propose
    d.release(turn1)
    assert len(d.kept) == 1 and d.reused == 0
    for tail in (0, 3):  # the next turn resends it (its last `tail` tokens re-rendered) and adds its own
        prev = list(turn1.token_ids)
        nxt = seq(prev[:len(prev) - tail] + [100 + i for i in range(tail)] + [rng.randrange(9) for _ in range(40)],
                  prompt_len=len(prev) + 40)
        d.propose([nxt], [3])
        r = d.requests[id(nxt)]
        fresh = sx._Request(6)
        fresh.update(nxt.token_ids)
        assert d.reused == 1 + (tail > 0) and _same_trie(r.trie, fresh.trie) and r.tokens == nxt.token_ids
        d.release(nxt)
        turn1 = nxt
    other = seq([50 + rng.randrange(9) for _ in range(30)], prompt_len=30)
    d.propose([other], [3])
    assert d.reused == 2 and d.requests[id(other)].seen == 30 and len(d.kept) == 1
    d.kept_budget = 100
    d.release(other)  # the long one is dropped for the budget, the 30-token one kept
    assert [k.seen for k in d.kept.values()] == [30]


def test_kept_tries_scale_with_the_requests_the_engine_runs_at_once():
    """c agents taking turns: each one's last turn must still be kept when its next turn comes, so the budget is per
    concurrent request (and the engine passes its max_num_seqs)."""
    import peregrine.speculative.suffix as sx
    assert SuffixDrafter(24, 10, 1.0, 0.1).kept_budget == sx.KEPT_MAX_TOKENS
    assert SuffixDrafter(24, 10, 1.0, 0.1, max_num_seqs=8).kept_budget == 8 * sx.KEPT_TOKENS_PER_SEQ
    e = tiny({"method": "suffix", "num_speculative_tokens": 4})
    assert e.spec.drafter.kept_budget == max(sx.KEPT_MAX_TOKENS, e.engine_cfg.max_num_seqs * sx.KEPT_TOKENS_PER_SEQ)
    d = SuffixDrafter(6, 10, 1.0, 0.1, max_num_seqs=4)
    d.kept_budget = 440  # four agents' contexts of 100-103 tokens: all four kept, none evicted by the others
    rng = random.Random(2)
    agents = [seq([a * 10 + rng.randrange(9) for _ in range(100)], prompt_len=100) for a in range(4)]
    for s in agents:
        d.propose([s], [3])
        d.release(s)
    for s in agents:  # each agent's next turn resends its context plus a little
        nxt = seq(s.token_ids + [1, 2, 3], prompt_len=103)
        before = d.reused
        d.propose([nxt], [3])
        assert d.reused == before + 1
        d.release(nxt)


def test_bench_replay_end_to_end_on_a_large_vocabulary_dummy_model(tmp_path):
    """bench spec --replay-sessions as the GPU call runs it, on a narrow model of an 8K vocabulary with dummy weights
    and no tokenizer (the 48B's situation): tokens are pieces, plain then suffix on the same engine, per-turn
    speedups against the same turn's plain run, widths and the (CPU: empty) cost table, one JSON written."""
    import json as _json

    from conftest import write_dummy_model
    from peregrine.config import PRESET_DIR
    from peregrine.bench.spec import bench_replay
    from test_specialized import MICRO
    (tmp_path / "m").mkdir()
    raw = _json.loads((PRESET_DIR / "tiny-kimi-linear.json").read_text()) | MICRO | {"vocab_size": 8192}
    model = write_dummy_model(tmp_path / "m", raw, seed=None)
    r = bench_replay(model, ("suffix",), k=3, sessions=1, turns=2, context_chars=2400, backend="standard",
                     dummy_weights=True, results_dir=str(tmp_path / "res"), log=lambda m: None)
    assert r["config"]["tokens"] == "pieces" and [x["label"] for x in r["runs"]] == ["plain", "suffix"]
    plain, suf = r["runs"]
    assert suf["cost_table_ms"] == {} and suf["drafts"] > 0 and suf["acceptance_length"] > 1.5
    for t, p in zip(suf["turns"], plain["turns"]):
        assert t["output_tokens"] == p["output_tokens"] and t["speedup_vs_plain"] == pytest.approx(
            t["tok_s_user"] / p["tok_s_user"]) and len(t["width_steps"]) == 4
    assert suf["turns"][1]["input_tokens"] > suf["turns"][0]["input_tokens"] + suf["turns"][0]["output_tokens"]
    saved = _json.loads(open(r["paths"]["json"]).read())
    assert saved["runs"][1]["speedup_vs_plain"] == pytest.approx(suf["speedup_vs_plain"])
    # sampled requests (the server's default): their own verify path runs, the recorded tokens still win, so the
    # drafter sees the same text and accepts the same
    s = bench_replay(model, ("suffix",), k=3, sessions=1, turns=2, context_chars=2400, backend="standard",
                     dummy_weights=True, results_dir=None, log=lambda m: None, temperature=1.0, top_p=0.9)
    assert s["config"]["temperature"] == 1.0 and s["runs"][1]["acceptance_length"] == suf["acceptance_length"]
    assert [t["output_tokens"] for t in s["runs"][1]["turns"]] == [t["output_tokens"] for t in suf["turns"]]


def test_the_global_trie_is_held_to_its_token_budget(monkeypatch):
    import peregrine.speculative.suffix as sx
    monkeypatch.setattr(sx, "GLOBAL_MAX_TOKENS", 10)
    d = SuffixDrafter(max_tree_depth=4, max_cached_requests=100, max_spec_factor=1.0, min_token_prob=0.1)
    for n in range(4):  # 4 outputs of 4 tokens: only the last two fit in 10
        r = seq([1] + [10 * n + j for j in range(4)], prompt_len=1)
        d.propose([r], [2])
        d.release(r)
    assert d.cached_tokens == 8 and len(d.cached) == 2
    counted = set(d.glob.counts(d.glob.root))
    assert counted == {20, 21, 22, 23, 30, 31, 32, 33}  # the first two outputs were uncounted on eviction


def test_request_match_reads_its_active_nodes_as_a_walk_would():
    """_Request.match(es) (the nodes its updates hold) equal SuffixTrie's walks from the root, on random text."""
    from peregrine.speculative.suffix import _Request
    rng = random.Random(5)
    for depth in (1, 4, 24):
        r = _Request(depth)
        toks = []
        for _ in range(300):
            toks.append(rng.randrange(6))
            r.update(toks)
            assert r.match() == r.trie.match(toks) and r.matches() == r.trie.matches(toks)


def test_the_drafted_candidate_is_the_best_of_every_match_length():
    """The drafter follows matches longest first and skips those whose cap cannot win; the draft must still be the
    candidate a plain walk over every match length picks: the most expected tokens, ties to the longer match."""
    rng = random.Random(5)
    for trial in range(30):
        d = SuffixDrafter(max_tree_depth=rng.choice([4, 8, 24]), max_cached_requests=10,
                          max_spec_factor=rng.choice([0.5, 1.0, 2.0]), min_token_prob=rng.choice([0.0, 0.1, 0.3]))
        toks = [rng.randrange(6) for _ in range(rng.randrange(20, 300))]
        k = rng.randrange(1, 9)
        s = seq(toks)
        (got,) = d.propose([s], [k])
        r = d.requests[id(s)]
        want, best = [], -1.0
        for node, m in r.matches():  # shortest first, >=: the last of the best is the longest
            toks_m, surv = follow(r.trie, node, min(k, math.ceil(d.factor * m)), d.min_prob)
            if toks_m and sum(surv) >= best:
                want, best = toks_m, sum(surv)
        assert got == want, (trial, got, want)


def test_a_request_trie_is_counted_while_its_prefill_runs():
    """The engine hands requests in prefill to the drafter right after launching the step: the trie over the prompt
    exists before the first decode step, whose propose then counts only the new tokens."""
    e = tiny({"method": "suffix", "num_speculative_tokens": 4})
    prompt = [(7 * i) % 50 for i in range(120)]
    e.add_request(prompt, greedy(8))
    e.step()  # the prefill
    (seq,) = e.scheduler.running
    r = e.spec.drafter.requests[id(seq)]
    assert r.tokens == prompt
    while e.has_unfinished():
        e.step()
    assert not e.spec.drafter.requests


def test_replay_excess_over_the_cost_table():
    """The replay's excess: decode wall time less each step's table time, per step (plain: tokens after the first;
    speculative: the chooser's steps by width)."""
    from peregrine.bench.spec import _excess_per_step
    table = {1: 2.0, 2: 3.0, 3: 4.0}
    plain = {"turns": [{"output_tokens": 11, "decode_s": 0.025, "width_steps": []},
                       {"output_tokens": 6, "decode_s": 0.0125, "width_steps": []}]}
    assert _excess_per_step(plain, table) == pytest.approx((37.5 - 15 * 2.0) / 15)
    spec = {"turns": [{"output_tokens": 20, "decode_s": 0.030, "width_steps": [2, 0, 4]}]}
    assert _excess_per_step(spec, table) == pytest.approx((30.0 - 2 * 2.0 - 4 * 4.0) / 6)
    assert _excess_per_step(spec, None) is None
    assert _excess_per_step({"turns": [{"output_tokens": 5, "decode_s": 0.01, "width_steps": [0, 0, 0]}]}, table) is None
