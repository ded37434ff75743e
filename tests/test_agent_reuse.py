"""Prefix reuse under agent traffic (issue #65 item 1): forks, concurrent sessions sharing a system prompt, turns
that re-send the whole conversation; the engine's hits against what a perfect cache would reuse
(peregrine/bench/reuse.py), with the FakeRunner (every reused block and snapshot checked against the tokens)."""
from __future__ import annotations

import random

import pytest

from peregrine.bench.reuse import theoretical_hits
from peregrine.engine import SamplingParams
from peregrine.speculative.config import SpeculativeConfig
from test_engine import check_clean
from test_prefix_cache import BS, V, hits, make, run, toks


def agent_sessions(n: int, turns: int, system: int, seed: int = 0, new=(20, 40), reply=(6, 14)):
    """n sessions opening on one system prompt of `system` tokens; each turn's prompt is the last turn's prompt +
    its reply + new tokens (a file, a tool's output) -> per session, per turn (prompt, reply). A reply quotes the
    turn's new tokens (as an agent's edit quotes the file it was shown), so drafters that look up the context
    (n-gram, suffix) get most of it accepted."""
    r = random.Random(seed)
    sys_prompt = [r.randrange(V) for _ in range(system)]
    out = []
    for _ in range(n):
        rows, ctx = [], list(sys_prompt)
        for _ in range(turns):
            fresh = [r.randrange(V) for _ in range(r.randint(*new))]
            ctx = ctx + fresh
            at, m = r.randrange(len(fresh) // 2), r.randint(*reply)
            rep = (fresh[at:] * (m // max(1, len(fresh) - at) + 1))[:m]
            rows.append((ctx, rep))
            ctx = ctx + rep
        out.append(rows)
    return out


def drive(eng, runner, sessions, concurrency: int | None = None) -> list[tuple[list[int], list[int]]]:
    """Every session a loop of its turns (the next sent when the last ended, each reply forced), at most
    `concurrency` sessions at once -> the requests in the order they were sent."""
    sent, nxt = [], {}
    queue = list(range(len(sessions)))
    runner.prompts = [tuple(p) for rows in sessions for p, _ in rows]

    def submit(i):
        t = nxt.setdefault(i, 0)
        prompt, reply = sessions[i][t]
        sent.append((prompt, reply))
        eng.add_request(prompt, SamplingParams(max_tokens=len(reply), ignore_eos=True), f"s{i}t{t}",
                        on_token=lambda o, i=i: done(o, i), forced=reply)

    def done(out, i):
        if not out.finished:
            return
        assert out.finish_reason == "length" and out.output_token_ids == sessions[i][nxt[i]][1]
        nxt[i] += 1
        if nxt[i] < len(sessions[i]):
            submit(i)
        elif queue:
            submit(queue.pop(0))

    for _ in range(concurrency or len(sessions)):
        submit(queue.pop(0))
    while eng.has_unfinished():
        eng.step()
    assert len(sent) == sum(map(len, sessions))
    return sent


def test_common_prefix_and_the_perfect_cache_against_loops():
    from peregrine.prefix_cache import common_prefix

    def loop(a, b, limit):
        n = 0
        while n < min(limit, len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    r = random.Random(4)
    for _ in range(300):
        a = [r.randrange(3) for _ in range(r.randrange(12))]
        b = a[:r.randrange(len(a) + 1)] + [r.randrange(3) for _ in range(r.randrange(5))]
        limit = r.randrange(14)
        assert common_prefix(a, b, limit) == loop(a, b, limit)
    reqs = [([1, 2, 3, 4, 5, 6, 7], [8, 9]), ([1, 2, 3, 4, 5, 6, 7, 8, 9, 1], [2]), ([1, 2, 3, 9, 9], [1]), ([1, 2], [3])]
    # 0: nothing before it; 1: request 0's prompt + reply but its last token (8): 8 -> 2 blocks of 3 = 6;
    # 2: 3 tokens shared, but its last prompt token is computed (limit 4): 3; 3: 1 (limit) -> 0 blocks
    assert theoretical_hits(reqs, 3) == [0, 6, 3, 0]


def test_a_fork_without_a_snapshot_is_reused_after_its_first_recompute():
    """S + A, then S + B (S shared, the fork inside a block run whose only snapshot is at S + A's end): S + B
    recomputes, but takes a snapshot where it parts from S + A and keeps its chain through S + A's blocks, so
    S + B again, S + B + C and S + D reuse; the chunk covers each prompt whole (no chunk-end snapshots)."""
    eng, runner, cache = make(snapshots=32, max_num_batched_tokens=128)
    S, A, B, C, D = toks(30, 1), toks(10, 2), toks(10, 3), toks(7, 4), toks(9, 5)
    got = []
    for p in (S + A, S + B, S + B, S + B + C, S + D):
        before = hits(eng)
        run(eng, runner, p)
        got.append(hits(eng) - before)
    fork = 30 // BS * BS
    assert got[0] == 0 and got[1] == 0  # nothing cached; then no snapshot inside S
    assert got[2] == (40 - 1) // BS * BS  # S + B whole, but for its last token
    assert got[3] >= 40 // BS * BS        # S + B + C from S + B's end
    assert got[4] == fork                 # S + D from the fork point S + B's recompute left
    check_clean(eng, runner, cache)


def test_a_prompt_sent_again_without_its_last_tokens_reuses_a_block_back():
    """A turn that re-sends the last prompt less its tail (aiperf's trace replay drops a partial last block) and goes
    on: its fork lies before the last prompt's last block end, where the snapshot a block back still serves."""
    eng, runner, cache = make(snapshots=32, max_num_batched_tokens=128)
    S = toks(42, 1)  # blocks of 4: its last block ends are 40 and, a block back, 36
    run(eng, runner, S)
    before = hits(eng)
    run(eng, runner, S[:37] + toks(9, 2))  # shares 37 tokens: block 9 (36) is whole
    assert hits(eng) - before == 36
    check_clean(eng, runner, cache)


def test_a_fork_after_its_twin_was_evicted_is_still_right():
    """The twin a recomputed fork chained through is evicted before the fork's next turn: no wrong reuse."""
    eng, runner, cache = make(num_blocks=40, num_slots=2, snapshots=4, max_num_batched_tokens=128, max_model_len=64)
    S = toks(30, 1)
    run(eng, runner, S + toks(10, 2))
    run(eng, runner, S + toks(10, 3))
    for s in range(10, 14):  # unrelated prompts that need the blocks and snapshots back
        run(eng, runner, toks(40, s))
    assert eng.prefix_cache.stats["evicted_blocks"] > 0
    run(eng, runner, S + toks(10, 3) + toks(5, 4))
    run(eng, runner, S + toks(10, 3) + toks(5, 4))
    check_clean(eng, runner, cache)


def test_prompts_arriving_together_compute_their_shared_prefix_once():
    """Four prompts sharing 41 tokens, sent at once: the first computes the shared part, the others wait for it
    and reuse it (a snapshot where they part), and every answer is the reference's."""
    eng, runner, cache = make(snapshots=32, max_num_batched_tokens=16, max_num_seqs=4)
    common = toks(41, 21)
    ps = [common + toks(6 + i, 30 + i) for i in range(4)]
    runner.prompts = [tuple(p) for p in ps]
    eng.generate(ps, SamplingParams(max_tokens=5, ignore_eos=True))
    assert hits(eng) == 3 * (41 // BS * BS)
    check_clean(eng, runner, cache)


def test_agent_sessions_reuse_what_a_perfect_cache_would():
    """8 agent sessions opening on one system prompt, all at once, 3 turns each (each re-sends the conversation):
    hits >= 97 % of a perfect cache's, computed from the requests alone."""
    eng, runner, cache = make(num_blocks=800, num_slots=8, snapshots=64, max_num_batched_tokens=64, max_num_seqs=8,
                               max_model_len=512)
    sessions = agent_sessions(8, 3, system=150)
    sent = drive(eng, runner, sessions)
    best = sum(theoretical_hits(sent, BS))
    assert best > 0.5 * sum(len(p) for p, _ in sent)  # the workload is mostly reusable
    assert hits(eng) >= 0.97 * best, (hits(eng), best)
    check_clean(eng, runner, cache)


# ---- with speculation, on the model (tiny-kimi-linear, the standard path) ----
SPECS = {"suffix": {"method": "suffix", "num_speculative_tokens": 4},
         "ngram": {"method": "ngram", "num_speculative_tokens": 3}}


class _Prompts:  # drive() records the prompts on its runner; the model needs none
    prompts: list = []


@pytest.mark.parametrize("method", [None, *SPECS])
def test_agent_sessions_reuse_what_a_perfect_cache_would_with_speculation(method):
    """The same agent traffic on the model, with and without speculation: verify steps register the blocks their
    accepted drafts fill and snapshot the block ends they pass (from the rollback checkpoint), and a prompt chunk
    never rides in a verify step (it runs in pieces beside them), so a speculative server reuses what a plain one
    does: >= 97 % of a perfect cache's hits."""
    from peregrine.config import EngineConfig
    from peregrine.engine.build import build_engine
    e, _ = build_engine("tiny-kimi-linear", EngineConfig(speculative_config=SPECS.get(method), max_num_seqs=8,
                                                         block_size=16, max_model_len=1024, max_num_batched_tokens=64),
                        dummy_weights=True, log=lambda m: None)
    sent = drive(e, _Prompts, agent_sessions(8, 3, system=150, new=(30, 60), reply=(20, 40)))
    best = sum(theoretical_hits(sent, 16))
    assert e.prefix_cache.stats["hit_tokens"] >= 0.97 * best, (e.prefix_cache.stats, best)
    if method:
        st = e.stats["spec"]
        assert st["verify_steps"] > 0 and st["num_accepted_tokens"] > 0.5 * st["num_draft_tokens"]
        assert e.stats["step_kinds"].get("mixed") is None  # prompt chunks beside decodes went in pieces


def test_reuse_from_a_snapshot_inside_a_verify_step_equals_no_reuse():
    """A prompt decoded with 3 drafts accepted a step (block ends passed inside verify steps), then the
    prompt + its answer + more sent again: it reuses past the prompt (a snapshot from the verify's checkpoint) and
    answers what an engine caching nothing answers."""
    from spec_helpers import ScriptedDrafter
    from test_prefill import engine, greedy
    spec = SpeculativeConfig.parse(SPECS["ngram"])
    hit, miss = engine(True, speculative_config=spec), engine(False)
    p = toks(53, 6)
    first = greedy(miss, [p], n=40)[0]
    q = p + first + toks(9, 8)
    second = greedy(miss, [q])[0]
    hit.enable_speculation(spec, drafter=ScriptedDrafter({tuple(p): first, tuple(q): second}, [3], 320))
    assert greedy(hit, [p], n=40)[0] == first
    assert hit.stats["spec"]["num_accepted_tokens"] > 20
    before = hit.prefix_cache.stats["hit_tokens"]
    assert greedy(hit, [q])[0] == second
    assert hit.prefix_cache.stats["hit_tokens"] - before == (53 + 40 - 1) // 16 * 16  # to the answer's last block end
