"""Prefill for agent-size prompts: KDA snapshots taken inside a chunk, prefix-cache hit == miss on the
real (tiny) model, and on the GPU the fast kernels (fla's chunk_kda) against the recurrent reference."""
from __future__ import annotations

import pytest
import torch

from peregrine.config import EngineConfig
from peregrine.decode.batch import StepInput
from peregrine.engine import SamplingParams
from peregrine.engine.build import build_engine
from peregrine.testing import rel_rmse
from test_model import BS, decode_all, new_cache, run, tiny

LM_HEAD_SCALE = 4.0  # dummy logits sharpened: confident greedy choices, as a trained model makes


@pytest.fixture(scope="module")
def model():
    return tiny()


def test_in_chunk_snapshots_equal_the_state_at_that_position(model):
    """One 150-token chunk that snapshots after 64, 101 and 149 tokens: each snapshot equals the state
    (and conv window) of a prefill that stopped there, and the chunk's end state is unchanged."""
    cfg, m = model
    T = 150
    toks = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(5)).tolist()
    table = list(range(T // BS + 1))
    cuts = [64, 101, 149]
    a = new_cache(cfg, blocks=len(table) + 1)
    a.snap_state = torch.full((len(cfg.kda_layers), 3, *a.state.shape[2:]), float("nan"))
    a.snap_conv = torch.full((len(cfg.kda_layers), 3, *a.conv.shape[2:]), float("nan"))
    step = StepInput.build([(toks, 0, a.allocate_slot(), table)], BS, "cpu")
    step.kda_snapshots = {0: [(c, j) for j, c in enumerate(cuts)]}
    with torch.inference_mode():
        full = m(step, a)
    b = new_cache(cfg, blocks=len(table) + 1)
    nosnap = run(m, b, [(toks, 0, b.allocate_slot(), table)])
    assert rel_rmse(full, nosnap) < 1e-5 and rel_rmse(a.state[:, 0], b.state[:, 0]) < 1e-5
    for j, c in enumerate(cuts):
        r = new_cache(cfg, blocks=len(table) + 1)
        decode_all(m, r, toks[:c], r.allocate_slot(), table)  # the recurrent form, token by token
        assert rel_rmse(a.snap_state[:, j], r.state[:, 0]) < 1e-4, f"state snapshot after {c} tokens"
        assert rel_rmse(a.snap_conv[:, j], r.conv[:, 0]) < 1e-5, f"conv snapshot after {c} tokens"


def engine(prefix_caching: bool, **kw):
    ecfg = EngineConfig(device="cpu", dtype="fp32", max_model_len=512, max_num_seqs=2, block_size=16,
                        enable_prefix_caching=prefix_caching, cuda_graphs=False, **kw)
    ecfg.extra["lm_head_scale"] = LM_HEAD_SCALE
    eng, _ = build_engine("tiny-kimi-linear", ecfg, dummy_weights=True, log=lambda m: None)
    return eng


def greedy(eng, prompts, n=16):
    return eng.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))


# prompt tokens each case reuses: p (203 tokens, blocks of 16) leaves snapshots at its block-aligned
# chunk ends (budget 64: 64, 128, 192), at its last block end before its last token (192) and where its
# decode passes a block end (208, on p + its own output)
CASES = ("p", "p + 37 new", "p again", "p, token 150 changed", "p[:180] + 37 new", "p[:40]")
EXPECT = {64: [0, 192, 192, 128, 128, 0], 70: [0, 192, 192, 0, 0, 0]}


@pytest.mark.parametrize("budget", sorted(EXPECT))
def test_prefix_hit_equals_miss_on_the_model(budget):
    """Turn 2 (the prompt + new tokens: a hit that ends inside a block), a repeat, a one-token
    difference, a shorter prefix, with chunks that do (64) and do not (70) end on block ends (70: the
    snapshot at 192 is taken inside a chunk): the same greedy tokens as an engine caching nothing."""
    g = torch.Generator().manual_seed(11)
    p = torch.randint(0, 320, (203,), generator=g).tolist()
    more = torch.randint(0, 320, (37,), generator=g).tolist()
    flip = list(p)
    flip[150] = (flip[150] + 1) % 320
    prompts = [p, p + more, p, flip, p[:180] + more, p[:40]]
    hit = engine(True, max_num_batched_tokens=budget)
    miss = engine(False, max_num_batched_tokens=budget)
    reused = []
    for name, q in zip(CASES, prompts):
        before = hit.prefix_cache.stats["hit_tokens"]
        assert greedy(hit, [q]) == greedy(miss, [q]), name
        reused.append(hit.prefix_cache.stats["hit_tokens"] - before)
    assert reused == EXPECT[budget]
    assert miss.prefix_cache.stats["hit_tokens"] == 0
