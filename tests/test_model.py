"""The plain-PyTorch model against an independent reference, and its own
invariants: token-by-token decode == prefill (logits, every KDA state, every
MLA cache entry), chunked prefill, fragmented blocks, batched decode, FP8 cache,
dummy-weight scaling through depth."""
import json

import pytest
import torch

from peregrine.cache import ModelCache
from peregrine.config import PRESET_DIR, ModelConfig, resolve_model
from peregrine.decode.batch import StepInput
from peregrine.models.kimi import KimiModel
from peregrine.models.loader import init_dummy_weights
from peregrine.testing import rel_rmse
from reference import reference_forward

BS = 4  # small blocks so short prompts span several


def tiny(seed=0, **over):
    raw = json.loads((PRESET_DIR / "tiny-kimi-linear.json").read_text())
    raw.update(over)
    cfg = ModelConfig.from_dict(raw, name="tiny")
    m = KimiModel(cfg, torch.float32).eval()
    init_dummy_weights(m, seed)
    return cfg, m


def new_cache(cfg, kv="auto", blocks=64, slots=8):
    return ModelCache(cfg, num_blocks=blocks, block_size=BS, num_slots=slots, dtype=torch.float32, device="cpu", kv_cache_dtype=kv)


def run(m, cache, seqs):
    with torch.inference_mode():
        return m(StepInput.build(seqs, BS, "cpu"), cache)


def decode_all(m, cache, toks, slot, table):
    return torch.cat([run(m, cache, [([t], i, slot, table)]) for i, t in enumerate(toks)])


@pytest.fixture(scope="module")
def model():
    return tiny()


def test_matches_independent_reference(model):
    cfg, m = model
    toks = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    W = {n: v.reshape(s).clone() for n, v, s in m.hf_params()}
    ref = reference_forward(W, cfg, toks)
    c = new_cache(cfg)
    step_logits = decode_all(m, c, toks, c.allocate_slot(), [5, 1, 9])
    assert rel_rmse(step_logits, ref) < 1e-5
    c2 = new_cache(cfg)
    last = run(m, c2, [(toks, 0, c2.allocate_slot(), [0, 1, 2])])
    assert rel_rmse(last[0], ref[-1]) < 1e-5


@pytest.mark.parametrize("chunks", [[11], [3, 5, 3], [1] * 11])
def test_decode_equals_prefill_states(model, chunks):
    cfg, m = model
    toks = torch.randint(0, cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(2)).tolist()
    table = [7, 3, 12]
    a, b = new_cache(cfg), new_cache(cfg)
    full = run(m, a, [(toks, 0, a.allocate_slot(), table)])
    sb, pos = b.allocate_slot(), 0
    for n in chunks:
        last = run(m, b, [(toks[pos:pos + n], pos, sb, table)])
        pos += n
    assert rel_rmse(last, full) < 1e-5
    assert rel_rmse(b.state, a.state) < 1e-5, "KDA recurrent states differ"
    assert rel_rmse(b.conv, a.conv) < 1e-6, "KDA conv states differ"
    for blk in table:
        assert rel_rmse(b.latent[:, blk], a.latent[:, blk]) < 1e-6, f"MLA cache block {blk} differs"


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_each_layer_type_decode_equals_prefill(model, kind):
    cfg, m = model
    li = (cfg.kda_layers if kind == "kda" else cfg.mla_layers)[-1]
    attn = m.layers[li].attn
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    a, b = new_cache(cfg), new_cache(cfg)
    sa, sb = a.allocate_slot(), b.allocate_slot()
    with torch.inference_mode():
        full = attn(x, StepInput.build([(list(range(7)), 0, sa, [2, 0])], BS, "cpu"), a)
        steps = torch.cat([attn(x[i:i + 1], StepInput.build([([i], i, sb, [2, 0])], BS, "cpu"), b) for i in range(7)])
    assert rel_rmse(steps, full) < 1e-5
    assert rel_rmse(b.state, a.state) < 1e-5 and rel_rmse(b.latent, a.latent) < 1e-6


def test_fragmented_blocks_and_batched_decode(model):
    """Three sequences decoding together over interleaved blocks == each alone over contiguous blocks."""
    cfg, m = model
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 2)]
    tables = [[9, 2, 14, 6], [0, 11, 4, 13], [7, 1, 12, 3]]
    c = new_cache(cfg)
    slots = [c.allocate_slot() for _ in prompts]
    run(m, c, [(p, 0, s, t) for p, s, t in zip(prompts, slots, tables)])
    nxt = [[3, 8, 1], [5, 5, 2], [7, 0, 9]]  # three further decode tokens per sequence
    batched = []
    for k in range(3):
        batched.append(run(m, c, [([nxt[i][k]], len(prompts[i]) + k, slots[i], tables[i]) for i in range(3)]))
    for i, p in enumerate(prompts):
        ci = new_cache(cfg)
        si = ci.allocate_slot()
        run(m, ci, [(p, 0, si, [0, 1, 2, 3])])
        for k in range(3):
            alone = run(m, ci, [([nxt[i][k]], len(p) + k, si, [0, 1, 2, 3])])
            assert rel_rmse(batched[k][i], alone[0]) < 1e-5


def test_mixed_step_prefill_and_decode(model):
    """A step mixing one sequence's prefill chunk with another's decode == running them apart."""
    cfg, m = model
    a_toks, b_toks = [5, 6, 7, 8, 9], [1, 2, 3]
    c = new_cache(cfg)
    sa, sb = c.allocate_slot(), c.allocate_slot()
    run(m, c, [(a_toks[:4], 0, sa, [0, 1])])
    mixed = run(m, c, [([a_toks[4]], 4, sa, [0, 1]), (b_toks, 0, sb, [2, 3])])
    c2 = new_cache(cfg)
    s2 = c2.allocate_slot()
    alone_a = run(m, c2, [(a_toks, 0, s2, [0, 1])])
    alone_b = run(m, c2, [(b_toks, 0, c2.allocate_slot(), [2, 3])])
    assert rel_rmse(mixed[0], alone_a[0]) < 1e-5 and rel_rmse(mixed[1], alone_b[0]) < 1e-5


def test_fp8_cache_close_to_full_precision(model):
    cfg, m = model
    toks = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    a, b = new_cache(cfg), new_cache(cfg, kv="fp8")
    assert b.latent.dtype == torch.float8_e4m3fn
    la = decode_all(m, a, toks, a.allocate_slot(), [0, 1, 2])
    lb = decode_all(m, b, toks, b.allocate_slot(), [0, 1, 2])
    e = rel_rmse(lb, la)
    assert 0 < e < 5e-2, e  # quantised (not identical) yet close


def test_dummy_weights_keep_activations_in_range_through_depth():
    """Tiny widths at Kimi-Linear-48B depth and layer pattern (27 layers, MLA every 4th and last)."""
    real = json.loads((PRESET_DIR / "kimi-linear-48b-a3b.json").read_text())["linear_attn_config"]
    cfg, m = tiny(linear_attn_config={**json.loads((PRESET_DIR / "tiny-kimi-linear.json").read_text())["linear_attn_config"],
                                      "kda_layers": real["kda_layers"], "full_attn_layers": real["full_attn_layers"]},
                  num_hidden_layers=27)
    c = new_cache(cfg)
    toks = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(6)).tolist()
    rec = []
    with torch.inference_mode():
        step = StepInput.build([(toks, 0, c.allocate_slot(), [0, 1, 2, 3])], BS, "cpu")
        h = m.hidden_states(step, c, record=rec)
        logits = m.compute_logits(h)
    assert len(rec) == 27
    for i, x in enumerate(rec):
        r = x.pow(2).mean(-1).sqrt()
        assert 0.1 <= r.min() and r.max() <= 10, f"layer {i}: hidden RMS {r.min():.3f}..{r.max():.3f}"
    assert torch.isfinite(logits).all()
    assert logits.std(-1).min() > 0.3, "logits nearly flat"
    assert len(set(logits.argmax(-1).tolist())) > 4, "every position predicts the same token"


def test_real_preset_builds_on_meta():
    """The 48B preset's module tree and checkpoint table have the published shapes (no memory used)."""
    cfg, _ = resolve_model("kimi-linear-48b-a3b")
    with torch.device("meta"):
        m = KimiModel(cfg, torch.bfloat16)
    table = {n: s for n, _, s in m.hf_params()}
    assert table["model.layers.1.self_attn.q_proj.weight"] == (4096, 2304)
    assert table["model.layers.1.self_attn.A_log"] == (1, 1, 32, 1)
    assert table["model.layers.3.self_attn.kv_b_proj.weight"] == (8192, 512)
    assert table["model.layers.3.self_attn.q_proj.weight"] == (6144, 2304)
    assert table["model.layers.5.block_sparse_moe.experts.255.w2.weight"] == (2304, 1024)
    assert table["model.layers.0.mlp.gate_proj.weight"] == (9216, 2304)
    n = sum(p.numel() for p in m.parameters())
    assert 47e9 < n < 50e9, n


def test_grouped_gemm_moe_equals_expert_loop():
    """The sync-free grouped-GEMM MoE (the GPU standard path) == the loop over used experts."""
    from peregrine.models.layers import swiglu
    from peregrine.models.moe import grouped_experts
    g = torch.Generator().manual_seed(8)
    E, I, D, N, k = 6, 16, 32, 5, 3
    x, w13, w2 = torch.randn(N, D, generator=g), torch.randn(E, 2 * I, D, generator=g), torch.randn(E, D, I, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    w = torch.rand(N, k, generator=g)
    a = grouped_experts(x, w13, w2, ids, w, swiglu, grouped=True)
    b = grouped_experts(x, w13, w2, ids, w, swiglu, grouped=False)
    ref = torch.stack([sum(w[n, j] * (w2[e] @ swiglu(w13[e] @ x[n])) for j, e in enumerate(ids[n].tolist())) for n in range(N)])
    assert rel_rmse(a, ref) < 1e-5 and rel_rmse(b, ref) < 1e-5


def test_long_prefill_chunked_equals_token_by_token(model):
    """Prefill chunks ≥ CHUNKED_MIN_TOKENS take the chunked KDA form: same logits and states as decoding."""
    from peregrine.models.kda import CHUNKED_MIN_TOKENS
    cfg, m = model
    T = CHUNKED_MIN_TOKENS + 37
    toks = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(9)).tolist()
    table = list(range(0, 2 * (T // BS + 1), 2))
    a, b = new_cache(cfg), new_cache(cfg)
    full = run(m, a, [(toks, 0, a.allocate_slot(), table)])
    last = decode_all(m, b, toks, b.allocate_slot(), table)[-1:]
    assert rel_rmse(full, last) < 1e-4
    assert rel_rmse(a.state, b.state) < 1e-4 and rel_rmse(a.conv, b.conv) < 1e-6
