"""Speculative decoding on the standard path (docs/correctness.md §2 "speculative vs plain"): greedy output
with speculation equals greedy output without it; rollback leaves the caches as a plain run does."""
import pytest
import torch

from peregrine.cli import main
from peregrine.config import ConfigError, EngineConfig
from peregrine.engine import SamplingParams
from peregrine.engine.build import build_engine
from peregrine.speculative.config import SpeculativeConfig
from peregrine.speculative.drafters import NgramDrafter
from spec_helpers import ScriptedDrafter

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def tiny(spec=None, **kw):
    cfg = dict(max_num_seqs=4, block_size=16, max_model_len=160)
    cfg.update(kw)
    e, _ = build_engine("tiny-kimi-linear", EngineConfig(speculative_config=spec, **cfg), dummy_weights=True,
                        log=lambda m: None)
    return e


def repetitive(seed, n=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        pat = torch.randint(0, 256, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        out.append((pat * 8)[: 10 + 7 * i])
    return out


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


# ---- config and drafters ----
def test_config_parse_vllm_spelling_and_errors():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (c.method, c.k, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 3, 1)
    c = SpeculativeConfig.parse({"model": "tiny-kimi-linear", "num_speculative_tokens": 2})
    assert c.method == "draft_model" and c.model == "tiny-kimi-linear"
    assert SpeculativeConfig.parse("") is None and SpeculativeConfig.parse(None) is None
    for bad in ("{", "[1]", '{"method": "eagle", "num_speculative_tokens": 2}', '{"method": "ngram"}',
                '{"method": "ngram", "num_speculative_tokens": 0}', '{"method": "ngram", "num_speculative_tokens": 2, "x": 1}',
                '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
                '{"method": "draft_model", "num_speculative_tokens": 2}'):
        with pytest.raises(ConfigError):
            SpeculativeConfig.parse(bad)


def test_ngram_lookup():
    d = NgramDrafter(max_n=3)
    assert d.lookup([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]          # longest suffix [1,2,3] -> what followed
    assert d.lookup([1, 2, 3, 4, 1, 2, 3], 9) == [4, 1, 2, 3]       # runs out at the end of the history
    assert d.lookup([7, 8, 9, 7, 5, 7], 2) == [5, 7]                # latest occurrence with a full continuation
    assert d.lookup([5, 6, 7, 8], 2) == []                          # nothing repeats
    assert d.lookup([9, 9, 9, 9], 2) == [9]                         # the longest n-gram wins, even with a short tail
    assert NgramDrafter(max_n=4, min_n=2).lookup([1, 2, 3, 9, 3], 2) == []  # only a 1-gram matches: below min


# ---- greedy equality ----
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ngram_greedy_equals_plain(seed, k):
    ps = repetitive(seed)
    want = tiny().generate(ps, greedy(24))
    e = tiny({"method": "ngram", "num_speculative_tokens": k})
    assert e.generate(ps, greedy(24)) == want
    st = e.stats["spec"]
    assert st["num_draft_tokens"] > 0 and st["verify_steps"] > 0
    assert st["mean_acceptance_length"] == pytest.approx(1 + st["num_accepted_tokens"] / st["num_drafts"])


@pytest.mark.parametrize("accepts", [[0], [1, 3, 0, 2], [5]])
def test_scripted_acceptance_and_rollback_match_plain(accepts):
    """Known acceptance per proposal (0 = all rejected, 5 > k = all accepted): tokens, counters and the
    caches after the run (KDA state/conv of every slot, MLA latents) equal a plain run's."""
    ps = repetitive(5)
    plain = tiny()
    want = plain.generate(ps, greedy(20))
    e = tiny(NGRAM)
    dr = ScriptedDrafter({tuple(p): w for p, w in zip(ps, want)}, accepts, 320)
    e.enable_speculation(NGRAM, drafter=dr)
    assert e.generate(ps, greedy(20)) == want
    st = e.stats["spec"]
    assert st["num_accepted_tokens"] == dr.expected and st["num_drafts"] == dr.n > 0
    assert sorted(dr.released) == sorted(dr.released) and len(dr.released) == len(ps)
    c0, c1 = plain.cache, e.cache
    for a, b, what in ((c0.state, c1.state, "KDA state"), (c0.conv, c1.conv, "conv window")):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), f"{what} differs after rollback"
    live = slice(0, c0.num_blocks)  # the scratch block past them takes overflowing filler writes
    assert torch.allclose(c0.latent[:, live], c1.latent[:, live], rtol=1e-4, atol=1e-5), "MLA cache differs"


def test_mixed_steps_prefill_chunks_sampling_and_stops():
    """Verify rows share steps with chunked prefills and a late arrival; a sampled request (drafted too since
    #42: speculative sampling) gets the same tokens as without speculation; a stop token inside accepted drafts
    ends the request there."""
    ps = repetitive(7, n=3)
    base = tiny(max_num_batched_tokens=12)
    ref = base.generate(ps, greedy(18))
    stop = ref[1][9]
    params = [greedy(18), greedy(18, stop_token_ids=[stop]), SamplingParams(max_tokens=18, temperature=0.8, seed=11,
                                                                             ignore_eos=True)]

    def run(e):
        got = {}
        cb = lambda o: o.finished and got.__setitem__(o.request_id, o.output_token_ids)  # noqa: E731
        e.add_request(ps[0], params[0], request_id="a", on_token=cb)
        for _ in range(3):
            e.step()
        e.add_request(ps[1], params[1], request_id="b", on_token=cb)
        e.add_request(ps[2], params[2], request_id="c", on_token=cb)
        while e.has_unfinished():
            e.step()
        return [got[r] for r in "abc"]

    want = run(tiny(max_num_batched_tokens=12))
    e = tiny(NGRAM, max_num_batched_tokens=12)
    dr = ScriptedDrafter({tuple(p): w for p, w in zip(ps, want)}, [3, 1, 2], 320)  # each request's own output
    e.enable_speculation(NGRAM, drafter=dr)
    got = run(e)
    assert got == want
    assert got[1][-1] == stop and len(got[1]) == ref[1].index(stop) + 1
    assert e.stats["spec"]["num_accepted_tokens"] > 0


def test_draft_model_same_weights_accepts_everything_other_model_still_exact():
    ps = repetitive(3)
    want = tiny().generate(ps, greedy(16))
    same = tiny({"method": "draft_model", "model": "tiny-kimi-linear", "dummy_weights": True, "num_speculative_tokens": 3})
    assert same.generate(ps, greedy(16)) == want
    st = same.stats["spec"]
    assert st["num_accepted_tokens"] == st["num_draft_tokens"] > 0  # the draft is the target: all accepted
    dc = same.spec.drafter.cache
    assert dc.num_free_slots == dc.num_slots and dc.blocks.num_free == dc.num_blocks  # released
    other = tiny({"model": "peregrine-tiny", "dummy_weights": True, "num_speculative_tokens": 2})
    assert other.generate(ps, greedy(16)) == want
    with pytest.raises(ConfigError, match="ships no weights"):
        tiny({"model": "tiny-kimi-linear", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="vocabulary"):
        tiny({"model": "kimi-linear-48b-a3b", "dummy_weights": True, "num_speculative_tokens": 2})


def test_cache_blocks_and_slots_return_and_no_write_past_reservation():
    """Tight cache (every block reserved): filler drafts past a sequence's blocks go to scratch, nothing leaks."""
    e = tiny(NGRAM, max_num_seqs=2, num_cache_blocks=4, max_model_len=32)
    ps = [[3, 4] * 6, [9, 8, 7] * 4]
    want = tiny(max_num_seqs=2, num_cache_blocks=4, max_model_len=32).generate(ps, greedy(20))
    assert e.generate(ps, greedy(20)) == want
    assert e.prefix_cache.num_free == 4 and e.cache.num_free_slots == 2


def test_metrics_and_cli():
    from peregrine.server.metrics import Metrics
    e = tiny(NGRAM)
    e.generate(repetitive(0), greedy(12))
    text = Metrics(e, "m").render().decode()
    for name in ("peregrine:spec_drafts_total", "peregrine:spec_draft_tokens_total", "peregrine:spec_accepted_tokens_total",
                 "peregrine:spec_mean_acceptance_length", 'peregrine:spec_accepted_tokens_per_pos_total{position="0"}'):
        assert name in text, name
    assert "peregrine:spec_" not in Metrics(tiny(), "m").render().decode()
    args = ["generate", "--model", "tiny-kimi-linear", "--dummy-weights", "--prompt", "abcabcabcabc", "--max-tokens", "6",
            "--quiet", "--speculative-config"]
    assert main(args + ['{"method": "ngram", "num_speculative_tokens": 2}']) == 0
    assert main(args + ["{oops"]) == 2


def test_bench_spec_records_plain_ngram_and_oracle(tmp_path):
    from peregrine.bench.spec import bench_spec
    r = bench_spec("tiny-kimi-linear", batch_sizes=(2,), ks=(2,), input_len=24, output_len=8, pattern_len=4, runs=1,
                   backend="standard", dummy_weights=True, results_dir=str(tmp_path), log=lambda m: None)
    assert [b["batch"] for b in r["batches"]] == [2]
    for b in r["batches"]:
        plain, ngram, oracle = b["configs"]
        assert (plain["label"], ngram["label"], oracle["label"]) == ("plain", "ngram k=2", "oracle k=2")
        assert plain["tokens_per_step_per_user"] == 1.0 and plain["draft_tokens"] == 0
        assert oracle["accepted_tokens"] == oracle["draft_tokens"] > 0 and oracle["tokens_per_step_per_user"] > 1.5
        assert ngram["outputs_equal_plain"] == oracle["outputs_equal_plain"] == f"{b['batch']}/{b['batch']}"
        assert oracle["speedup_vs_plain"] > 0 and "verify_steps" in oracle["routing"]
    assert (tmp_path / r["paths"]["json"].split("/")[-1]).exists() and "oracle k=2" in open(r["paths"]["md"]).read()


def test_speculation_with_tensor_parallel_is_a_clear_error():
    from peregrine.config import EngineConfig
    with pytest.raises(ConfigError, match="speculative-config does not work with --tensor-parallel-size"):
        EngineConfig(tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}).validate()
    EngineConfig(tensor_parallel_size=2).validate()  # each alone is fine
    EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).validate()


SYNTH = {"method": "ngram", "num_speculative_tokens": 7, "rejection_sample_method": "synthetic"}


def test_synthetic_length_becomes_vllms_schedule():
    """The length counts the bonus token and is spent on the earliest positions (vLLM's and SGLang's schedule;
    3.78 at 7 drafts is [1, 1, 0.78, 0, 0, 0, 0] in their docs)."""
    from peregrine.speculative.config import acceptance_rates_for
    assert acceptance_rates_for(3.78, 7) == [1, 1, 0.78, 0, 0, 0, 0]
    assert acceptance_rates_for(6.0, 7) == [1, 1, 1, 1, 1, 0, 0]
    assert acceptance_rates_for(2.33, 3) == [1, 0.33, 0]
    assert acceptance_rates_for(1.0, 3) == [0, 0, 0] and acceptance_rates_for(8.0, 7) == [1] * 7
    cfg = SpeculativeConfig.parse(dict(SYNTH, synthetic_acceptance_length=4.73))
    assert cfg.synthetic and abs(sum(cfg.acceptance_rates()) + 1 - 4.73) < 1e-9


@pytest.mark.parametrize("bad,match", [
    ({"synthetic_acceptance_length": 9.0}, "1..8"), ({"synthetic_acceptance_length": 0.5}, "1..8"),
    ({}, "exactly one"), ({"synthetic_acceptance_length": 3.0, "synthetic_acceptance_rates": [1] * 7}, "exactly one"),
    ({"synthetic_acceptance_rates": [1, 0.5]}, "7 numbers"), ({"synthetic_acceptance_rates": [0.5, 0.9] + [0] * 5}, "non-increasing"),
    ({"rejection_sample_method": "block"}, "rejection_sample_method"),
    ({"rejection_sample_method": "standard", "synthetic_acceptance_length": 3.0}, "need"),
])
def test_synthetic_config_errors_name_the_key(bad, match):
    with pytest.raises(ConfigError, match=match):
        SpeculativeConfig.parse(dict(SYNTH, **bad))


@pytest.mark.parametrize("rates", [[1, 1, 0.78, 0, 0, 0, 0], [0.9, 0.7, 0.55, 0.4, 0.2, 0.1, 0.05]])
def test_synthetic_draws_follow_the_rates(rates):
    """10 000 draws (keyed by request seed and length, as the engine makes them): the mean accepted length within
    1 % of the configured one, each position accepted at its rate (within 4 binomial sigmas), a prefix always."""
    from types import SimpleNamespace
    from peregrine.speculative.decoder import SpecDecoder
    d = SpecDecoder.__new__(SpecDecoder)
    d.rates = [float(r) for r in rates]
    n, k = 10_000, len(rates)
    counts = [d.synthetic_accepted(SimpleNamespace(seed=s, token_ids=[0] * (10 + s % 7)), k) for s in range(n)]
    assert abs((1 + sum(counts) / n) - (1 + sum(rates))) < 0.01 * (1 + sum(rates))
    for j, r in enumerate(rates):
        got = sum(c > j for c in counts) / n
        assert abs(got - r) <= 4 * (r * (1 - r) / n) ** 0.5 + 1e-12, (j, got, r)
    assert d.synthetic_accepted(SimpleNamespace(seed=1, token_ids=[0] * 5), 2) <= 2  # never past the drafts


def test_synthetic_drafts_route_like_distinct_tokens(monkeypatch):
    """Synthetic verify rows carry ids keyed by (seed, length, position), not the drafter's proposals: each
    step's drafts are spread over the vocabulary (a MoE verify reads the union of its rows' experts, so drafts
    repeating a looping model's few tokens would time a cheaper step than text's), the same for a request
    whatever its batch, and the drafter still proposes (its host time is a real step's)."""
    from peregrine.speculative.decoder import SpecDecoder
    seen, proposed = [], []
    real = SpecDecoder.synthetic_drafts
    monkeypatch.setattr(SpecDecoder, "synthetic_drafts",
                        lambda self, seq, k: seen.append((seq.seed, len(seq.token_ids), real(self, seq, k))) or seen[-1][2])
    e = tiny(dict(SYNTH, num_speculative_tokens=7, synthetic_acceptance_length=2.0))
    own = e.spec.drafter.propose
    e.spec.drafter.propose = lambda seqs, ks: proposed.append(len(seqs)) or own(seqs, ks)
    ps = [[5] * 8, [7, 7, 7, 7], [1, 2, 1, 2, 1, 2]]  # prompts whose n-gram proposals repeat one or two tokens
    e.generate(ps, [greedy(24, seed=s) for s in (1, 2, 3)])
    V = e.model_cfg.vocab_size
    assert seen and len(proposed) > 0
    for _, _, d in seen:
        assert 1 <= len(d) <= 7 and all(0 <= t < V for t in d) and len(set(d)) >= len(d) - 2, d  # the room, near the end
    assert sum(len(d) == 7 for _, _, d in seen) > len(seen) // 2
    assert len({tuple(d) for _, _, d in seen}) == len(seen)  # a new key every step
    alone = tiny(dict(SYNTH, num_speculative_tokens=7, synthetic_acceptance_length=2.0))
    seen_batch = {(s, n): d for s, n, d in seen}
    seen.clear()
    alone.generate(ps[1:2], [greedy(24, seed=2)])
    assert seen and all(seen_batch.get((s, n)) == d for s, n, d in seen)  # keyed by the request, not the batch


def test_synthetic_acceptance_in_the_engine():
    """Every greedy row verifies its whole room and accepts the drawn count: the engine's measured mean acceptance
    length matches the configured one (the drafts themselves are never compared), outputs keep their lengths, the
    metrics say the acceptance is synthetic."""
    from peregrine.server.metrics import Metrics
    e = tiny(dict(SYNTH, num_speculative_tokens=3, synthetic_acceptance_length=2.5))
    outs = e.generate([[5, 6, 7], [1, 2], [9] * 6, [4, 3, 2, 1]], greedy(40))
    assert [len(o) for o in outs] == [40] * 4
    st = e.stats["spec"]
    # padded to the room: only a request's last two verifies (3 tokens or fewer left) draft fewer than 3
    assert st["num_drafts"] >= 20 and st["num_draft_tokens"] >= 3 * st["num_drafts"] - 3 * 4
    assert abs(e.spec.mean_acceptance_length - 2.5) < 0.35, e.spec.mean_acceptance_length
    assert st["accepted_per_pos"][0] >= st["accepted_per_pos"][1] >= st["accepted_per_pos"][2] == 0
    text = Metrics(e, "m").render().decode()
    assert 'peregrine:spec_mean_acceptance_length{acceptance="synthetic"}' in text
    assert "peregrine:spec_synthetic_acceptance_length 2.5" in text


# ---- the verify width chooser (#42 item 3) ----
def test_choose_width_on_given_costs():
    """Expected tokens per ms, worked by hand: one request with survival [1, 1, 0.78] (3.78's schedule) and
    cheap verifies takes every draft; a weak drafter against costly verifies takes a plain step; a batch whose
    step cost climbs with T (a MoE's union of experts) stops where the next draft no longer pays."""
    from peregrine.speculative.width import choose_width
    # w: tokens / ms = 1/2.0 = 0.50, 2/2.2 = 0.91, 3/2.4 = 1.25, 3.78/2.6 = 1.45
    assert choose_width([[1.0, 1.0, 0.78]], {1: 2.0, 2: 2.2, 3: 2.4, 4: 2.6}) == 3
    # 1/2.0 = 0.50 against 1.3/4.5 = 0.29 and 1.4/5.0 = 0.28: the plain step wins
    assert choose_width([[0.3, 0.1]], {1: 2.0, 2: 4.5, 3: 5.0}) == 0
    # B = 4, survival [0.8, 0.5, 0.2] each: tokens 4, 7.2, 9.2, 10.0 over 7.0, 9.0, 11.0, 14.0 ms
    # -> 0.571, 0.800, 0.836, 0.714: width 2 (0.836 clears 0.800 by more than MIN_GAIN's 2 %)
    assert choose_width([[0.8, 0.5, 0.2]] * 4, {1: 7.0, 2: 9.0, 3: 11.0, 4: 14.0}) == 2
    # a request without drafts still yields its own token: 2 rows, one drafting [0.9]: 2/3.0 = 0.67 vs 2.9/3.3 = 0.88
    assert choose_width([[0.9], []], {1: 3.0, 2: 3.3}) == 1


def test_acceptance_tracker_counts_conditional_rates():
    from peregrine.speculative.width import PRIOR_RATE, PRIOR_WEIGHT, AcceptanceTracker
    t = AcceptanceTracker(3)
    for drafted, accepted in ((3, 3), (3, 1), (2, 0), (3, 2)):
        t.record(drafted, accepted)
    # position 0 reached 4 times, accepted 3; position 1 reached 3 (the 3 / 1 / 2 rows), accepted 2;
    # position 2 reached 2 (the rows with 3 and 2 accepted), accepted 1
    assert t.reached == [4, 3, 2] and t.accepted == [3, 2, 1]
    c = [(a + PRIOR_RATE * PRIOR_WEIGHT) / (r + PRIOR_WEIGHT) for a, r in ((3, 4), (2, 3), (1, 2))]
    s = t.survival(3)
    assert abs(s[0] - c[0]) < 1e-12 and abs(s[1] - c[0] * c[1]) < 1e-12 and abs(s[2] - c[0] * c[1] * c[2]) < 1e-12


def test_width_chooser_in_the_engine_keeps_greedy_exact():
    """With a cost table injected (the GPU measures one at start-up): verifies costlier than they yield make every
    step plain; a table where only T = 2 pays verifies one draft a step; both give plain greedy's tokens."""
    ps = repetitive(4)
    want = tiny().generate(ps, greedy(24))
    for table, width in (({1: 1.0, 2: 5.0, 3: 6.0, 4: 7.0}, 0), ({1: 1.0, 2: 1.05, 3: 9.0, 4: 9.5}, 1)):
        e = tiny(NGRAM)
        e.enable_speculation(NGRAM, drafter=ScriptedDrafter({tuple(p): w for p, w in zip(ps, want)}, [1, 3], 320))
        e.spec.costs = {B: dict(table) for B in range(1, 5)}
        e.spec.observe = lambda *a: None  # the CPU's wall times are not the injected table's: no learning here
        assert e.generate(ps, greedy(24)) == want
        st = e.spec.stats
        assert st["width_steps"][width] > 0 and sum(st["width_steps"]) == st["width_steps"][width]
        if width == 0:
            assert st["verify_steps"] == 0
        else:
            assert st["num_drafts"] > 0 and st["num_draft_tokens"] == st["num_drafts"]  # one draft each


def test_bench_spec_synthetic_lengths(tmp_path):
    """bench spec's synthetic rows: per acceptance length and width mode, tokens a step per user near the length
    (every greedy row drafts its room and accepts the drawn count), rows verified per request 1 + k."""
    from peregrine.bench.spec import bench_spec
    r = bench_spec("tiny-kimi-linear", batch_sizes=(2,), ks=(3,), input_len=16, output_len=24, pattern_len=4, runs=1,
                   backend="standard", dummy_weights=True, oracle=False, results_dir=str(tmp_path), log=lambda m: None,
                   acceptance_lengths=(2.0, 3.5), widths=("full",))
    (b,) = r["batches"]
    labels = [c["label"] for c in b["configs"]]
    assert labels == ["plain", "ngram k=3", "synthetic 2 k=3 full", "synthetic 3.5 k=3 full"]
    for c, L in zip(b["configs"][2:], (2.0, 3.5)):
        assert c["acceptance_length"] == L and c["draft_tokens"] > 0
        assert abs(c["accepted_tokens"] / (c["draft_tokens"] / 3) + 1 - L) < 0.4  # per full-room verify
        assert c["rows_per_request"] > 3.0  # own token + (mostly) 3 drafts
    assert "synthetic 3.5 k=3 full" in open(r["paths"]["md"]).read()


def test_bench_spec_synthetic_sampled_rows(tmp_path):
    """--temperature: plain and each synthetic configuration once more with sampled rows on the same engine; the
    sampled rows still draft their whole room and accept near the length (rejection sampling replaced by the
    synthetic draw, as vLLM's), their speedup is over plain sampled and vs_greedy_speedup the ratio of speedups."""
    from peregrine.bench.spec import bench_spec
    r = bench_spec("tiny-kimi-linear", batch_sizes=(2,), ks=(3,), input_len=16, output_len=24, pattern_len=4, runs=1,
                   backend="standard", dummy_weights=True, oracle=False, results_dir=None, log=lambda m: None,
                   acceptance_lengths=(3.0,), widths=("full",), sampling={"temperature": 0.6, "top_p": 0.95})
    (b,) = r["batches"]
    c = {x["label"]: x for x in b["configs"]}
    assert list(c) == ["plain", "plain sampled", "ngram k=3", "synthetic 3 k=3 full", "synthetic 3 k=3 full sampled"]
    ps, g, s = c["plain sampled"], c["synthetic 3 k=3 full"], c["synthetic 3 k=3 full sampled"]
    assert ps["sampled"] and ps["draft_tokens"] == 0 and s["sampled"] and not g["sampled"]
    assert s["draft_tokens"] > 0 and abs(s["accepted_tokens"] / (s["draft_tokens"] / 3) + 1 - 3.0) < 0.4
    assert s["speedup_vs_plain"] == pytest.approx(s["effective_tok_s_user"] / ps["effective_tok_s_user"])
    assert s["vs_greedy_speedup"] == pytest.approx(s["speedup_vs_plain"] / g["speedup_vs_plain"])
    assert r["config"]["sampling"] == {"temperature": 0.6, "top_p": 0.95}


# ---- sampled requests speculate (#42 item 4) ----
def test_sampled_requests_speculate_and_keep_their_tokens():
    """Seeded sampled requests (temperature, top-p, top-k) get drafts: with a drafter proposing the plain sampled
    continuation with its j-th token wrong, exactly min(j, drafts) are accepted a verify and the outputs equal plain
    sampling's token for token (draws keyed by seed and position); a logprobs request rides along undrafted."""
    ps = repetitive(6)
    params = [greedy(20, temperature=0.9, seed=11), greedy(20, temperature=0.7, top_p=0.8, top_k=20, seed=12),
              greedy(20, temperature=1.0, seed=13, logprobs=2)]
    want = tiny().generate(ps, params)
    e = tiny(NGRAM)
    dr = ScriptedDrafter({tuple(p): w for p, w in zip(ps[:2], want[:2])}, [1, 3, 0, 2], 320)
    e.enable_speculation(NGRAM, drafter=dr)
    assert e.generate(ps, params) == want
    st = e.stats["spec"]
    assert st["num_drafts"] == dr.n > 0 and st["num_accepted_tokens"] == dr.expected > 0


def _device_draw_run(params, prompts, want, monkeypatch):
    """A speculative run on the standard runner with its device draws forced on (under the interpreter here; on
    by itself on one GPU) and scripted drafts of `want`: (tokens, each verify step's (B, T, rows of its
    StepInput.sampling or None), the sampled rows the host drew after a verify step (_draw_sampled))."""
    from peregrine.speculative.decoder import SpecDecoder
    e = tiny(NGRAM)
    e.runner.device_sampler = e.device_sampling = True
    host, seen = [], []
    real = SpecDecoder._draw_sampled
    monkeypatch.setattr(SpecDecoder, "_draw_sampled", lambda *a: (lambda d: host.append(len(d)) or d)(real(*a)))
    fwd = e.runner.forward
    e.runner.forward = lambda st: (st.spec_tokens and seen.append(
        (st.num_seqs, st.spec_tokens, None if st.sampling is None else [int(x.shape[0]) for x in st.sampling]))) or fwd(st)
    dr = ScriptedDrafter({tuple(p): w for p, w in zip(prompts, want)}, [1, 3, 0, 2], 320)
    e.enable_speculation(NGRAM, drafter=dr)
    got = e.generate(prompts, params)
    st = e.stats["spec"]
    assert st["num_drafts"] == dr.n > 0 and st["num_accepted_tokens"] == dr.expected > 0
    return got, seen, [n for n in host if n]


def test_verify_steps_draw_sampled_rows_on_the_device(monkeypatch):
    """#57: where the runner draws on the device, a pure verify step whose rows all speculate carries their
    settings a row per token (StepInput.sampling, B·T rows) and the runner draws every position's token in the
    step, keyed by (seed, position), so no sampled row is drawn on the host after it (_draw_sampled): the outputs
    equal plain sampling's token for token. A batch with a logprobs or penalised row (undrafted, drawn on the host
    from its first position) keeps the host draws after the step, with the same tokens, and once those rows have
    finished the others' verify steps draw on the device again."""
    ps = repetitive(8)
    params = [greedy(20, temperature=0.9, seed=11), greedy(20, temperature=0.7, top_p=0.8, top_k=20, seed=12),
              greedy(20)]
    want = tiny().generate(ps, params)
    got, seen, host = _device_draw_run(params, ps, want, monkeypatch)
    assert got == want and not host
    assert seen and all(rows == [B * T] * 5 for B, T, rows in seen), seen
    mixed = [greedy(40, temperature=0.9, seed=11), greedy(6, temperature=1.0, seed=13, logprobs=2),
             greedy(8, temperature=0.8, seed=14, repetition_penalty=1.3)]
    want = tiny().generate(ps, mixed)
    got, seen, host = _device_draw_run(mixed, ps, want, monkeypatch)
    assert got == want and host
    assert any(rows is None for _, _, rows in seen) and any(rows is not None for _, _, rows in seen), seen
    assert all(rows is None for B, _, rows in seen if B > 1) and all(rows == [T] * 5 for B, T, rows in seen if rows)


def test_synthetic_acceptance_with_sampled_rows_drawn_on_the_device(monkeypatch):
    """bench spec --temperature's synthetic runs: sampled rows verify their whole room and accept the drawn count,
    the token after the accepted drafts drawn inside the verify step: the same outputs and acceptance as with the
    draws on the host after the step."""
    from peregrine.speculative.decoder import SpecDecoder
    real = SpecDecoder._draw_sampled
    host = []
    monkeypatch.setattr(SpecDecoder, "_draw_sampled", lambda *a: (lambda d: host.append(len(d)) or d)(real(*a)))
    params = [greedy(24, temperature=0.6, top_p=0.95, seed=s) for s in (1, 2)] + [greedy(24)]
    runs = {}
    for device in (False, True):
        e = tiny(dict(SYNTH, num_speculative_tokens=3, synthetic_acceptance_length=2.5))
        e.runner.device_sampler = e.device_sampling = device
        host.clear()
        outs = e.generate([[5, 6, 7], [1, 2], [9] * 6], params)
        runs[device] = (outs, {k: e.stats["spec"][k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")})
        assert any(host) != device
    assert runs[True] == runs[False]
    assert [len(o) for o in runs[True][0]] == [24] * 3 and runs[True][1]["num_accepted_tokens"] > 0


def test_speculative_sampling_rule_matches_its_definition():
    """The rule on one row of a small vocabulary over 20 000 seeds: a draft x is accepted with probability
    min(1, p(x) / q(x)) = p(x) (q one-hot), and a rejected position's token follows the residual (p - q)+
    normalised, p being softmax(logits / T) written here in FP64 (chi-square, 7 degrees of freedom)."""
    from peregrine.engine.sampling import sample
    V, T, n, x = 8, 0.8, 20_000, 2
    logits = torch.tensor([1.0, 0.2, 1.4, -0.5, 0.9, 0.0, -1.2, 0.6])
    p = torch.softmax(logits.double() / T, -1)
    toks = sample(logits.repeat(n, 1), [greedy(1, temperature=T)] * n, list(range(n)), [100] * n)
    acc = sum(t == x for t in toks)
    assert abs(acc / n - p[x]) < 4 * (p[x] * (1 - p[x]) / n) ** 0.5
    rej = [t for t in toks if t != x]
    resid = p.clone()
    resid[x] = 0
    resid /= resid.sum()
    counts = torch.bincount(torch.tensor(rej), minlength=V).double()
    expected = resid * len(rej)
    keep = expected > 0
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert counts[x] == 0 and chi2 < 24.3  # chi-square 0.999 quantile, 6 degrees of freedom


def test_width_chooser_learns_the_host_side_excess():
    """The table times graph replays only; observed steps that take longer (drafting, read-back, rollback) raise
    what the chooser counts for their kind, so a width that paid on the table stops being chosen."""
    from peregrine.speculative.decoder import SpecDecoder
    from peregrine.speculative.width import choose_width
    d = SpecDecoder.__new__(SpecDecoder)
    d.costs = {2: {1: 3.0, 2: 3.3, 3: 3.6}}
    d.reset_excess()
    surv = [[0.5, 0.25]] * 2
    # table: 2 / 3.0 = 0.667 against 3 / 3.3 = 0.909 and 3.5 / 3.6 = 0.972 -> width 2
    assert choose_width(surv, d.effective_costs(2)) == 2
    for _ in range(60):
        d.observe(2, 3, 6.6)   # verify steps take 3 ms more than their replay
        d.observe(2, 1, 3.1)   # plain ones 0.1 ms more
    assert abs(d.excess["verify"] - 3.0) < 0.01 and abs(d.excess["plain"] - 0.1) < 0.01
    # now 2 / 3.1 = 0.645 against 3 / 6.3 = 0.476 and 3.5 / 6.6 = 0.530 -> plain
    assert choose_width(surv, d.effective_costs(2)) == 0
    d.observe(5, 2, 9.0)  # a B without a table row changes nothing
    assert d.effective_costs(5) is None and abs(d.excess["verify"] - 3.0) < 0.01


def test_one_slow_step_does_not_turn_the_width_chooser_to_plain_for_good():
    """A new turn's first propose (a trie built over the context) once took 0.3 s inside one verify step: in a
    running mean that made verifies look ~30 ms dearer and the chooser kept to plain steps, which never measured a
    verify again (600 steps in a row on the 48B replay). The median ignores the one step; and verify steps not seen
    for EXCESS_STALE steps are judged by the plain steps' excess."""
    from peregrine.speculative.decoder import EXCESS_STALE, SpecDecoder
    from peregrine.speculative.width import choose_width
    d = SpecDecoder.__new__(SpecDecoder)
    d.costs = {1: {1: 3.0, 2: 3.5, 3: 4.0}}
    d.reset_excess()
    surv = [[0.9, 0.8]]
    for _ in range(5):
        d.observe(1, 3, 4.2)
        d.observe(1, 1, 3.1)
    d.observe(1, 3, 300.0)  # the slow step
    assert abs(d.excess["verify"] - 0.2) < 1e-9 and choose_width(surv, d.effective_costs(1)) == 2
    for _ in range(8):  # slow verifies for real now: plain wins ...
        d.observe(1, 3, 40.0)
    assert d.excess["verify"] == 36.0 and choose_width(surv, d.effective_costs(1)) == 0
    for _ in range(EXCESS_STALE):  # ... until they are old: then verifies are judged at the plain steps' excess
        d.observe(1, 1, 3.1)
    assert abs(d.excess["verify"] - 0.1) < 1e-9 and choose_width(surv, d.effective_costs(1)) == 2


def test_a_stale_plain_excess_is_measured_again():
    """Session 31 (48B, B = 8, acceptance 1.5): eager steps recording routing had left the plain excess ~10 ms high,
    so the chooser verified T = 2 on every step (0.84x plain), though its table said plain pays, and verify steps
    never measure a plain one again. Once the plain steps seen are EXCESS_STALE steps old the chooser takes a plain
    step, and from then on judges plain steps by what that one cost."""
    from peregrine.speculative.decoder import EXCESS_STALE, SpecDecoder
    from peregrine.speculative.width import choose_width
    d = SpecDecoder.__new__(SpecDecoder)
    d.costs = {8: {1: 5.73, 2: 9.11}}
    d.reset_excess()
    surv = [[0.5]] * 8
    for _ in range(15):
        d.observe(8, 1, 16.0)  # the outlier: +10.3 ms a plain step
    assert not d.plain_stale() and choose_width(surv, d.effective_costs(8)) == 1  # 12 / 19.4 > 8 / 16.0
    for _ in range(EXCESS_STALE):
        d.observe(8, 2, 10.58)  # verifies at their real cost
    assert d.plain_stale()  # the plain steps seen are all too old: the next step is plain
    d.observe(8, 1, 5.92)  # that plain step
    assert not d.plain_stale() and abs(d.excess["plain"] - 0.19) < 1e-9
    assert choose_width(surv, d.effective_costs(8)) == 0  # 8 / 5.92 = 1.35 against 12 / 10.58 = 1.13


def test_the_engine_explores_a_plain_step_when_its_excess_is_stale():
    """In the engine: with the plain steps seen all stale and verifies chosen, one plain step is taken and counted
    (width_explore_steps), and greedy output stays the plain engine's."""
    from peregrine.speculative.decoder import EXCESS_STALE
    ps = repetitive(4)
    want = tiny().generate(ps, greedy(24))
    e = tiny(NGRAM)
    e.enable_speculation(NGRAM, drafter=ScriptedDrafter({tuple(p): w for p, w in zip(ps, want)}, [1, 3], 320))
    e.spec.costs = {B: {1: 1e3, 2: 1e-3, 3: 1e-3, 4: 1e-3} for B in range(1, 5)}  # plain looks dear: verify
    e.spec.excess_seen["plain"].append((-EXCESS_STALE, 0.0))  # one plain step seen, long ago
    real = e.spec.observe
    e.spec.observe = lambda B, T, ms: T > 1 and real(B, T, ms)  # plain steps never seen again: it stays stale
    assert e.spec.plain_stale()
    assert e.generate(ps, greedy(24)) == want
    st = e.spec.stats
    assert st["width_explore_steps"] >= 1 and st["width_steps"][0] >= st["width_explore_steps"]
    assert sum(st["width_steps"][1:]) == 0  # each verify the table asked for became a plain step


def _watched_chooser():
    """An n-gram engine with a 1 us cost table injected, and the (B, T) of every step its chooser observes."""
    e = tiny(NGRAM)
    e.spec.costs = {B: {1: 1e-3, 2: 1e-3, 3: 1e-3, 4: 1e-3} for B in range(1, 5)}
    seen = []
    real = e.spec.observe
    e.spec.observe = lambda B, T, ms: seen.append((B, T)) or real(B, T, ms)
    return e, seen


def test_steps_recording_routing_do_not_teach_the_width_chooser():
    """Benchmarks record routing with eager steps (no graphs): far slower than the table, they must not move the
    chooser's excess."""
    ps = repetitive(4)
    e, seen = _watched_chooser()
    e.runner.record_routing = True
    try:
        e.generate(ps, greedy(8))
    finally:
        e.runner.record_routing = False
    assert seen == []
    e.generate(ps, greedy(8))
    assert seen  # the same steps without recording do


def test_engine_feeds_the_width_chooser_its_step_times():
    """Each pure decode step's wall time reaches observe: on this CPU every step takes far longer than the 1 ms
    injected for a plain step, so the plain excess grows above zero."""
    ps = repetitive(4)
    e, seen = _watched_chooser()
    e.generate(ps, greedy(8))
    assert seen and all(B == 3 for B, _ in seen) and e.spec.excess["plain"] + e.spec.excess["verify"] > 0


def test_the_cost_table_is_timed_with_a_different_token_in_every_row():
    """A verify step's MoE reads the union of the experts its rows route to; scratch replays with the capture's
    tokens (alike in every row) read top-k experts whatever T is: the table asks for distinct tokens."""
    from types import SimpleNamespace

    from peregrine.speculative.decoder import SpecDecoder
    calls = []

    class Runner:
        def graph_replay_time(self, B, iters, T=1, distinct=False):
            calls.append((B, T, distinct))
            return 1.0 + T + (10.0 if distinct else 0.0)
    d = SpecDecoder.__new__(SpecDecoder)
    d.costs, d.width_mode, d.k = {}, "auto", 2
    d.engine = SimpleNamespace(runner=Runner(), engine_cfg=SimpleNamespace(max_num_seqs=2))
    d.measure_costs(log=lambda m: None)
    assert sorted(calls) == [(B, T, True) for B in (1, 2) for T in (1, 2, 3)]
    assert d.costs == {B: {1: 12.0, 2: 13.0, 3: 14.0} for B in (1, 2)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1",
                    reason="verify graphs need a GPU")
def test_distinct_token_replays_feed_the_verify_graph_a_different_token_a_row():
    e, _ = build_engine("tiny-kimi-linear", EngineConfig(max_num_seqs=2, decode_backend="latency_specialized",
                                                        speculative_config={"method": "ngram",
                                                                            "num_speculative_tokens": 3}),
                        dummy_weights=True, log=lambda m: None)
    g = e.runner.verify_graphs[4]
    assert e.runner.graph_replay_time(1, 3, T=4, distinct=True) is not None
    (st,) = [st for key, (_, st, _) in g.graphs.items() if key[0] == 1]
    assert st.input_ids.unique().numel() >= 3  # the rows route as different tokens do (random: a collision at most)
    a = st.input_ids.clone()
    e.runner.graph_replay_time(1, 3, T=4, distinct=True)
    assert torch.equal(st.input_ids, a)  # the same tokens every time: one table per start, reproducible


def test_ngram_lookup_equals_every_window_compared():
    """The lookup searches from the last token's earlier positions, over a buffer appended to per sequence; it must
    propose what comparing every window of every n proposes (written here as the reference)."""
    import random
    from types import SimpleNamespace

    def ref(tokens, k, max_n, min_n):
        L = len(tokens)
        if k <= 0 or L < 2:
            return []
        for n in range(min(max_n, L - 1), min_n - 1, -1):
            hits = [p for p in range(0, L - n) if tokens[p:p + n] == tokens[L - n:]]
            if hits:
                full = [p for p in hits if p + n + k <= L]
                p = full[-1] if full else hits[-1]
                return tokens[p + n:p + n + k]
        return []
    rng = random.Random(3)
    for trial in range(300):
        max_n, min_n = rng.choice([(4, 1), (3, 2), (1, 1), (5, 3)])
        d = NgramDrafter(max_n, min_n)
        seq = SimpleNamespace(token_ids=[rng.randrange(rng.choice([2, 4, 9])) for _ in range(rng.randrange(1, 40))])
        for _ in range(4):  # the sequence grows between proposes, as accepted tokens are appended
            k = rng.randrange(0, 6)
            assert d.propose([seq], [k])[0] == ref(seq.token_ids, k, max_n, min_n), (trial, seq.token_ids, k)
            assert d.lookup(seq.token_ids, k) == ref(seq.token_ids, k, max_n, min_n)
            seq.token_ids += [rng.randrange(4) for _ in range(rng.randrange(0, 80))]
        d.release(seq)
        assert not d.bufs
