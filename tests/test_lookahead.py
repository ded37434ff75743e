"""Decode lookahead (engine/lookahead.py): the next greedy decode step is launched before this
step's tokens are read. Output must be token for token the synchronous engine's.

The FakeRunner with greedy=True acts like the specialized runner (argmax on the "device", and its
next step may take it as input ids); it goes through the real caches and checks positions, so a
wrong position, slot or block in a lookahead step changes the output or raises.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from peregrine.cache import ModelCache
from peregrine.config import ConfigError, EngineConfig
from peregrine.engine import SamplingParams
from peregrine.engine.engine import LLMEngine
from peregrine.engine.penalties import MAX_BAN
from peregrine.parallel.driver import TPDriver
from peregrine.testing import SENTINEL
from fake_runner import FakeRunner
from test_engine import CFG, V, check_clean, prompts, ref_generate


def make_engine(lookahead: bool, num_blocks=64, block_size=4, num_slots=8, model_cfg=CFG, **ecfg):
    cache = ModelCache(model_cfg, num_blocks=num_blocks, block_size=block_size, num_slots=num_slots,
                       dtype=torch.float32, device="cpu")
    runner = FakeRunner(cache, V, greedy=True)
    ecfg.setdefault("max_model_len", 256)
    eng = LLMEngine(runner, model_cfg, EngineConfig(block_size=block_size, decode_lookahead=lookahead, **ecfg), cache)
    return eng, runner, cache


def first_new_at(toks: list[int], k: int) -> int:
    """The first index >= k whose token does not occur before it (a stop token there stops there)."""
    return next(i for i in range(k, len(toks)) if toks[i] not in toks[:i])


def mixed_run(lookahead: bool):
    """Stops by EOS, stop token and max_tokens at different steps, a request added mid-run and one
    aborted mid-run. -> (final outputs by request, engine, runner, cache)."""
    ps = prompts([5, 3, 8, 2, 6, 4], seed=11)
    refs = [ref_generate(p, 40, eos=-1)[0] for p in ps]
    i_eos, i_stop = first_new_at(refs[0], 3), first_new_at(refs[1], 6)
    cfg = dataclasses.replace(CFG, eos_token_id=refs[0][i_eos])
    eng, runner, cache = make_engine(lookahead, num_slots=7, max_num_seqs=6, model_cfg=cfg)
    cache.state[:, 6] = SENTINEL  # max_num_seqs=6 of 7 slots, low ids first: slot 6 is never used
    params = {"eos": SamplingParams(max_tokens=40), "stop": SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[refs[1][i_stop]]),
              "len": SamplingParams(max_tokens=5, ignore_eos=True), "long": SamplingParams(max_tokens=14, ignore_eos=True),
              "late": SamplingParams(max_tokens=6, ignore_eos=True), "abort": SamplingParams(max_tokens=40, ignore_eos=True)}
    names = list(params)
    streamed, final = {}, {}

    def cb(out):
        streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert out.output_token_ids == streamed[out.request_id]
        if out.finished:
            final[out.request_id] = (out.output_token_ids, out.finish_reason)

    for k in (0, 1, 2, 3, 5):
        eng.add_request(ps[k], params[names[k]], names[k], cb)
    step = 0
    while eng.has_unfinished():
        eng.step()
        step += 1
        if step == 3:
            eng.add_request(ps[4], params["late"], "late", cb)
        if step == 8:
            assert eng.abort("abort")
    want = {"eos": (refs[0][: i_eos + 1], "stop"), "stop": (refs[1][: i_stop + 1], "stop"),
            "len": (refs[2][:5], "length"), "long": (refs[3][:14], "length"), "late": (refs[4][:6], "length")}
    assert {k: final[k] for k in want} == want
    assert final["abort"] == (refs[5][: len(final["abort"][0])], "abort") and 5 <= len(final["abort"][0]) < 40
    check_clean(eng, runner, cache)
    assert bool((cache.state[:, 6] == SENTINEL).all())
    return final, eng, runner


def test_identical_to_sync_with_mixed_stops_add_and_abort():
    on, eng_on, run_on = mixed_run(True)
    off, eng_off, run_off = mixed_run(False)
    assert on == off
    assert eng_off.stats["lookahead_steps"] == 0 and eng_on.stats["lookahead_steps"] > 0
    assert eng_on.stats["lookahead_discarded_tokens"] > 0  # stops seen one step late drop a token
    assert eng_on.stats["generation_tokens"] == eng_off.stats["generation_tokens"]
    # only stops the host cannot predict (EOS, stop token, abort) cost a row; no whole step is wasted here
    assert len(run_on.steps) == len(run_off.steps)


def test_reaching_max_model_len_stays_in_its_blocks():
    """max_model_len 12 with blocks for exactly 12 tokens per sequence: a lookahead step one past the
    end would need a fourth block (build() raises); none is launched, none is wasted."""
    res = {}
    for la in (True, False):
        eng, runner, cache = make_engine(la, num_blocks=6, max_model_len=12, max_num_seqs=2)
        ps = prompts([3, 7], seed=12)
        res[la] = eng.generate(ps, SamplingParams(max_tokens=100, ignore_eos=True))
        for p, o in zip(ps, res[la]):
            assert o == ref_generate(p, 100, ignore_eos=True, max_model_len=12)[0] and len(p) + len(o) == 12
        check_clean(eng, runner, cache)
        res[la, "steps"], res[la, "ahead"] = len(runner.steps), eng.stats["lookahead_steps"]
    assert res[True] == res[False] and res[True, "steps"] == res[False, "steps"]
    assert res[True, "ahead"] > 0 and res[False, "ahead"] == 0


def test_all_stopped_step_is_dropped_and_slot_reused_fresh():
    """The only sequence stops on EOS while its next step is already launched: that step is dropped,
    and the next request gets the same KDA slot and blocks, starting from a clean state."""
    p, q = prompts([4, 6], seed=13)
    ref = ref_generate(p, 20, eos=-1)[0]
    k = first_new_at(ref, 4)
    eng, runner, cache = make_engine(True, num_blocks=6, num_slots=1, max_num_seqs=1,
                                     model_cfg=dataclasses.replace(CFG, eos_token_id=ref[k]))
    assert eng.generate([p], SamplingParams(max_tokens=20))[0] == ref[: k + 1]
    n = len(runner.steps)
    assert eng._ahead is not None and eng.stats["lookahead_steps"] > 0  # launched past the stop
    got = []
    eng.add_request(q, SamplingParams(max_tokens=8, ignore_eos=True), "q", got.append)
    eng.step()  # drops the stale step and prefills q at once
    assert len(runner.steps) == n + 1 and runner.steps[n] == [len(q)] and eng.last_step.num_prefill_tokens == len(q)
    assert eng.stats["lookahead_discarded_tokens"] == 1
    while eng.has_unfinished():
        eng.step()
    assert got[-1].output_token_ids == ref_generate(q, 8, ignore_eos=True)[0]
    check_clean(eng, runner, cache)


def test_new_request_ends_lookahead_and_joins_next_step():
    """A request added between steps waits only for the step already launched ahead."""
    pa, pb = prompts([3, 5], seed=14)
    eng, runner, cache = make_engine(True, max_num_seqs=2)
    fin = {}
    done = lambda o: o.finished and fin.__setitem__(o.request_id, o.output_token_ids)  # noqa: E731
    eng.add_request(pa, SamplingParams(max_tokens=12, ignore_eos=True), "a", done)
    for _ in range(4):
        eng.step()
    assert eng._ahead is not None
    m = len(runner.steps)
    eng.add_request(pb, SamplingParams(max_tokens=5, ignore_eos=True), "b", done)
    eng.step()  # the step launched ahead (a alone)
    eng.step()
    assert runner.steps[m] == [1, len(pb)]  # b's prefill joins the first step not yet launched
    while eng.has_unfinished():
        eng.step()
    assert fin == {"a": ref_generate(pa, 12, ignore_eos=True)[0], "b": ref_generate(pb, 5, ignore_eos=True)[0]}
    check_clean(eng, runner, cache)


def test_no_lookahead_with_a_long_min_tokens_mask_or_waiting():
    eng, runner, cache = make_engine(True, max_num_seqs=1)
    many = list(range(100, 100 + MAX_BAN))  # with the end id, one more than the step's mask holds
    eng.add_request(prompts([3])[0], SamplingParams(max_tokens=6, temperature=1.0, seed=1, min_tokens=6,
                                                    stop_token_ids=many))
    eng.add_request(prompts([3])[0], SamplingParams(max_tokens=6, ignore_eos=True))  # waits behind the first
    while eng.num_waiting:
        eng.step()
    assert eng.stats["lookahead_steps"] == 0  # masked on the host (the waiting one cannot start)
    while eng.has_unfinished():
        eng.step()
    assert eng.stats["lookahead_steps"] > 0  # the greedy one alone
    check_clean(eng, runner, cache)


SAMPLED = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9, seed=5),
           SamplingParams(max_tokens=9, ignore_eos=True),  # greedy beside sampled rows
           SamplingParams(max_tokens=14, ignore_eos=True, temperature=1.0, top_k=20, seed=11),
           SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.6, min_p=0.05),  # the engine's seed
           SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.3, top_p=0.95, top_k=50, min_p=0.02, seed=3)]


def run_all(eng, ps, params) -> list[list[int]]:
    return eng.generate(ps, params)


@pytest.mark.parametrize("device_tokens", [True, False])
def test_sampled_rows_keep_lookahead_and_tokens(device_tokens):
    """Sampled rows drawn inside the step (the runner's tokens, keyed by seed and position) look ahead like
    greedy ones, and give the tokens the synchronous engine and the host sampler give."""
    ps = prompts([5, 3, 8, 2, 6], seed=4)
    outs, steps = {}, {}
    for la in (True, False):
        eng, runner, cache = make_engine(la, seed=123)
        if not device_tokens:
            eng.device_sampling = False  # the host draws every sampled row (engine/sampling.py)
        outs[la] = run_all(eng, ps, SAMPLED)
        steps[la] = (eng.stats["lookahead_steps"], runner.sampled_steps)
        check_clean(eng, runner, cache)
    assert outs[True] == outs[False]
    assert steps[False] == (0, 0 if not device_tokens else steps[False][1])
    if device_tokens:
        assert steps[True][0] > 0 and steps[True][1] > 0 and steps[False][1] > 0
    else:
        assert steps[True] == (0, 0)  # host-sampled rows cannot be launched ahead
    greedy = [ref_generate(p, 9, eos=-1)[0][:9] for p in ps[1:2]]
    assert outs[True][1] == greedy[0]
    assert len({tuple(o) for o in outs[True]}) == len(ps)


def test_device_and_host_sampling_draw_the_same_tokens():
    ps = prompts([5, 3, 8, 2, 6], seed=4)
    dev, _, _ = make_engine(True, seed=7)
    host, _, _ = make_engine(False, seed=7)
    host.device_sampling = False
    assert run_all(dev, ps, SAMPLED) == run_all(host, ps, SAMPLED)


def test_logprobs_taken_in_the_step_keep_lookahead_and_values():
    """Rows asking for logprobs (greedy and sampled, top 0..20) are served on the device and look ahead; the
    chosen token's logprob and the top-N equal the host's log_softmax of the raw logits."""
    ps = prompts([5, 3, 8, 2], seed=6)
    params = [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, top_p=0.9, seed=4, logprobs=20),
              SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.7, seed=5),
              SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)]

    def run(device):
        eng, runner, cache = make_engine(True, seed=1)
        eng.device_sampling = device
        outs = {}

        def cb(o):
            outs.setdefault(o.request_id, []).extend(o.logprobs or [])
        for i, (p, sp) in enumerate(zip(ps, params)):
            eng.add_request(p, sp, str(i), cb)
        while eng.has_unfinished():
            eng.step()
        check_clean(eng, runner, cache)
        return outs, eng.stats["lookahead_steps"], runner.logprob_steps

    dev, dev_ahead, dev_lp = run(True)
    host, host_ahead, host_lp = run(False)
    assert dev_ahead > 0 and dev_lp > 0 and host_ahead == 0 and host_lp == 0
    for i in ("0", "1", "3"):
        assert len(dev[i]) == len(host[i]) == 8
        for a, b in zip(dev[i], host[i]):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == params[int(i)].logprobs
            assert all(x == pytest.approx(y, abs=1e-5) for (_, x), (_, y) in zip(a.top, b.top))
    assert dev["2"] == host["2"] == []


def test_penalties_in_the_step_equal_the_host_and_look_ahead():
    """Presence / frequency / repetition penalties (greedy and sampled rows, one with logprobs) applied inside
    the step from counts kept on the device give the host's tokens; with a request joining mid-run (its mixed
    step is served on the host, so the others' counts are rebuilt), min_tokens running out part way, and more
    requests than slots (a reused slot starts from fresh counts)."""
    ps = prompts([5, 3, 8, 2, 6, 4], seed=12)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, presence_penalty=-2.0),  # < 0, <1: repeats favoured
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=2, frequency_penalty=0.8, logprobs=2),
              SamplingParams(max_tokens=14, ignore_eos=True, repetition_penalty=0.5),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.7, seed=3, repetition_penalty=1.3,
                             presence_penalty=-0.5, min_tokens=4),
              SamplingParams(max_tokens=9, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5),
              SamplingParams(max_tokens=11, ignore_eos=True)]

    def run(device):
        eng, runner, cache = make_engine(True, seed=5, num_slots=4, max_num_seqs=4)
        eng.device_sampling = device
        outs, lps = {}, {}

        def cb(o):
            lps.setdefault(o.request_id, []).extend(o.logprobs or [])
            if o.finished:
                outs[o.request_id] = o.output_token_ids
        for i in range(4):
            eng.add_request(ps[i], params[i], str(i), cb)
        n = 0
        while eng.has_unfinished():
            eng.step()
            n += 1
            if n == 4:
                for i in (4, 5):
                    eng.add_request(ps[i], params[i], str(i), cb)
        check_clean(eng, runner, cache)
        return outs, lps, eng.stats["lookahead_steps"], runner.penalty_steps

    dev, dev_lp, dev_ahead, dev_pen = run(True)
    host, host_lp, host_ahead, host_pen = run(False)
    assert dev == host
    assert dev_ahead > 0 and dev_pen > 0 and host_pen == 0
    assert [(a.token_id, a.top[0][0]) for a in dev_lp["1"]] == [(a.token_id, a.top[0][0]) for a in host_lp["1"]]
    assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(dev_lp["1"], host_lp["1"]))
    plain, _, _ = make_engine(True, seed=5)  # the penalties do change the answers
    off = [dataclasses.replace(p, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0) for p in params]
    assert sum(a != dev[str(i)] for i, a in enumerate(plain.generate(ps, off))) >= 2


def test_sampled_request_alone_equals_in_a_batch_of_eight():
    ps = prompts([4, 7, 3, 5, 6, 2, 8, 5], seed=9)
    sp = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, top_p=0.9, seed=42)
    others = [dataclasses.replace(sp, seed=100 + i, top_k=i * 3) for i in range(7)]
    alone, _, _ = make_engine(True)
    batch, runner, _ = make_engine(True, max_num_seqs=8)
    got = run_all(batch, ps, [sp] + others)
    assert run_all(alone, ps[:1], [sp])[0] == got[0]
    assert runner.sampled_steps > 0 and batch.stats["lookahead_steps"] > 0


def test_config_key_and_tp_driver():
    ecfg = EngineConfig()
    assert ecfg.decode_lookahead is True
    ecfg.apply_additional_config('{"decode_lookahead": false}')
    assert ecfg.decode_lookahead is False
    with pytest.raises(ConfigError, match="decode_lookahead must be true or false"):
        ecfg.apply_additional_config({"decode_lookahead": 1})
    eng, _, _ = make_engine(False)
    assert eng.lookahead is False
    # under TP a lookahead step's ids are each rank's own argmax: the driver looks ahead where its inner runner does
    assert TPDriver(FakeRunner(eng.cache, V, greedy=True), None).lookahead is True
    assert TPDriver(FakeRunner(eng.cache, V, greedy=False), None).lookahead is False


class _Silent:
    """A host drafter with nothing to propose (an n-gram lookup that never matches)."""
    host_only = True

    def __init__(self):
        self.calls = 0

    def propose(self, seqs, ks):
        self.calls += 1
        return [[] for _ in seqs]

    def verified(self, seq, drafted, accepted):
        pass

    def release(self, seq):
        pass


def test_speculation_that_proposes_nothing_keeps_lookahead():
    """Speculation on, a host drafter that proposes nothing: every step is the plain one, launched ahead as without
    speculation (the drafter asked while the step before runs), and the tokens are the same."""
    ps = prompts([5, 3, 8], seed=4)
    runs = {}
    for spec in (False, True):
        eng, runner, cache = make_engine(True, max_num_seqs=4)
        if spec:
            dr = _Silent()
            eng.enable_speculation({"method": "ngram", "num_speculative_tokens": 3}, drafter=dr)
        runner.prompts = [tuple(p) for p in ps]
        runs[spec] = eng.generate(ps, SamplingParams(max_tokens=20, ignore_eos=True)), eng.stats["lookahead_steps"]
        check_clean(eng, runner, cache)
    assert runs[True] == runs[False] and runs[True][1] > 15
    assert dr.calls > runs[True][1]  # asked before every launch ahead
