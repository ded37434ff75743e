"""Prefill graphs (decode/prefill_graphs.py): a prefill step's token-parallel segments over static,
padded buffers, the attention cores eager between them. On the CPU the segments run eagerly over the
same buffers and padding (capture=False); on the GPU they are captured and replayed. Either way the
tokens, logits and caches must be those of the plain forward, and rows past a step's tokens (padding,
stale rows of earlier steps) must never reach its rows."""
from __future__ import annotations

import pytest
import torch

from peregrine.decode.batch import StepInput
from peregrine.decode.prefill_graphs import PrefillGraphs
from peregrine.engine import SamplingParams
from peregrine.testing import rel_rmse
from test_model import BS, new_cache, tiny
from test_prefill import engine

BUCKETS = (16, 32, 64, 128)  # tiny steps pad: 37 tokens run in the 64 bucket


def with_graphs(e, capture=False, buckets=BUCKETS):
    e.runner.prefill = PrefillGraphs(e.runner.model, e.cache, e.engine_cfg.max_num_batched_tokens,
                                     capture=capture, buckets=buckets)
    return e


def poison_padding(pg: PrefillGraphs) -> None:
    """NaN in every float buffer row (the step then fills its own rows): padded rows stay NaN."""
    with torch.inference_mode():  # (the buffers are inference tensors)
        for t in [*pg.buf["x"], *pg.buf["o"].values(), *(u for v in pg.buf["pre"].values() for p in v for u in p)]:
            if t is not None and t.is_floating_point():
                t.fill_(float("nan"))


def test_segments_over_padded_buffers_equal_the_plain_forward():
    """One model, one cache layout: two prefill chunks (the second after a cached prefix, 37 tokens padded
    to 64) and a mixed step (a decode row beside a 21-token row); logits, KDA states, conv windows and
    MLA entries equal the plain forward's, with NaN in every row the step does not own."""
    cfg, m = tiny()
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, cfg.vocab_size, (100,), generator=g).tolist()
    b = torch.randint(0, cfg.vocab_size, (21,), generator=g).tolist()
    table_a, table_b = list(range(0, 26)), list(range(26, 32))
    steps = [[(a[:63], 0, 0, table_a)], [(a[63:100], 63, 0, table_a)],
             [([a[50]], 100, 0, table_a), (b, 0, 1, table_b)]]
    res = []
    for graphed in (False, True):
        c = new_cache(cfg, blocks=33)
        pg = PrefillGraphs(m, c, 128, capture=False, buckets=BUCKETS)
        out = []
        for seqs in steps:
            step = StepInput.build(seqs, BS, "cpu")
            if graphed and pg.buf is not None:
                poison_padding(pg)
            with torch.inference_mode():
                logits = [x for x in pg.run(step)][-1] if graphed else m(step, c)
            out.append(logits)
        assert graphed == (pg.buf is not None)
        res.append((out, c.state.clone(), c.conv.clone(), c.latent.clone()))
    (lp, sp, cp, mp), (lg, sg, cg, mg) = res
    for x, y in zip(lp, lg):
        assert not y.isnan().any() and rel_rmse(y, x) < 1e-5
    # (not bitwise: a GEMM over the padded rows may round a row differently from one over the step's rows)
    assert rel_rmse(sg, sp) < 1e-5 and rel_rmse(cg, cp) < 1e-5 and rel_rmse(mg, mp) < 1e-5


def test_pieces_over_the_buffers_yield_per_group_of_layers():
    """run(step, 2) over tiny-kimi-linear's 5 layers: None after layers 2 and 4, then the logits."""
    cfg, m = tiny()
    c = new_cache(cfg, blocks=12)
    pg = PrefillGraphs(m, c, 64, capture=False, buckets=BUCKETS)
    toks = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        out = list(pg.run(StepInput.build([(toks, 0, 0, list(range(10)))], BS, "cpu"), 2))
    assert [o is None for o in out] == [True, True, False] and out[-1].shape == (1, cfg.vocab_size)


@pytest.mark.parametrize("pieces", [0, 2])
def test_engine_with_segment_buffers_gives_the_plain_engines_tokens(pieces):
    """Two requests through the engine (prefix hit, a chunk beside a decode, with and without prefill
    pieces): the same greedy tokens with the segments over padded buffers as with the plain forward."""
    g = torch.Generator().manual_seed(9)
    a = torch.randint(0, 320, (70,), generator=g).tolist()
    b = a[:66] + torch.randint(0, 320, (90,), generator=g).tolist()  # hits a's 64 (its last block end)
    kw = dict(max_num_batched_tokens=128, max_prefill_tokens_while_decoding=48, prefill_piece_layers=pieces)
    outs = []
    for graphed in (False, True):
        e = engine(True, **kw)
        if graphed:
            with_graphs(e)
        e.add_request(a, SamplingParams(max_tokens=12, ignore_eos=True), request_id="a")
        toks = {"a": e.step()[0].new_token_ids, "b": []}
        e.add_request(b, SamplingParams(max_tokens=12, ignore_eos=True), request_id="b")
        for _ in range(200):
            if not e.has_unfinished():
                break
            for o in e.step():
                toks[o.request_id] += o.new_token_ids
        if graphed:
            assert e.runner.prefill.buf is not None  # the segments served the prefill steps
        assert e.prefix_cache.stats["hit_tokens"] == 64
        outs.append(toks)
    assert outs[0] == outs[1] and len(outs[0]["a"]) == len(outs[0]["b"]) == 12


def test_warm_up_runs_every_bucket_on_scratch_and_leaves_live_state_alone():
    """warm_up: a dummy prefill per bucket over the scratch slot and block; the live slots' KDA state
    and the live blocks' MLA entries are untouched, the buffers cleared, and a step after it is exact."""
    cfg, m = tiny()
    c = new_cache(cfg, blocks=40)
    g = torch.Generator().manual_seed(8)
    with torch.inference_mode():
        c.state[:, :c.scratch_slot].normal_(generator=g)
        c.latent[:, :c.scratch_block].normal_(generator=g)
    live = c.state[:, :c.scratch_slot].clone(), c.latent[:, :c.scratch_block].clone()
    pg = PrefillGraphs(m, c, 64, capture=False, buckets=BUCKETS)
    pg.warm_up()
    assert torch.equal(c.state[:, :c.scratch_slot], live[0]) and torch.equal(c.latent[:, :c.scratch_block], live[1])
    assert all(not t.any() for t in pg.buf["x"])
    toks = torch.randint(0, cfg.vocab_size, (50,), generator=g).tolist()
    step = lambda: StepInput.build([(toks, 0, 1, list(range(13)))], BS, "cpu")  # noqa: E731
    with torch.inference_mode():
        c.state[:, 1].zero_()  # a fresh sequence in slot 1, twice
        got = list(pg.run(step()))[-1]
        c.state[:, 1].zero_()
        c.conv[:, 1].zero_()
        want = m(step(), c)
    assert rel_rmse(got, want) < 1e-5


def test_warm_up_runs_two_long_rows_in_one_step(monkeypatch):
    """warm_up also runs steps of two rows longer than the KDA row kernel takes (of 2·n and 2·n - 1
    tokens), so fla's varlen kernels, which such rows share on the GPU, are compiled at start-up; budgets
    too small to hold two such rows skip them."""
    from peregrine.models.kda import SHORT_ROW_MAX_TOKENS
    cfg, m = tiny()
    seen = []
    for budget, buckets in ((600, BUCKETS + (256, 512, 1024)), (64, BUCKETS)):
        pg = PrefillGraphs(m, new_cache(cfg, blocks=40), budget, capture=False, buckets=buckets)
        real = pg.run
        monkeypatch.setattr(pg, "run", lambda step, *a: seen.append(list(step.q_lens)) or real(step, *a))
        pg.warm_up()
        long = [q for q in seen if len(q) == 2 and min(q) > SHORT_ROW_MAX_TOKENS]
        assert len(long) == (2 if budget == 600 else 0), seen
        assert sorted(sum(q) % 16 == 0 for q in long) == ([False, True] if long else []), seen  # Triton specializes
        seen.clear()


def test_warm_up_runs_the_kda_row_kernel_over_one_token(monkeypatch):
    """warm_up splits a short row one token before its end, as a snapshot at P - 1 does, so the KDA row
    kernel runs (and Triton compiles its T = 1 specialization) at start-up, not at such a prompt's step;
    the cut takes no snapshot and leaves every live slot alone."""
    import peregrine.kernels.kda as kk
    import peregrine.models.kda as mk
    monkeypatch.setattr(mk, "SHORT_ROWS_KERNEL", True)  # the GPU's choice for short rows
    lens = []  # what the warm-up launches is the question here, not the kernel's math (tests/test_kernels_kda.py):
    #   the stand-in records the segment length and writes zeros (the interpreter's kernel: ~80 s for this warm-up)
    monkeypatch.setattr(kk, "kda_decode", lambda qkv, *a, out, **k: lens.append(qkv.shape[1]) or out.zero_())
    cfg, m = tiny()
    c = new_cache(cfg, blocks=40)
    snaps = c.snap_state.clone(), c.snap_conv.clone()
    live = c.state[:, :c.scratch_slot].clone()
    PrefillGraphs(m, c, 16, capture=False, buckets=BUCKETS).warm_up()
    assert 1 in lens and 15 in lens, lens  # the 16-token bucket's row as 15 + 1
    assert torch.equal(c.snap_state, snaps[0]) and torch.equal(c.snap_conv, snaps[1])
    assert torch.equal(c.state[:, :c.scratch_slot], live)


def test_steps_past_the_largest_bucket_and_decode_steps_are_not_served():
    cfg, m = tiny()
    pg = PrefillGraphs(m, new_cache(cfg, blocks=40), 100, capture=False, buckets=BUCKETS)
    assert pg.buckets == [16, 32, 64, 128] and pg.bucket(65) == 128 and pg.bucket(129) is None
    long = StepInput.build([(list(range(129)), 0, 0, list(range(33)))], BS, "cpu")
    dec = StepInput.build([([1], 5, 0, [0, 1])], BS, "cpu")
    assert not pg.serves(long) and not pg.serves(dec)
    assert pg.serves(StepInput.build([(list(range(65)), 0, 0, list(range(17)))], BS, "cpu"))


cuda = pytest.mark.skipif(not torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1",
                          reason="needs a CUDA GPU")


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("pieces", [0, 2])
def test_gpu_captured_prefill_equals_eager(pieces):
    """BF16 on the GPU: the engine with captured prefill graphs against the same engine eager (prefill
    graphs off): identical greedy tokens, and the graphs were replayed."""
    from peregrine.config import EngineConfig
    from peregrine.engine.build import build_engine
    g = torch.Generator().manual_seed(4)
    a = torch.randint(0, 320, (300,), generator=g).tolist()
    b = a[:200] + torch.randint(0, 320, (77,), generator=g).tolist()
    outs = []
    for graphs in (False, True):
        ecfg = EngineConfig(device="cuda", dtype="bf16", max_num_seqs=2, max_model_len=512, block_size=16,
                            max_num_batched_tokens=256, max_prefill_tokens_while_decoding=64,
                            prefill_piece_layers=pieces, prefill_graphs=graphs)
        e, _ = build_engine("tiny-kimi-linear", ecfg, dummy_weights=True, log=lambda m: None)
        assert (e.runner.prefill is not None) == graphs
        if graphs and pieces:  # the server's start-up capture (the other case captures at first use)
            e.runner.prefill.warm_up()
            assert len(e.runner.prefill.graphs) == len(e.runner.prefill.buckets) * (len(e.runner.model.layers) + 1)
        toks = e.generate([a, b], SamplingParams(max_tokens=16, ignore_eos=True))
        if graphs:
            pg = e.runner.prefill
            assert pg.replays > 0 and pg.broken is None and pg.graphs
        outs.append(toks)
    assert outs[0] == outs[1]


@cuda
@pytest.mark.gpu
def test_gpu_ttft_breakdown_sees_every_layer_type_with_prefill_graphs_on():
    """bench ttft's per-layer-type breakdown runs its timed prefill eagerly (a replayed graph calls no
    module hook): with prefill graphs on, each layer type still gets its time, no more than the prefill's
    own, the graphs are back on afterwards, and the graphed time of the same length is reported beside it."""
    from peregrine.bench.gpu import copy_bandwidth
    from peregrine.bench.ttft import breakdown
    from peregrine.config import EngineConfig
    from peregrine.engine.build import build_engine
    ecfg = EngineConfig(device="cuda", dtype="bf16", max_num_seqs=2, max_model_len=512, block_size=16,
                        max_num_batched_tokens=256)
    e, _ = build_engine("tiny-kimi-linear", ecfg, dummy_weights=True, log=lambda m: None)
    pg = e.runner.prefill
    assert pg is not None
    b = breakdown(e, 300, copy_bandwidth()["gbps"], seed=3)
    assert all(b["types"][k]["ms"] > 0 for k in ("kda", "mla", "moe")), b["types"]
    timed = sum(v["ms"] for k, v in b["types"].items() if k != "other")
    assert timed <= b["total_ms"], (timed, b["total_ms"])  # one timed prefill, counted once (no warm-up in it)
    assert b["graphed_ms"] > 0 and b["graphs_serve"] and e.runner.prefill is pg and pg.replays > 0
