"""Engine: scheduling, chunked prefill, cache reservation, sampling, stops, aborts, validation.

The FakeRunner (tests/fake_runner.py) goes through the real ModelCache, so outputs
only match the cache-free reference when tokens, positions, slots and block tables
are all right.
"""
from __future__ import annotations

import dataclasses
import random
import threading

import pytest
import torch

from peregrine.cache import ModelCache
from peregrine.config import EngineConfig, resolve_model
from peregrine.engine import RequestError, SamplingParams
from peregrine.engine.engine import LLMEngine
from peregrine.engine.sampling import filtered_probs, sample
from peregrine.testing import SENTINEL
from fake_runner import FakeRunner, ref_logits

pytestmark = pytest.mark.gpu

CFG, _ = resolve_model("tiny-kimi-linear")
V = CFG.vocab_size
EOS = CFG.eos_token_id


def make_engine(num_blocks=64, block_size=4, num_slots=8, model_cfg=CFG, greedy=False, runner_cls=FakeRunner, **ecfg):
    """greedy: the runner returns decode steps' argmax, so the engine's decode lookahead engages."""
    cache = ModelCache(model_cfg, num_blocks=num_blocks, block_size=block_size, num_slots=num_slots,
                       dtype=torch.float32, device="cpu")
    runner = runner_cls(cache, V, greedy=greedy)
    ecfg.setdefault("max_model_len", 256)
    eng = LLMEngine(runner, model_cfg, EngineConfig(block_size=block_size, **ecfg), cache)
    return eng, runner, cache


def prompts(lens, seed=0):
    rnd = random.Random(seed)
    return [[rnd.randrange(V) for _ in range(n)] for n in lens]


def ref_generate(prompt, max_tokens, eos=EOS, stop=(), ignore_eos=False, max_model_len=256):
    """Greedy continuation computed straight from the model function, no engine or cache."""
    toks, out = list(prompt), []
    while True:
        t = int(ref_logits(toks, V).argmax())
        toks.append(t)
        out.append(t)
        if (not ignore_eos and t == eos) or t in stop:
            return out, "stop"
        if len(out) >= max_tokens or len(toks) >= max_model_len:
            return out, "length"


def run_all(eng, on_step=None):
    n = 0
    while eng.has_unfinished():
        eng.step()
        n += 1
        if on_step:
            on_step(n)
    return n


def check_clean(eng, runner, cache):
    """Nothing left behind: every slot and block is free again, the cache never lied."""
    assert not eng.has_unfinished() and eng.num_running == 0 and eng.num_waiting == 0
    assert cache.num_free_slots == cache.num_slots
    pc = eng.prefix_cache  # blocks holding a cached prefix nobody reads count as free
    assert pc.num_free == cache.num_blocks and not pc.ref
    assert sorted(cache.blocks._free + list(pc.evictable)) == list(range(cache.num_blocks))
    assert runner.mismatches == 0


def test_greedy_matches_reference():
    eng, runner, cache = make_engine(num_slots=6, max_num_seqs=4)
    cache.state[:, 5] = SENTINEL  # max_num_seqs=4 of 6 slots and low ids first: slot 5 is never used
    ps = prompts([1, 3, 7, 100, 2, 13])
    runner.prompts = [tuple(p) for p in ps]
    outs = eng.generate(ps, SamplingParams(max_tokens=9))
    for p, o in zip(ps, outs):
        assert o == ref_generate(p, 9)[0]
    check_clean(eng, runner, cache)
    assert bool((cache.state[:, 5] == SENTINEL).all())
    assert eng.engine_cfg.max_model_len == 256
    s = eng.stats
    assert s["prompt_tokens"] == sum(map(len, ps)) and s["generation_tokens"] == sum(map(len, outs))
    assert s["finished_requests"] == len(ps) and sum(s["steps_by_path"].values()) == len(runner.steps)
    assert s["fallback_reasons"] == runner.fallback_reasons and s["steps_by_path"]["latency_specialized"] > 0


def test_default_max_model_len():
    cache = ModelCache(CFG, num_blocks=4, block_size=4, num_slots=1, dtype=torch.float32, device="cpu")
    ecfg = EngineConfig(block_size=4)
    LLMEngine(FakeRunner(cache, V), CFG, ecfg, cache)
    assert ecfg.max_model_len == min(CFG.max_position_embeddings, 4096)


@pytest.mark.parametrize("greedy", [False, True])
def test_staggered_arrivals_stream_and_mix(greedy):
    eng, runner, cache = make_engine(max_num_seqs=4, greedy=greedy)
    ps = prompts([5, 1, 30, 9, 4, 17], seed=1)
    runner.prompts = [tuple(p) for p in ps]
    streamed: dict[str, list[int]] = {}
    final = {}

    def cb(out):
        streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert out.output_token_ids == streamed[out.request_id]
        if out.finished:
            assert out.request_id not in final
            final[out.request_id] = (out.output_token_ids, out.finish_reason)

    arrivals = {0: [0, 1], 3: [2], 4: [3], 8: [4, 5]}  # step index -> prompts added before it
    ids = {}
    step = 0
    while step <= max(arrivals) or eng.has_unfinished():
        for k in arrivals.get(step, []):
            ids[k] = eng.add_request(ps[k], SamplingParams(max_tokens=12, ignore_eos=True), on_token=cb)
        outs = eng.step()
        for o in outs:
            assert o.new_token_ids == [] or len(o.new_token_ids) == 1
        step += 1
    for k, p in enumerate(ps):
        assert final[ids[k]] == ref_generate(p, 12, ignore_eos=True)
    assert any(len(q) > 1 and 1 in q and max(q) > 1 for q in runner.steps), "no mixed prefill+decode step"
    assert (eng.stats["lookahead_steps"] > 0) == greedy
    check_clean(eng, runner, cache)


def test_chunked_prefill_budget():
    eng, runner, cache = make_engine(max_num_batched_tokens=5)
    ps = prompts([17, 3, 100, 1], seed=2)
    runner.prompts = [tuple(p) for p in ps]
    prefill = []
    ids = [eng.add_request(p, SamplingParams(max_tokens=6)) for p in ps]
    assert ids == [f"req-{i}" for i in range(4)]
    res = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                res[o.request_id] = o.output_token_ids
        prefill.append(eng.last_step.num_prefill_tokens)
    assert max(prefill) == 5 and all(x <= 5 for x in prefill)
    assert sum(prefill) == sum(map(len, ps)) == eng.stats["prompt_tokens"]
    for i, p in zip(ids, ps):
        assert res[i] == ref_generate(p, 6)[0]
    check_clean(eng, runner, cache)


def test_one_prompt_fills_a_step_but_several_share_one_only_up_to_the_pack():
    """Budget 40, pack 16: a 30-token prompt alone prefills in one step; four 10-token prompts arriving together
    go 16 tokens a step (the first finishes in the first step, not all four at the end of one 40-token step)."""
    def steps_of(lens, pack):
        eng, runner, cache = make_engine(max_num_batched_tokens=40)
        eng.scheduler.pack_tokens = pack
        ps = prompts(lens, seed=7)
        runner.prompts = [tuple(p) for p in ps]
        ids = [eng.add_request(p, SamplingParams(max_tokens=1)) for p in ps]
        tokens, done, step = [], {}, 0
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = step
                    assert o.output_token_ids == ref_generate(ps[ids.index(o.request_id)], 1)[0]
            tokens.append(eng.last_step.num_prefill_tokens)
            step += 1
        check_clean(eng, runner, cache)
        return tokens, [done[i] for i in ids]
    assert steps_of([30], 16) == ([30], [0])
    assert steps_of([10, 10, 10, 10], 16) == ([16, 16, 8], [0, 1, 1, 2])
    assert steps_of([10, 10, 10, 10], 40) == ([40], [0, 0, 0, 0])  # no pack: the old packing


@pytest.mark.parametrize("greedy", [False, True])
def test_cache_pressure_and_max_num_seqs(greedy):
    # each request needs ceil((prompt + 8) / 4) blocks; 14 blocks hold only two or three at once
    eng, runner, cache = make_engine(num_blocks=14, num_slots=3, max_num_seqs=2, greedy=greedy)
    ps = prompts([4, 11, 1, 20, 6, 7, 3, 15, 2, 9], seed=3)
    runner.prompts = [tuple(p) for p in ps]
    waited = []
    outs = None

    def watch(_):
        assert eng.num_running <= 2
        waited.append((eng.num_waiting, eng.last_step.lookahead))

    for p in ps:
        eng.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
    run_all(eng, watch)
    assert max(w for w, _ in waited) > 0 and max(len(q) for q in runner.steps) <= 2
    assert any(w > 0 and la for w, la in waited) == greedy  # requests that cannot start yet do not stop lookahead
    outs = eng.generate(ps, SamplingParams(max_tokens=8, ignore_eos=True))
    for p, o in zip(ps, outs):
        assert o == ref_generate(p, 8, ignore_eos=True)[0]
    check_clean(eng, runner, cache)


def test_fifo_no_starvation():
    eng, runner, cache = make_engine(num_blocks=10, max_num_seqs=8)
    first = {}

    def cb(out):
        first.setdefault(out.request_id, len(runner.steps))

    a = eng.add_request(prompts([20])[0], SamplingParams(max_tokens=4, ignore_eos=True), "a", cb)  # 6 blocks
    eng.step()
    b = eng.add_request(prompts([28], 1)[0], SamplingParams(max_tokens=4, ignore_eos=True), "b", cb)  # 8 blocks
    c = eng.add_request([5], SamplingParams(max_tokens=2, ignore_eos=True), "c", cb)  # 1 block: fits now
    eng.step()
    assert eng.num_running == 1 and eng.num_waiting == 2  # c does not jump ahead of b
    run_all(eng)
    assert first[a] < first[b] <= first[c]
    check_clean(eng, runner, cache)


def test_never_fits_rejected():
    eng, runner, cache = make_engine(num_blocks=5, max_model_len=64)
    with pytest.raises(RequestError, match="cache blocks"):
        eng.add_request([1] * 10, SamplingParams(max_tokens=20))  # 30 tokens > 5 * 4
    eng.add_request([1] * 10, SamplingParams(max_tokens=10))     # exactly 20: fine
    run_all(eng)
    check_clean(eng, runner, cache)


def test_abort_waiting_and_running():
    eng, runner, cache = make_engine(max_num_seqs=1)
    got = []
    for r in ("run", "wait"):
        eng.add_request(prompts([6])[0], SamplingParams(max_tokens=50, ignore_eos=True), r, got.append)
    assert eng.abort("nope") is False
    eng.step()
    eng.step()
    assert eng.num_running == 1 and eng.num_waiting == 1
    assert eng.abort("wait") and eng.abort("run")
    assert eng.num_running == 0 and eng.num_waiting == 0  # freed at once when no step runs
    assert cache.num_free_slots == cache.num_slots and eng.prefix_cache.num_free == cache.num_blocks
    assert eng.abort("run") is False
    ab = [o for o in got if o.finish_reason == "abort"]
    assert {o.request_id for o in ab} == {"run", "wait"} and all(o.finished for o in ab)
    assert [o.request_id for o in eng.step()] == ["wait", "run"]  # returned by the next step
    assert eng.stats["aborted_requests"] == 2 and eng.stats["finished_requests"] == 0
    eng.add_request([1, 2], SamplingParams(max_tokens=2), "run")  # the id is free again
    run_all(eng)
    check_clean(eng, runner, cache)


@pytest.mark.parametrize("greedy", [False, True])
def test_abort_inside_step_is_deferred(greedy):
    eng, runner, cache = make_engine(greedy=greedy)
    got = []

    def cb(out):
        got.append(out)
        if out.request_id == "x" and len(out.output_token_ids) == 2:
            assert eng.abort("y")  # called while step() runs: handled at the next step

    eng.add_request([1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True), "x", cb)
    eng.add_request([4, 5], SamplingParams(max_tokens=10, ignore_eos=True), "y", cb)
    run_all(eng)
    y = [o for o in got if o.request_id == "y"]
    assert y[-1].finish_reason == "abort" and len(y[-1].output_token_ids) == 2
    assert [o.finish_reason for o in got if o.finished and o.request_id == "x"] == ["length"]
    assert (eng.stats["lookahead_steps"] > 0) == greedy
    check_clean(eng, runner, cache)


@pytest.mark.parametrize("greedy", [False, True])
def test_threads_add_and_abort(greedy):
    eng, runner, cache = make_engine(max_num_seqs=3, greedy=greedy)
    stop = threading.Event()
    done = []

    def loop():
        while not stop.is_set() or eng.has_unfinished():
            eng.step()

    t = threading.Thread(target=loop)
    t.start()
    ps = prompts([3, 8, 1, 12, 5, 2, 9, 4], seed=4)
    for i, p in enumerate(ps):
        eng.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True), str(i),
                        lambda o: o.finished and done.append((o.request_id, o.finish_reason)))
        if i % 3 == 2:
            eng.abort(str(i - 1))
    stop.set()
    t.join(timeout=60)
    assert not t.is_alive()
    assert sorted(r for r, _ in done) == sorted(map(str, range(len(ps))))
    assert all((why == "abort") == (int(r) % 3 == 1) or why == "length" for r, why in done)
    check_clean(eng, runner, cache)


def test_stop_tokens_eos_ignore_eos():
    p = prompts([5], seed=5)[0]
    ref, _ = ref_generate(p, 10, eos=-1)
    eng, runner, cache = make_engine()
    out = eng.generate([p], SamplingParams(max_tokens=10, stop_token_ids=[ref[2]]))[0]
    assert out == ref[: ref.index(ref[2]) + 1]
    # make the model's third greedy token the eos
    eng, runner, cache = make_engine(model_cfg=dataclasses.replace(CFG, eos_token_id=ref[2]))
    got = []
    eng.add_request(p, SamplingParams(max_tokens=10), "e", got.append)
    eng.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True), "i", got.append)
    run_all(eng)
    fin = {o.request_id: (o.output_token_ids, o.finish_reason) for o in got if o.finished}
    assert fin["e"] == (ref[: ref.index(ref[2]) + 1], "stop")
    assert fin["i"] == (ref, "length")
    check_clean(eng, runner, cache)


def test_max_tokens_and_max_model_len():
    eng, runner, cache = make_engine(num_blocks=6, max_model_len=24)  # 24 tokens: the cap, not prompt + max_tokens
    p = prompts([20], seed=6)[0]
    got = []
    eng.add_request(p, SamplingParams(max_tokens=100, ignore_eos=True), "long", got.append)
    eng.add_request(p[:3], SamplingParams(max_tokens=1, ignore_eos=True), "one", got.append)
    run_all(eng)
    fin = {o.request_id: (o.output_token_ids, o.finish_reason) for o in got if o.finished}
    assert fin["long"] == (ref_generate(p, 100, ignore_eos=True, max_model_len=24)[0], "length")
    assert len(fin["long"][0]) == 4 and len(fin["one"][0]) == 1 and fin["one"][1] == "length"
    with pytest.raises(RequestError, match="max_model_len"):
        eng.add_request([1] * 24, SamplingParams())
    check_clean(eng, runner, cache)


def test_callback_exception_does_not_break_engine():
    eng, runner, cache = make_engine()

    def bad(_):
        raise RuntimeError("user bug")

    p = prompts([4], seed=7)[0]
    eng.add_request(p, SamplingParams(max_tokens=5, ignore_eos=True), "bad", bad)
    out = eng.generate([p], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert out == ref_generate(p, 5, ignore_eos=True)[0]
    check_clean(eng, runner, cache)


def test_seeded_sampling_reproducible_and_batch_independent():
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    p = prompts([6], seed=8)[0]
    others = prompts([3, 11, 1], seed=9)
    eng, runner, cache = make_engine()
    alone = eng.generate([p], sp)[0]
    again = eng.generate([p], sp)[0]
    mixed = eng.generate(others[:2] + [p] + others[2:],
                         [SamplingParams(temperature=0.8, seed=i, max_tokens=9) for i in range(2)] + [sp]
                         + [SamplingParams(max_tokens=3)])[2]
    other_seed = eng.generate([p], dataclasses.replace(sp, seed=99))[0]
    assert alone == again == mixed and alone != other_seed
    unseeded = eng.generate([p, p], dataclasses.replace(sp, seed=None))
    assert unseeded[0] != unseeded[1]  # each request draws a fresh seed
    greedy_like = eng.generate([p], dataclasses.replace(sp, top_k=1))[0]
    assert greedy_like == ref_generate(p, 12, ignore_eos=True)[0]
    check_clean(eng, runner, cache)


def _ref_probs(row, temperature, top_k, top_p):
    """Independent filtered distribution, token by token in float64."""
    x = (row.double() / temperature).tolist()
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = order[:top_k] if top_k else order
    m = max(x[i] for i in keep)
    w = {i: pow(2.718281828459045, x[i] - m) for i in keep}
    z = sum(w.values())
    acc, kept = 0.0, []
    for i in keep:
        if acc >= top_p and top_p < 1:
            break
        kept.append(i)
        acc += w[i] / z
    z2 = sum(w[i] for i in kept)
    out = torch.zeros(len(x), dtype=torch.float64)
    for i in kept:
        out[i] = w[i] / z2
    return out


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6), (0.9, 5, 0.8), (1.0, 1, 1.0),
                                   (2.0, 0, 1e-6), (1.0, 100, 1.0)])
def test_filtered_probs_match_reference(t, k, p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, generator=g) * 2
    logits[1, 2] = logits[1, 5]  # a tie
    S = logits.shape[0]
    got = filtered_probs(logits, torch.full((S,), t), torch.full((S,), k), torch.full((S,), p))
    for r in range(S):
        ref = _ref_probs(logits[r], t, k, p)
        assert torch.allclose(got[r].double(), ref, atol=1e-6), (got[r], ref)


def test_sampler_greedy_and_distribution():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(1)) * 2
    greedy = [SamplingParams()] * 5
    assert sample(logits, greedy, [0] * 5, [0] * 5) == logits.argmax(-1).tolist()
    sp = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    ref = _ref_probs(logits[0], 0.8, 4, 0.9)
    N = 4000  # rows of the same logits, one seed, N positions: the empirical distribution
    toks = sample(logits[:1].expand(N, -1), [sp] * N, [7] * N, list(range(N)))
    freq = torch.bincount(torch.tensor(toks), minlength=11).double() / N
    assert bool((freq[ref == 0] == 0).all())
    assert (freq - ref).abs().max() < 0.035
    # mixed batch: greedy rows stay argmax; a sampled row draws what it draws alone (its seed, its position)
    mix = [SamplingParams(), sp, SamplingParams(), sp]
    a = sample(logits[:4], mix, [0, 3, 0, 4], [9, 9, 9, 9])
    b = sample(logits[1:2], [sp], [3], [9])
    assert a[0] == int(logits[0].argmax()) and a[2] == int(logits[2].argmax()) and a[1] == b[0]
    # the key is (seed, position): other positions draw differently from a flat distribution
    flat = torch.zeros(1, 11)
    assert len({sample(flat, [SamplingParams(temperature=1.0)], [3], [j])[0] for j in range(12)}) > 5


@pytest.mark.parametrize("kw,prompt,msg", [
    ({}, [], "empty"),
    ({}, [1, V], "prompt token ids"),
    ({}, [-1], "prompt token ids"),
    ({}, [1, True], "prompt token ids"),
    ({}, [1, 2.0], "prompt token ids"),
    ({}, [1] * 256, "too long"),
    ({"temperature": -0.1}, [1], "temperature"),
    ({"top_p": 0.0}, [1], "top_p"),
    ({"top_p": 1.5}, [1], "top_p"),
    ({"top_k": -2}, [1], "top_k"),
    ({"min_p": -0.1}, [1], "min_p"),
    ({"min_p": 1.5}, [1], "min_p"),
    ({"repetition_penalty": 0.0}, [1], "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, [1], "repetition_penalty"),
    ({"max_tokens": 0}, [1], "max_tokens"),
    ({"stop_token_ids": [V]}, [1], "stop_token_ids"),
    ({"seed": 1.5}, [1], "seed"),
])
def test_validation_errors(kw, prompt, msg):
    eng, runner, cache = make_engine()
    with pytest.raises(RequestError, match=msg):
        eng.add_request(prompt, SamplingParams(**kw))
    assert eng.num_waiting == 0 and not eng.has_unfinished()


def test_duplicate_request_id():
    eng, runner, cache = make_engine()
    eng.add_request([1], SamplingParams(max_tokens=2), "same")
    with pytest.raises(RequestError, match="duplicate"):
        eng.add_request([2], SamplingParams(), "same")
    run_all(eng)
    check_clean(eng, runner, cache)
