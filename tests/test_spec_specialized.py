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
