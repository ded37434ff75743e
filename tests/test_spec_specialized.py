"""Speculative verify on the latency_specialized path (docs/correctness.md §2 "speculative vs plain").

CPU: the fused kernels run under the Triton interpreter on the micro config (no graphs), FP32, so
greedy tokens must be identical. GPU (`pytest -m gpu`): the tiny preset in BF16 with CUDA graphs per
(B, T); a greedy token may then differ only where the plain run's top two logits nearly tie.
"""
import json

import pytest
import torch

from conftest import DEVICE, FULL_SHAPES, dummy_model_dir
from peregrine.config import PRESET_DIR, EngineConfig
from peregrine.engine import SamplingParams
from peregrine.engine.build import build_engine
from peregrine.testing import assert_close
from spec_helpers import ScriptedDrafter, verify_step_outputs
from test_specialized import MICRO

pytestmark = pytest.mark.gpu

TOKENS = 48 if FULL_SHAPES else 8
NEAR_TIE = 3e-2  # BF16: relative gap of the plain run's top-2 logits below which a flip is rounding


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    raw = json.loads((PRESET_DIR / "tiny-kimi-linear.json").read_text())
    if not FULL_SHAPES:
        raw.update(MICRO)
    return dummy_model_dir(tmp_path_factory, raw, "spec_model", seed=5)


def engine(model_dir, backend, spec=None):
    e, _ = build_engine(model_dir, EngineConfig(decode_backend=backend, max_num_seqs=4, max_decode_batch=4,
                                                max_model_len=256, block_size=16, speculative_config=spec),
                        log=lambda m: None)
    return e


def prompts(seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (3,), generator=g).tolist() * 4)[: 5 + 2 * i] for i in range(2)]


def greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("query_rows", ["1", "2", "0"])
def test_verify_step_matches_standard(model_dir, monkeypatch, query_rows):
    """One verify step of T = 3 tokens for 2 sequences, same cache contents: the fused step's logits,
    per-position KDA checkpoints and cache writes equal the standard path's (verify as a short chunk), whichever
    MLA verify layout (PEREGRINE_MLA_VERIFY_ROWS: a row a program, two sharing each latent tile, expanded rows)."""
    from peregrine.decode.specialized import VERIFY_MLA_ENV
    monkeypatch.setenv(VERIFY_MLA_ENV, query_rows)
    std, spec = engine(model_dir, "standard"), engine(model_dir, "latency_specialized")
    assert spec.runner.verify_query_rows == int(query_rows)
    ps = prompts(0)
    for e in (std, spec):
        e.generate(ps, greedy(4))  # real cache contents in slots 0, 1 and blocks 0.., 16..
    spec.cache.state.copy_(std.cache.state)
    spec.cache.conv.copy_(std.cache.conv)
    spec.cache.latent.copy_(std.cache.latent)
    T, c = 3, std.cache
    rows = [([7, 8, 9], 6, 0, [0]), ([1, 2, 3], 9, 1, [16])]
    outs = verify_step_outputs((std, spec), rows, T)
    (l0, ck0, s0, lat0), (l1, ck1, s1, lat1) = outs
    tol = 1e-4 if DEVICE == "cpu" else 3e-2  # relative RMSE: FP32 on CPU, BF16 on the GPU
    assert torch.isfinite(ck1[0]).all() and torch.isfinite(ck1[1].float()).all(), "checkpoint not fully written"
    for a, b, what in ((l0, l1, "logits"), (ck0[0], ck1[0], "state checkpoints"), (ck0[1], ck1[1], "conv checkpoints"),
                       (s0, s1, "state after the step"), (ck1[0][:, :, -1], s1[:, :2], "last checkpoint vs final state"),
                       (lat0, lat1, "MLA cache")):
        assert_close(a.float(), b.float(), tol, what)


SEEDS_K = [(0, 3)] if not FULL_SHAPES else [(s, k) for s in (0, 1, 2) for k in (1, 2, 4)]


@pytest.fixture(scope="module")
def fused(model_dir):
    """One specialized engine for every (seed, k): plain graphs captured once; each test turns
    speculation on (capturing the verify graphs of its k) and off again. Logits of every step recorded."""
    e = engine(model_dir, "latency_specialized")
    e.logits = []
    fwd = e.runner.forward
    e.runner.forward = lambda st: e.logits.append(fwd(st).float().cpu().clone()) or e.logits[-1]
    return e


@pytest.mark.parametrize("seed,k", SEEDS_K)
def test_greedy_equals_plain_with_rollback(fused, seed, k):
    """Scripted drafts (known acceptance, rejections included) through the specialized verify step
    (graphs per (B, T) on the GPU): tokens equal the plain specialized run's."""
    ps, e = prompts(seed), fused
    e.logits.clear()
    want = e.generate(ps, greedy(TOKENS))
    logs = list(e.logits)
    spec_cfg = {"method": "ngram", "num_speculative_tokens": k}
    dr = ScriptedDrafter({tuple(p): w for p, w in zip(ps, want)}, [2, 0, 9, 1], e.model_cfg.vocab_size,
                         strict=DEVICE == "cpu")
    e.enable_speculation(spec_cfg, drafter=dr)  # captures the verify graphs, T = 2 .. k+1, on the GPU
    n0 = e.stats["steps_by_path"]["latency_specialized"]
    try:
        got = e.generate(ps, greedy(TOKENS))
        st = dict(e.stats["spec"])
        graphs = e.runner.verify_graphs
    finally:
        e.enable_speculation(None)
    assert e.stats["steps_by_path"]["latency_specialized"] - n0 >= 2 and st["verify_steps"] >= 2
    if DEVICE == "cpu":
        assert got == want
        assert st["num_accepted_tokens"] == dr.expected
        return
    for r, (a, b) in enumerate(zip(want, got)):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is not None:  # plain step i (step 0 is the prefill) produced token i of every request
            top = logs[i][r].topk(2).values
            assert (top[0] - top[1]) / top[0].abs() < NEAR_TIE, f"request {r} token {i}: not a near tie"
    if graphs:
        used = {T: sum(g.uses.values()) for T, g in graphs.items()}
        assert sum(used.values()) > 0, f"no verify graph replayed: {used}"


class _Intermittent(ScriptedDrafter):
    """Scripted drafts from a host drafter (the engine may ask it ahead of a step) for two outputs in five: the
    steps between are plain ones launched ahead (decode lookahead), then verify steps again."""
    host_only = True

    def propose(self, seqs, ks):
        out = super().propose(seqs, ks)
        return [d if (len(s.token_ids) - s.prompt_len) % 5 < 2 else [] for s, d in zip(seqs, out)]


def test_lookahead_between_verify_steps_keeps_greedy_tokens(fused):
    """Speculation whose drafter falls silent at times: the quiet stretches run as plain steps launched ahead, the
    rest verify, and the tokens equal the plain run's (CPU: identical; GPU: near ties aside)."""
    ps, e = prompts(3), fused
    want = e.generate(ps, greedy(TOKENS + 8))
    dr = _Intermittent({tuple(p): w for p, w in zip(ps, want)}, [2, 0, 9, 1], e.model_cfg.vocab_size,
                       strict=False)
    e.enable_speculation({"method": "ngram", "num_speculative_tokens": 2}, drafter=dr)
    la0 = e.stats["lookahead_steps"]
    try:
        got = e.generate(ps, greedy(TOKENS + 8))
        st = dict(e.stats["spec"])
    finally:
        e.enable_speculation(None)
    assert st["verify_steps"] >= 2 and e.stats["lookahead_steps"] - la0 >= 2
    if DEVICE == "cpu":
        assert got == want


SAMPLED = {  # a sampled row beside a greedy one; two sampled rows, one with top-k (the sampler's top-k levels)
    "top_p+greedy": [dict(temperature=0.8, top_p=0.9, seed=3), dict()],
    "top_k+min_p": [dict(temperature=0.7, top_k=20, seed=4), dict(temperature=1.0, min_p=0.05, seed=5)],
}


def _sampled_run(e, ps, params, want, k, monkeypatch, device: bool = True):
    """Speculative run of `params` with scripted drafts of `want` (rejections included) -> (tokens, the verify
    steps' (B, T, rows of step.sampling or None), stats). device: the verify steps must draw on the device
    (SpecDecoder._draw_sampled, the host path, raises)."""
    from peregrine.speculative.decoder import SpecDecoder
    if device:
        real = SpecDecoder._draw_sampled

        def host(*a, **kw):
            drawn = real(*a, **kw)
            assert not drawn, "a sampled verify row was drawn on the host"
            return drawn
        monkeypatch.setattr(SpecDecoder, "_draw_sampled", host)
    seen = []
    fwd = e.runner.forward

    def forward(st):
        if st.spec_tokens:
            seen.append((st.num_seqs, st.spec_tokens, None if st.sampling is None else
                         [int(x.shape[0]) for x in st.sampling]))
        return fwd(st)
    dr = ScriptedDrafter({tuple(p): w for p, w in zip(ps, want)}, [2, 0, 9, 1], e.model_cfg.vocab_size,
                         strict=DEVICE == "cpu")
    e.enable_speculation({"method": "ngram", "num_speculative_tokens": k}, drafter=dr)
    e.runner.forward = forward
    try:
        got = e.generate(ps, params)
        st = dict(e.stats["spec"])
    finally:
        e.runner.forward = fwd
        monkeypatch.undo()
    return got, seen, st, dr


@pytest.mark.parametrize("which", list(SAMPLED))
def test_sampled_rows_are_drawn_inside_the_verify_step(fused, which, monkeypatch):
    """#57: a verify step of sampled requests carries their settings a row per token (StepInput.sampling, B·T
    rows) and the runner draws every position's token in the step, keyed by (seed, position), as a plain step
    draws its token: the host draw after the step (SpecDecoder._draw_sampled) is never called, and the outputs
    equal plain sampling's token for token (CPU, FP32). On the GPU each (B, T)'s sampled verify graph is captured
    when speculation is enabled and replayed, and the tokens equal the same run's with the draws on the host
    (the greedy verify graph's logits, _draw_sampled): bitwise, the logits being the same kernels'."""
    e, k = fused, 3
    ps = prompts(7)
    params = [SamplingParams(max_tokens=TOKENS, ignore_eos=True, **kw) for kw in SAMPLED[which]]
    want = e.generate(ps, params)  # plain sampling: drawn inside the plain step (its sampled graph on the GPU)
    assert e.device_sampling
    graphs = None
    try:
        got, seen, st, dr = _sampled_run(e, ps, params, want, k, monkeypatch)
        graphs = e.runner.verify_graphs
        if graphs:  # captured at enable: every (B, T) has its sampled graph (top-k's: at first use)
            for T, g in graphs.items():
                assert {(B, g.fixed_blocks, "sampled") for B in range(1, g.max_batch + 1)} <= set(g.graphs), T
            used = sum(n for g in graphs.values() for key, n in g.uses.items() if "sampled" in key)
            assert used > 0, {T: g.uses for T, g in graphs.items()}
    finally:
        e.enable_speculation(None)
    assert seen and st["verify_steps"] >= 2 and st["num_accepted_tokens"] > 0
    # a row per token in every verify step with a sampled row (a greedy row left alone: none)
    assert all(rows in (None, [B * T] * 5) for B, T, rows in seen) and seen[0][2] is not None, seen
    assert all(rows is not None for _, _, rows in seen) or any(not p.temperature for p in params), seen
    if DEVICE == "cpu":
        assert got == want
        assert st["num_accepted_tokens"] == dr.expected
        return
    e.device_sampling = False  # the same run, the sampled rows drawn on the host after the greedy verify graph
    try:
        host, host_seen, _, _ = _sampled_run(e, ps, params, want, k, monkeypatch, device=False)
    finally:
        e.device_sampling = True
        e.enable_speculation(None)
    assert all(rows is None for _, _, rows in host_seen)
    assert got == host


@pytest.mark.skipif(DEVICE != "cpu", reason="the GPU captures real graphs (test_sampled_rows_are_drawn_inside_the_verify_step)")
def test_sampled_verify_graphs_are_captured_at_enable_and_replayed(model_dir, monkeypatch):
    """The sampled verify graphs' plumbing without a GPU, a graph emulated by running its step again on the static
    inputs it was captured on and copying the results into the captured outputs: enable_speculation captures each
    (B, T)'s sampled verify graph beside the greedy one, its sampling buffers a row per token (B·T); a verify step
    of sampled requests takes the graph key with "sampled", that graph is replayed (the step's settings and
    positions copied into its buffers) and its tokens are plain sampling's."""
    import types

    import peregrine.decode.standard as standard

    def capture(fn, pool):
        out = fn()

        @torch.inference_mode()  # the outputs are inference tensors, as a real graph's
        def replay():
            for o, n in zip(out, fn()):
                o.copy_(n)
        return types.SimpleNamespace(replay=replay), out
    monkeypatch.setattr(standard, "capture", capture)
    for name, fake in (("graph_pool_handle", lambda: None), ("synchronize", lambda: None),
                       ("memory_allocated", lambda: 0)):
        monkeypatch.setattr(torch.cuda, name, fake)
    e, _ = build_engine(model_dir, EngineConfig(decode_backend="latency_specialized", max_num_seqs=2, max_decode_batch=2,
                                                max_model_len=256, block_size=16), log=lambda m: None)
    ps = prompts(8)
    params = [SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0.9, top_p=0.95, seed=6),
              SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0.6, seed=7)]
    want = e.generate(ps, params)  # plain sampling (eager: no plain graphs here)
    e.runner._graph_args = (True, e.runner._graph_args[1])  # verify graphs "on the GPU"
    from peregrine.speculative.decoder import SpecDecoder
    real = SpecDecoder._draw_sampled
    monkeypatch.setattr(SpecDecoder, "_draw_sampled",
                        lambda *a: (lambda d: d if not d else pytest.fail("drawn on the host"))(real(*a)))
    dr = ScriptedDrafter({tuple(p): w for p, w in zip(ps, want)}, [2, 0, 9, 1], e.model_cfg.vocab_size)
    e.enable_speculation({"method": "ngram", "num_speculative_tokens": 2}, drafter=dr)
    graphs = e.runner.verify_graphs
    assert sorted(graphs) == [2, 3]
    for T, g in graphs.items():
        nb = g.fixed_blocks
        assert set(g.graphs) == {(B, nb) for B in (1, 2)} | {(B, nb, "sampled") for B in (1, 2)}, T
        for B in (1, 2):
            assert g.graphs[(B, nb)][1].sampling is None
            assert [x.shape[0] for x in g.graphs[(B, nb, "sampled")][1].sampling] == [B * T] * 5
    assert e.generate(ps, params) == want
    st = e.stats["spec"]
    assert st["verify_steps"] >= 2 and st["num_accepted_tokens"] == dr.expected > 0
    used = {(T, key): n for T, g in graphs.items() for key, n in g.uses.items()}
    assert any("sampled" in key for _, key in used) and all(len(key) == 3 for _, key in used), used
