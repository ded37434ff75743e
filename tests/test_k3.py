"""Kimi K3 on the standard path: config parsing, MXFP4 codes, the tiny-k3 model against the
independent FP64 reference, decode == prefill, loader names/shapes, dummy-weight depth
scaling with AttnRes, and an engine run."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from peregrine.cache import ModelCache
from peregrine.config import PRESET_DIR, EngineConfig, ModelConfig, resolve_model
from peregrine.decode.batch import StepInput
from peregrine.engine import SamplingParams
from peregrine.engine.build import build_engine
from peregrine.kernels import available
from peregrine.models import mxfp4
from peregrine.models.kimi import KimiModel
from peregrine.models.loader import WeightError, init_dummy_weights, load_weights, save_weights
from peregrine.testing import SENTINEL, rel_rmse
from conftest import DEVICE, FULL_SHAPES
from reference import reference_forward

BS = 4  # small cache blocks so short prompts span several
TINY = json.loads((PRESET_DIR / "tiny-k3.json").read_text())
PRE = "language_model."


def tiny(seed=0, text_over=None, lac_over=None):
    raw = json.loads(json.dumps(TINY))
    raw["text_config"].update(text_over or {})
    raw["text_config"]["linear_attn_config"].update(lac_over or {})
    cfg = ModelConfig.from_dict(raw, name="tiny-k3")
    m = KimiModel(cfg, torch.float32).eval()
    init_dummy_weights(m, seed)
    return cfg, m


def new_cache(cfg, blocks=32, slots=4):
    return ModelCache(cfg, num_blocks=blocks, block_size=BS, num_slots=slots, dtype=torch.float32, device="cpu")


def run(m, cache, seqs):
    with torch.inference_mode():
        return m(StepInput.build(seqs, BS, "cpu"), cache)


@pytest.fixture(scope="module")
def model():
    return tiny()


# ---- independent MXFP4 decode (bit fields, not a value table) ----------------
def e2m1_ref(code: int) -> float:
    sign, exp, man = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
    return sign * (0.5 * man if exp == 0 else 2.0 ** (exp - 1) * (1 + 0.5 * man))


def dequant_ref(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[R, C/2] uint8 (low nibble = even element) + [R, C/32] E8M0 -> [R, C] float64."""
    R, half = packed.shape
    out = torch.empty(R, 2 * half, dtype=torch.float64)
    lut = torch.tensor([e2m1_ref(c) for c in range(16)], dtype=torch.float64)
    out[:, 0::2] = lut[(packed.long() & 15)]
    out[:, 1::2] = lut[(packed.long() >> 4)]
    s = torch.pow(2.0, scale.double() - 127)
    return out * s.repeat_interleave(32, 1)


def reference_weights(m) -> dict:
    """The checkpoint as the reference reads it: no `language_model.`, MXFP4 experts dequantized independently."""
    raw = {n.removeprefix(PRE): v.reshape(s).clone() for n, v, s in m.hf_params()}
    W = {}
    for n, t in raw.items():
        if n.endswith(".weight_packed"):
            W[n.removesuffix("_packed")] = dequant_ref(t, raw[n.removesuffix("_packed") + "_scale"])
        elif not n.endswith(".weight_scale"):
            W[n] = t
    return W


# ---- config ------------------------------------------------------------------
def test_config_nested_and_flat():
    nested = ModelConfig.from_dict(TINY)
    flat_raw = {**{k: v for k, v in TINY.items() if k != "text_config"}, **TINY["text_config"], "model_type": "kimi_k3"}
    flat = ModelConfig.from_dict(flat_raw)
    assert nested.to_dict() == flat.to_dict()
    assert nested.is_k3 and nested.expert_quant == "mxfp4" and nested.hidden_act == "situ"
    assert nested.kda_gate_lower_bound == -5.0 and nested.kda_full_rank_gate and nested.mla_output_gate
    assert nested.mla_layers == (3, 5) and nested.moe_layers == (1, 2, 3, 4, 5) and nested.attn_res_block_size == 2
    real, _ = resolve_model("kimi-k3")
    assert (real.hidden_size, real.num_experts, real.routed_expert_hidden_size, real.q_lora_rank) == (7168, 896, 3584, 1536)
    sl, _ = resolve_model("k3-slice")
    assert (sl.hidden_size, sl.kda_num_heads, sl.mla_num_heads, sl.num_hidden_layers, sl.num_experts) == (7168, 96, 96, 6, 192)
    assert sl.kda_layers == (0, 1, 2, 4) and sl.mla_layers == (3, 5) and sl.expert_quant == "mxfp4"


# ---- MXFP4 ---------------------------------------------------------------------
def test_mxfp4_all_codes_and_scales():
    codes = torch.arange(16, dtype=torch.uint8).repeat(4)  # 64 values = 2 groups, every code in each
    packed = mxfp4.pack_codes(codes[None])
    assert packed.shape == (1, 32) and packed[0, 0] == 0x10  # code 0 low nibble, code 1 high
    assert torch.equal(mxfp4.unpack_codes(packed)[0], codes)
    every_byte = torch.arange(256, dtype=torch.uint8)[None]
    assert torch.equal(mxfp4.pack_codes(mxfp4.unpack_codes(every_byte)), every_byte)
    for s in (0, 1, 100, 120, 127, 128, 140, 200, 254):
        scale = torch.tensor([[s, 254 - s]], dtype=torch.uint8)
        ref = dequant_ref(packed, scale)
        for dt in (torch.float32, torch.bfloat16):
            got = mxfp4.dequantize(packed, scale, dt)
            if dt == torch.bfloat16 and s < 7:
                continue  # 2^-127 · 0.5 is below BF16's subnormal range
            assert torch.equal(got.double(), ref.to(dt).double()), (s, dt)
        # quantize recovers codes and scales of already-representable values
        q, sc = mxfp4.quantize(ref.float())
        if 2 <= s <= 252:  # both groups finite and normal in FP32
            assert torch.equal(mxfp4.dequantize(q, sc).double(), ref)
    assert torch.isnan(mxfp4.dequantize(packed, torch.tensor([[255, 127]], dtype=torch.uint8))[0, :32]).all()


def test_mxfp4_quantize_error_and_random_fill():
    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(0))
    q, s = mxfp4.quantize(w)
    assert q.shape == (8, 48) and s.shape == (8, 3) and q.dtype == s.dtype == torch.uint8
    assert rel_rmse(mxfp4.dequantize(q, s), w) < 0.15  # 4-bit: ~10% RMS error
    q2, s2 = torch.empty(64, 512, dtype=torch.uint8), torch.empty(64, 32, dtype=torch.uint8)
    mxfp4.random_fill(q2, s2, 0.05, torch.Generator().manual_seed(1))
    rms = dequant_ref(q2, s2).pow(2).mean().sqrt().item()
    assert 0.05 / 1.5 < rms < 0.05 * 1.5


# ---- the model -------------------------------------------------------------------
def test_matches_independent_reference(model):
    cfg, m = model
    toks = torch.randint(0, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = reference_forward(reference_weights(m), cfg, toks)
    assert ref.std() > 0.3  # not a degenerate model
    c = new_cache(cfg)
    slot = c.allocate_slot()
    steps = torch.cat([run(m, c, [([t], i, slot, [5, 1])]) for i, t in enumerate(toks)])
    assert rel_rmse(steps, ref) < 1e-5
    c2 = new_cache(cfg)
    last = run(m, c2, [(toks, 0, c2.allocate_slot(), [0, 1])])
    assert rel_rmse(last[0], ref[-1]) < 1e-5


@pytest.mark.parametrize("chunks", [[3, 5, 3], [1] * 11])
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
        assert rel_rmse(b.latent[:, blk], a.latent[:, blk]) < 1e-5, f"MLA cache block {blk} differs"


def test_batched_decode_equals_alone(model):
    """Two sequences decoding together (MXFP4 per-pair path) == each alone; prefill used the per-expert path."""
    cfg, m = model
    prompts, nxt = [[3, 9, 27, 81, 4], [7, 1]], [[5, 6], [8, 2]]
    c = new_cache(cfg)
    slots = [c.allocate_slot() for _ in prompts]
    tables = [[0, 4, 2], [1, 3, 5]]
    run(m, c, [(p, 0, s, t) for p, s, t in zip(prompts, slots, tables)])
    for k in range(2):
        both = run(m, c, [([nxt[i][k]], len(prompts[i]) + k, slots[i], tables[i]) for i in range(2)])
        for i in range(2):
            ci = new_cache(cfg)
            si = ci.allocate_slot()
            alone = run(m, ci, [(prompts[i] + nxt[i][:k + 1], 0, si, [0, 1, 2])])
            assert rel_rmse(both[i], alone[0]) < 1e-5


def test_dummy_weights_keep_activations_in_range_through_depth():
    """Tiny widths at 24 layers (K3's MLA-every-4th pattern) with two AttnRes blocks of 12."""
    L = 24
    mla = [i for i in range(4, L + 1, 4)]
    cfg, m = tiny(text_over={"num_hidden_layers": L, "attn_res_block_size": 12},
                  lac_over={"full_attn_layers": mla, "kda_layers": [i for i in range(1, L + 1) if i not in mla]})
    c = new_cache(cfg)
    toks = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(6)).tolist()
    rec = []
    with torch.inference_mode():
        step = StepInput.build([(toks, 0, c.allocate_slot(), [0, 1, 2])], BS, "cpu")
        h = m.hidden_states(step, c, record=rec)
        logits = m.compute_logits(h)
    assert len(rec) == L
    for i, x in enumerate(rec):
        r = x.pow(2).mean(-1).sqrt()
        assert 0.1 <= r.min() and r.max() <= 10, f"layer {i}: hidden RMS {r.min():.3f}..{r.max():.3f}"
    assert torch.isfinite(logits).all() and logits.std(-1).min() > 0.3
    assert len(set(logits.argmax(-1).tolist())) > 3, "every position predicts the same token"


# ---- loader ----------------------------------------------------------------------
def _saved(m, tmp_path):
    save_weights(m, tmp_path)
    return load_file(str(tmp_path / "model.safetensors"))


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("prefix", [True, False])
def test_loader_round_trip_with_and_without_prefix(tmp_path, model, prefix):
    _, a = model
    d = _saved(a, tmp_path)
    assert "language_model.model.layers.1.block_sparse_moe.experts.15.w2.weight_packed" in d
    assert d["language_model.model.layers.3.self_attn.q_b_proj.weight"].dtype == torch.float32
    assert d["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"].shape == (32, 2)
    assert "language_model.model.output_attn_res_proj.weight" in d and "language_model.lm_head.weight" in d
    d = {(k if prefix else k.removeprefix(PRE)): v for k, v in d.items()}
    # K3 exports differ in A_log's shape and scale dtype; vision tensors ride along in the same files
    d = {k: (v.flatten() if k.endswith("A_log") and "layers.1." in k else v) for k, v in d.items()}
    sk = next(k for k in d if k.endswith("experts.4.w2.weight_scale"))
    d[sk] = d[sk].view(torch.float8_e8m0fnu)  # some exports type the scales as E8M0
    d["vision_tower.encoder.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    d["mm_projector.proj.0.weight"] = torch.zeros(2, 2)
    save_file(d, str(tmp_path / "model.safetensors"))
    _, b = tiny(seed=3)
    assert not _same(a, b)
    logs = []
    load_weights(b, tmp_path, log=logs.append)
    assert _same(a, b)
    assert any("ignored 2 vision" in s for s in logs)


@pytest.mark.parametrize("name,bad,msg", [
    ("language_model.model.layers.1.self_attn.A_log", torch.zeros(3), "shape"),
    ("language_model.model.layers.2.block_sparse_moe.experts.3.w1.weight_packed", torch.zeros(32, 32), "dtype"),
    ("language_model.model.layers.3.self_attn.g_proj.weight", torch.zeros(65, 128), "shape"),
])
def test_loader_errors_name_the_tensor(tmp_path, model, name, bad, msg):
    d = _saved(model[1], tmp_path)
    d[name] = bad
    save_file(d, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightError, match=msg) as e:
        load_weights(tiny()[1], tmp_path)
    assert name in str(e.value)


def test_real_k3_preset_builds_on_meta():
    """The K3 module tree and checkpoint table have docs/models.md's shapes (meta: no memory)."""
    cfg, _ = resolve_model("kimi-k3")
    with torch.device("meta"):
        m = KimiModel(cfg, torch.bfloat16)
    t = {n: s for n, _, s in m.hf_params()}
    p = "language_model.model.layers."
    want = {
        "1.self_attn.g_proj.weight": (12288, 7168), "1.self_attn.A_log": (1, 1, 96, 1),
        "3.self_attn.q_a_proj.weight": (1536, 7168), "3.self_attn.q_a_layernorm.weight": (1536,),
        "3.self_attn.q_b_proj.weight": (18432, 1536), "3.self_attn.kv_a_proj_with_mqa.weight": (576, 7168),
        "3.self_attn.kv_b_proj.weight": (24576, 512), "3.self_attn.g_proj.weight": (12288, 7168),
        "3.self_attn.o_proj.weight": (7168, 12288), "0.mlp.gate_proj.weight": (33792, 7168),
        "5.block_sparse_moe.gate.weight": (896, 7168), "5.block_sparse_moe.routed_expert_down_proj.weight": (3584, 7168),
        "5.block_sparse_moe.routed_expert_norm.weight": (3584,), "5.block_sparse_moe.routed_expert_up_proj.weight": (7168, 3584),
        "5.block_sparse_moe.shared_experts.gate_proj.weight": (6144, 7168),
        "5.block_sparse_moe.shared_experts.down_proj.weight": (7168, 6144),
        "5.block_sparse_moe.experts.895.w1.weight_packed": (3072, 1792), "5.block_sparse_moe.experts.895.w1.weight_scale": (3072, 112),
        "5.block_sparse_moe.experts.0.w2.weight_packed": (3584, 1536), "5.block_sparse_moe.experts.0.w2.weight_scale": (3584, 96),
        "12.self_attention_res_proj.weight": (1, 7168), "12.mlp_res_norm.weight": (7168,),
    }
    for k, s in want.items():
        assert t[p + k] == s, k
    n = sum(p.numel() * p.element_size() for p in m.parameters())
    assert 1.3e12 < n < 1.8e12, n  # ~2.8T params: MXFP4 experts at ~0.53 bytes each


def test_engine_generates_with_tiny_k3():
    eng, _ = build_engine("tiny-k3", EngineConfig(max_num_seqs=2, block_size=8), dummy_weights=True, log=lambda s: None)
    outs = eng.generate([[1, 2, 3, 4, 5], [9, 8]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o) for o in outs] == [6, 6]
    alone, _ = build_engine("tiny-k3", EngineConfig(max_num_seqs=1, block_size=8), dummy_weights=True, log=lambda s: None)
    assert alone.generate([[9, 8]], SamplingParams(max_tokens=6, ignore_eos=True))[0] == outs[1]


# ---- MXFP4 GEMV kernel (interpreter on CPU, compiled in the GPU pass) --------------
GEMV_SHAPES = [(1, 1, 32), (3, 7, 96), (2, 100, 64)] + ([(4, 6144, 3584), (16, 3584, 3072)] if FULL_SHAPES else [])


@pytest.mark.gpu
@pytest.mark.skipif(not available(DEVICE), reason="triton kernels unavailable")
@pytest.mark.parametrize("M,R,C", GEMV_SHAPES)
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_mxfp4_gemv_against_dequantized_reference(M, R, C, xdtype):
    g = torch.Generator().manual_seed(M * R + C)
    E = 5
    q = torch.randint(0, 256, (E, R, C // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    s = torch.randint(118, 132, (E, R, C // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    x = torch.randn(M, C, generator=g).to(xdtype)
    ids = torch.randint(0, E, (M,), generator=g)
    W = {e: dequant_ref(q[e], s[e]) for e in set(ids.tolist())}
    ref = torch.stack([W[e] @ x[i].double() for i, e in enumerate(ids.tolist())])
    pad = 3  # sentinel columns past R: the kernel must leave them bit-identical
    buf = torch.full((M, R + pad), SENTINEL, dtype=torch.float32, device=DEVICE)
    buf[:, :R] = float("nan")
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    y = mxfp4.mxfp4_gemv(dev(x), dev(q), dev(s), dev(ids), out=buf[:, :R])
    assert rel_rmse(y.cpu(), ref) < 1e-5
    assert (buf[:, R:] == SENTINEL).all()
    one = mxfp4.mxfp4_gemv(dev(x), dev(q[2]), dev(s[2]))  # one shared weight, no ids
    assert rel_rmse(one.cpu(), (dequant_ref(q[2], s[2]) @ x.double().T).T) < 1e-5
