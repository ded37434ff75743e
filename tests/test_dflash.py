"""DFlash / DSpark drafters (speculative/dflash.py) against references nobody here wrote, FP32 on the CPU: z-lab's
`dflash` package (test-only) for the DFlash layers and block convention."""
import json

import pytest
import torch

from peregrine.config import ConfigError
from peregrine.speculative.dflash import DFlashConfig, DFlashModel, check_fits, load_folder

V, H, TARGET_LAYERS = 128, 64, 6
SMALL = dict(hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V, max_position_embeddings=512)
TAPS = [1, 3, 4]
BLOCK, MASK = 5, V - 1


def zlab_config() -> dict:
    """A config.json in z-lab's published layout (z-lab/Qwen3-8B-DFlash-b16's keys, small values)."""
    return SMALL | {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": BLOCK,
                    "num_target_layers": TARGET_LAYERS, "attention_bias": False, "tie_word_embeddings": False,
                    "layer_types": ["full_attention"] * SMALL["num_hidden_layers"],
                    "dflash_config": {"mask_token_id": MASK, "target_layer_ids": TAPS}}


def zlab_reference(seed=0):
    """z-lab's DFlashDraftModel on the small config, every weight random (norms around 1)."""
    dflash_model = pytest.importorskip("dflash.model")
    from transformers import Qwen3Config
    d = zlab_config()
    cfg = Qwen3Config(**{k: v for k, v in d.items() if k not in ("architectures", "dflash_config", "block_size",
                                                                   "num_target_layers")})
    cfg.block_size, cfg.num_target_layers, cfg.dflash_config = BLOCK, TARGET_LAYERS, dict(d["dflash_config"])
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = dflash_model.DFlashDraftModel(cfg).float().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return m, d


@pytest.mark.parametrize("C", [1, 9])
def test_dflash_block_equals_zlab(C):
    """The drafter's block states and draft logits equal z-lab's DFlashDraftModel (FP32, within 1e-4): context
    taps through fc and hidden_norm, keys and values of context and block, RoPE at start.., no mask; z-lab's
    convention, slots 1.. are the drafts."""
    ref, d = zlab_reference()
    g = torch.Generator().manual_seed(C)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.1
    taps = torch.randn(C, len(TAPS) * H, generator=g)
    ids = torch.full((BLOCK,), MASK)
    ids[0] = 17
    with torch.no_grad():
        want_h = ref(position_ids=torch.arange(C + BLOCK)[None], noise_embedding=embed[ids][None],
                     target_hidden=taps[None])[0]
    cfg = DFlashConfig.from_dict(d, "test")
    weights = {k: v.detach().clone() for k, v in ref.state_dict().items() if "rotary" not in k}
    m = DFlashModel(cfg, weights, embed, head)
    check_fits(cfg, weights, m, type("T", (), {"hidden_size": H, "num_hidden_layers": TARGET_LAYERS,
                                               "vocab_size": V})(), "test")
    kv = m.context_kv(m.context(taps), torch.arange(C))
    got_h = m.hidden(ids, C, kv)
    assert torch.allclose(got_h, want_h, atol=1e-4, rtol=1e-4), (got_h - want_h).abs().max()
    drafts, conf, logits = m.draft(17, C, kv, BLOCK - 1)
    assert cfg.num_drafts == BLOCK - 1 and conf is None
    assert torch.allclose(logits, want_h[1:] @ head.T, atol=1e-4, rtol=1e-4)
    assert drafts == (want_h[1:] @ head.T).argmax(-1).tolist()


@pytest.mark.parametrize("bias", [False, True])
def test_tap_writer_keys_and_values_equal_each_layers_own(bias):
    """The writer projects every layer's keys and values in one GEMM (fused weights, k_norm stacked) inside the
    target's step; they equal DFlashModel.context_kv's, layer by layer (FP32), and land at the step's slots only."""
    from types import SimpleNamespace

    from peregrine.speculative.dflash import TapWriter
    ref, d = zlab_reference()
    cfg = DFlashConfig.from_dict(d | {"attention_bias": bias}, "test")
    g = torch.Generator().manual_seed(1)
    weights = {k: v.detach().clone() for k, v in ref.state_dict().items() if "rotary" not in k}
    if bias:
        for i in range(cfg.num_layers):
            for n, rows in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
                weights[f"layers.{i}.self_attn.{n}_proj.bias"] = torch.randn(rows * cfg.head_dim, generator=g)
    m = DFlashModel(cfg, weights, torch.randn(V, H, generator=g), torch.randn(V, H, generator=g))
    w = TapWriter(m, 40, torch.float32, "cpu")
    w.kv.fill_(float("nan"))
    taps = {L: torch.randn(6, H, generator=g) for L in TAPS}
    step = SimpleNamespace(positions=torch.tensor([3, 4, 5, 9, 10, 11]), slot_mapping=torch.tensor([7, 8, 9, 20, 21, 22]))
    for L in TAPS:
        w.take(L, taps[L], step)
    want = m.context_kv(m.context(torch.cat([taps[L] for L in TAPS], -1)), step.positions)
    for i, (k, v) in enumerate(want):
        assert torch.allclose(w.kv[i, 0, step.slot_mapping], k, atol=1e-5, rtol=1e-5)
        assert torch.allclose(w.kv[i, 1, step.slot_mapping], v, atol=1e-5, rtol=1e-5)
    others = torch.ones(40, dtype=torch.bool)
    others[step.slot_mapping] = False
    assert w.kv[:, :, others].isnan().all()


def test_folder_errors_name_the_problem(tmp_path):
    """A folder that is not a drafter for this target is a clear error at start."""
    from safetensors.torch import save_file
    ref, d = zlab_reference()
    target = type("T", (), {"hidden_size": H, "num_hidden_layers": TARGET_LAYERS, "vocab_size": V})()
    weights = {k: v.detach().clone().contiguous() for k, v in ref.state_dict().items() if "rotary" not in k}

    def folder(conf, w=weights):
        p = tmp_path / str(len(list(tmp_path.iterdir())))
        p.mkdir()
        (p / "config.json").write_text(json.dumps(conf))
        save_file(w, str(p / "model.safetensors"))
        return p

    def fits(conf, w=weights):
        cfg, ws = load_folder(folder(conf, w))
        check_fits(cfg, ws, DFlashModel(cfg, ws, torch.zeros(V, H), torch.zeros(V, H)), target, "drafter")

    fits(zlab_config())  # the good one loads
    cases = [
        (zlab_config() | {"hidden_size": 2 * H}, "hidden size 128, the target's is 64"),
        (zlab_config() | {"num_target_layers": 27}, "27-layer target"),
        (zlab_config() | {"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 9]}}, "target_layer_ids"),
        (zlab_config() | {"dflash_config": {"mask_token_id": V + 5, "target_layer_ids": TAPS}}, "mask_token_id"),
        (zlab_config() | {"vocab_size": 1000}, "vocabulary 1000"),
        (zlab_config() | {"architectures": ["LlamaForCausalLM"]}, "not a DFlash or DSpark drafter"),
        (zlab_config() | {"layer_types": ["sliding_attention"] * 2}, "sliding_attention"),
    ]
    for conf, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            fits(conf)
    w = dict(weights)
    w.pop("layers.1.mlp.up_proj.weight")
    with pytest.raises(ConfigError, match="missing tensor layers.1.mlp.up_proj.weight"):
        fits(zlab_config(), w)
    with pytest.raises(ConfigError, match="no config.json"):
        load_folder(tmp_path / "nowhere")


def test_dspark_equals_deepspec_golden():
    """DeepSpec's DSpark drafter (its flat config, own embedding and head, a tap of the embedding output, the
    vanilla Markov head, the confidence head; DeepSpec's convention: every slot a draft) through golden outputs
    made by tests/golden/make_dspark_golden.py from DeepSpec's own code: block states, Markov-corrected logits,
    greedy drafts drawn in order and the confidences, FP32 within 1e-4."""
    from pathlib import Path

    from safetensors.torch import load_file
    gold = Path(__file__).parent / "golden"
    d = json.loads((gold / "dspark_small.json").read_text())
    t = load_file(str(gold / "dspark_small.safetensors"))
    case = {k.removeprefix("case."): t.pop(k) for k in list(t) if k.startswith("case.")}
    cfg = DFlashConfig.from_dict(d, "golden")
    assert cfg.shifted and cfg.num_drafts == cfg.block_size and cfg.markov_rank == 8 and cfg.confidence
    m = DFlashModel(cfg, t, None, None)
    check_fits(cfg, t, m, type("T", (), {"hidden_size": d["hidden_size"], "num_hidden_layers": 6,
                                         "vocab_size": d["vocab_size"]})(), "golden")
    C = case["taps"].shape[0]
    kv = m.context_kv(m.context(case["taps"]), torch.arange(C))
    h = m.hidden(case["ids"], C, kv)
    assert torch.allclose(h, case["hidden"], atol=1e-4, rtol=1e-4), (h - case["hidden"]).abs().max()
    drafts, conf, logits = m.draft(int(case["ids"][0]), C, kv, cfg.num_drafts)
    assert drafts == case["drafts"].tolist()
    assert torch.allclose(logits, case["logits"], atol=1e-4, rtol=1e-4)
    assert torch.allclose(torch.tensor(conf), torch.sigmoid(case["confidence_logits"]), atol=1e-5)


def test_dspark_draws_its_slots_with_one_host_read(monkeypatch):
    """DSpark's slots are drawn in order (each slot's Markov bias reads the previous draft), on the device: the
    drafts and confidences come back in one copy, not one or two host syncs a slot (each costs a GPU round trip
    per request per step)."""
    from pathlib import Path

    from safetensors.torch import load_file
    gold = Path(__file__).parent / "golden"
    d = json.loads((gold / "dspark_small.json").read_text())
    t = load_file(str(gold / "dspark_small.safetensors"))
    case = {k.removeprefix("case."): t.pop(k) for k in list(t) if k.startswith("case.")}
    m = DFlashModel(DFlashConfig.from_dict(d, "golden"), t, None, None)
    C = case["taps"].shape[0]
    kv = m.context_kv(m.context(case["taps"]), torch.arange(C))
    anchor = int(case["ids"][0])
    reads = []
    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=orig, _n=name, **k: (reads.append(_n), _o(self, *a, **k))[1])
    drafts, conf, _ = m.draft(anchor, C, kv, m.cfg.num_drafts)
    monkeypatch.undo()
    assert reads == ["tolist"], reads
    assert drafts == case["drafts"].tolist() and len(conf) == len(drafts)


def test_a_batch_of_blocks_over_their_own_contexts_equals_each_block_alone():
    """propose drafts every asking request in one call: draft_batch over B contexts of different lengths (padded
    to the longest and masked, as TapWriter.gather returns them) equals each request's one-block call over its own
    context (the DeepSpec-checked path): block states' logits, in-order Markov draws and confidences."""
    from pathlib import Path

    from safetensors.torch import load_file
    gold = Path(__file__).parent / "golden"
    d = json.loads((gold / "dspark_small.json").read_text())
    t = load_file(str(gold / "dspark_small.safetensors"))
    case = {k.removeprefix("case."): t.pop(k) for k in list(t) if k.startswith("case.")}
    m = DFlashModel(DFlashConfig.from_dict(d, "golden"), t, None, None)
    g = torch.Generator().manual_seed(7)
    lens, taps = [5, 1, 12], case["taps"]
    ctxs = [m.context_kv(m.context(torch.randn(n, taps.shape[1], generator=g) * taps.std()), torch.arange(n)) for n in lens]
    L = max(lens)
    pad = lambda x: torch.cat([x, 1e3 * torch.randn((L - x.shape[0],) + x.shape[1:], generator=g)])  # noqa: E731  garbage past the end
    ctx = [(torch.stack([pad(c[i][0]) for c in ctxs]), torch.stack([pad(c[i][1]) for c in ctxs])) for i in range(m.cfg.num_layers)]
    valid = torch.arange(L)[None] < torch.tensor(lens)[:, None]
    anchors = torch.tensor([3, int(case["ids"][0]), 11])
    k = m.cfg.num_drafts
    d, c, logits = m.draft_batch(anchors, torch.tensor(lens), ctx, valid, k)  # (a mask ignored: garbage leaks)
    for b, n in enumerate(lens):
        d1, c1, l1 = m.draft_tensors(int(anchors[b]), n, ctxs[b], k)
        assert torch.equal(d[b], d1) and torch.allclose(c[b], c1, atol=1e-6) and torch.allclose(logits[b], l1, atol=1e-5), b


@pytest.mark.parametrize("paged", [True, False])
def test_drafter_graphs_pad_to_context_buckets_without_changing_the_drafts(paged):
    """dflash_graphs.DrafterGraphs (capture=False: the same buffers the GPU captures): requests with scattered
    cache blocks, their contexts read in place by kernels/drafter_attn.py (paged: one entry per B) or gathered from
    the paged key / value buffer at a power-of-two bucket (one entry per (B, bucket)), give each request's
    one-block drafts and confidences over its own context."""
    from pathlib import Path

    from safetensors.torch import load_file

    from peregrine.speculative.dflash import TapWriter
    from peregrine.speculative.dflash_graphs import MIN_L, DrafterGraphs, bucket
    assert [bucket(n, 1000) for n in (1, MIN_L, MIN_L + 1, 300, 999)] == [MIN_L, MIN_L, 2 * MIN_L, 512, 1000]
    gold = Path(__file__).parent / "golden"
    d = json.loads((gold / "dspark_small.json").read_text())
    t = load_file(str(gold / "dspark_small.safetensors"))
    for key in [k for k in t if k.startswith("case.")]:
        t.pop(key)
    m = DFlashModel(DFlashConfig.from_dict(d, "golden"), t, None, None)
    bs, nblocks = 4, 40
    w = TapWriter(m, nblocks * bs, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(9)
    w.kv.copy_(torch.randn(w.kv.shape, generator=g))
    perm = torch.randperm(nblocks, generator=g).tolist()
    lens, anchors = [70, 3, 9], [5, 17, 2]
    blocks = [perm[0:20], perm[20:22], perm[22:26] + [perm[30]]]  # more blocks than fed tokens need, in any order
    k = m.cfg.num_drafts
    dg = DrafterGraphs(m, w, bs, k, 512, torch.device("cpu"), capture=False, paged=paged)
    ids, confs = dg.draft(blocks, lens, anchors)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = torch.tensor(blocks[b])[pos // bs] * bs + pos % bs
        ctx = [(w.kv[i, 0, slots], w.kv[i, 1, slots]) for i in range(m.cfg.num_layers)]
        d1, c1, _ = m.draft_tensors(anchors[b], n, ctx, k)
        assert ids[b] == d1.tolist() and confs[b] == pytest.approx(c1.tolist(), abs=1e-5), b
    assert list(dg.graphs) == [(3, 0 if paged else 128)] and dg.replays == 0
    assert dg.warm_up(4, log=lambda m: None) == 0 and len(dg.graphs) == 1  # nothing to capture off the GPU


def test_a_drafter_the_context_kernel_cannot_take_gathers_its_context():
    """The in-place context kernel's gate (drafter_attn.supported): a head size that is not a power of two sends the
    drafter to the gathered path instead of into a kernel that cannot take it."""
    from pathlib import Path

    from safetensors.torch import load_file

    from peregrine.kernels import available
    from peregrine.kernels.drafter_attn import supported
    from peregrine.speculative.dflash import TapWriter
    from peregrine.speculative.dflash_graphs import DrafterGraphs
    gold = Path(__file__).parent / "golden"
    d = json.loads((gold / "dspark_small.json").read_text())
    t = {k: v for k, v in load_file(str(gold / "dspark_small.safetensors")).items() if not k.startswith("case.")}
    for hd, ok in ((d.get("head_dim", 16), True), (24, False)):
        m = DFlashModel(DFlashConfig.from_dict(d | {"head_dim": hd}, "golden"), t, None, None)
        w = TapWriter(m, 64, torch.float32, torch.device("cpu"))
        dg = DrafterGraphs(m, w, 4, 2, 64, torch.device("cpu"), capture=False)
        assert (supported(hd, torch.float32) is None) == ok
        assert dg.paged == (ok and available(torch.device("cpu")))
    assert "power of two" in supported(24, torch.bfloat16) and "dtype" in supported(64, torch.int8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1",
                    reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("paged", [True, False])
def test_drafter_graphs_replay_the_eager_drafts_on_the_gpu(paged):
    """Captured per (B, bucket), replayed with new tables, lengths and anchors: the drafts and confidences of the
    same padded step run eagerly, for every call (the graph reads its buffers, nothing baked in at capture)."""
    from pathlib import Path

    from safetensors.torch import load_file

    from peregrine.speculative.dflash import TapWriter
    from peregrine.speculative.dflash_graphs import DrafterGraphs
    gold = Path(__file__).parent / "golden"
    d = json.loads((gold / "dspark_small.json").read_text())
    t = {k: v.cuda() for k, v in load_file(str(gold / "dspark_small.safetensors")).items() if not k.startswith("case.")}
    m = DFlashModel(DFlashConfig.from_dict(d, "golden"), t, None, None)
    bs, nblocks, dev = 16, 64, torch.device("cuda")
    w = TapWriter(m, nblocks * bs, torch.bfloat16, dev)
    g = torch.Generator().manual_seed(11)
    w.kv.copy_(torch.randn(w.kv.shape, generator=g))
    graphs = DrafterGraphs(m, w, bs, m.cfg.num_drafts, 1024, dev, capture=True, paged=paged)
    eager = DrafterGraphs(m, w, bs, m.cfg.num_drafts, 1024, dev, capture=False, paged=paged)
    for call in range(4):
        perm = torch.randperm(nblocks, generator=g).tolist()
        lens = [90 + call, 7 * call + 1]  # one bucket (128) for every call: the same graph replayed
        blocks, anchors = [perm[:6], perm[6:12]], [call + 3, 2 * call + 1]
        got, want = graphs.draft(blocks, lens, anchors), eager.draft(blocks, lens, anchors)
        assert got[0] == want[0] and len(got[1]) == len(want[1]) == 2, call
        assert all(a == pytest.approx(b, abs=1e-6) for a, b in zip(got[1], want[1])), call
    assert graphs.broken is None and list(graphs.graphs) == [(2, 0 if paged else 128)] and graphs.replays == 4
    # a server's start captures every B at once where one graph serves every length (paged); gathered: per bucket
    assert graphs.warm_up(3, log=lambda m: None) == (2 if paged else 0) and eager.warm_up(3, log=lambda m: None) == 0
    assert sorted(graphs.graphs) == ([(1, 0), (2, 0), (3, 0)] if paged else [(2, 128)])


# ---- the drafter in the engine ----

def _drafter_folder(path, target_cfg, *, dspark=False, seed=0, block=4, taps=(-1, 1)):
    """A random drafter folder that fits the target: z-lab's layout, or DeepSpec's with the Markov and confidence
    heads (own embedding and head copied from nothing: random, as a drafter trained apart would have)."""
    from safetensors.torch import save_file
    H, V, L = target_cfg.hidden_size, target_cfg.vocab_size, target_cfg.num_hidden_layers
    d = dict(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V,
             num_target_layers=L, block_size=block, layer_types=["full_attention"] * 2)
    if dspark:
        d |= dict(architectures=["Qwen3DSparkModel"], mask_token_id=V - 1, target_layer_ids=list(taps),
                  markov_rank=8, markov_head_type="vanilla", enable_confidence_head=True,
                  confidence_head_with_markov=True)
    else:
        d |= dict(architectures=["DFlashDraftModel"], dflash_config={"mask_token_id": V - 1,
                                                                      "target_layer_ids": list(taps)})
    cfg = DFlashConfig.from_dict(d, "test")
    g = torch.Generator().manual_seed(seed)
    shapes = DFlashModel(cfg, {}, torch.zeros(V, H), torch.zeros(V, H)).names()
    w = {k: (1.0 + 0.1 * torch.randn(s, generator=g)) if "norm" in k else 0.3 * torch.randn(s, generator=g)
         for k, s in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(d))
    save_file(w, str(path / "model.safetensors"))
    return str(path), cfg


@pytest.mark.parametrize("dspark,backend", [(False, "standard"), (True, "standard"), (False, "latency_specialized")])
def test_drafter_in_the_engine_keeps_greedy_exact_and_reads_the_targets_taps(tmp_path, dspark, backend, monkeypatch):
    """With a DFlash (or DSpark) drafter the engine's greedy tokens equal plain greedy decoding; the context each
    propose reads from the taps buffer (each drafter layer's keys and values, written by the target's own forwards:
    prefill, verify, rollback; on the specialized path its fused step's residual) equals the one recomputed from a
    fresh forward over the same tokens (FP32 within 1e-4); DSpark's confidences reach the width chooser as
    survival probabilities."""
    from peregrine.config import EngineConfig
    from peregrine.decode.batch import StepInput
    from peregrine.engine import SamplingParams
    from peregrine.engine.build import build_engine
    from peregrine.speculative import dflash_drafter

    from conftest import write_dummy_model
    from peregrine.config import PRESET_DIR
    from test_specialized import MICRO
    (tmp_path / "target").mkdir()
    target = write_dummy_model(tmp_path / "target", json.loads((PRESET_DIR / "tiny-kimi-linear.json").read_text())
                               | MICRO, seed=1)  # narrower: the fused path runs under the interpreter here

    def engine(spec=None):
        e, _ = build_engine(target, EngineConfig(speculative_config=spec, max_num_seqs=2, block_size=16,
                                                 max_model_len=128, decode_backend=backend), log=lambda m: None)
        return e
    plain = engine()
    folder, _ = _drafter_folder(tmp_path / "d", plain.model_cfg, dspark=dspark)
    seen, surv = [], []
    real_propose = dflash_drafter.DFlashDrafter.propose

    def propose(self, seqs, ks):
        for seq, k in zip(seqs, ks):  # the context this propose reads: each layer's keys and values of the fed tokens
            n = seq.num_cached
            if k > 0 and n > 0 and len(seq.token_ids) == n + 1:
                ctx, valid = self.writer.gather(torch.tensor([seq.blocks]), torch.tensor([n]), n, self.bs)
                seen.append((list(seq.token_ids[:n]), [(kk[0].clone(), vv[0].clone()) for kk, vv in ctx]))
        out = real_propose(self, seqs, ks)
        surv.extend(self.survival.get(id(s)) for s, d in zip(seqs, out) if d)
        return out
    monkeypatch.setattr(dflash_drafter.DFlashDrafter, "propose", propose)
    spec = engine({"method": "dspark" if dspark else "dflash", "model": folder})
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (9, 23)]  # MICRO's vocabulary is 300
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert spec.generate(prompts, params) == plain.generate(prompts, params)
    st = spec.stats["spec"]
    assert st["num_drafts"] > 0 and st["verify_steps"] > 0
    if backend == "latency_specialized":  # verify and decode steps on the fused path, taps taken there
        assert spec.stats["steps_by_path"].get("latency_specialized", 0) >= st["verify_steps"] > 0
    drafter = spec.spec.drafter
    if dspark:  # the running product of the confidences: non-increasing, in (0, 1]
        assert surv and all(s is not None and all(0 < b <= a <= 1 for a, b in zip([1.0] + s, s)) for s in surv)
    else:
        assert surv and all(s is None for s in surv)
    # the taps the target wrote, against a fresh forward over the same tokens
    model, cfg = plain.runner.model, drafter.model.cfg
    checked = 0
    for toks, c in seen[:: max(1, len(seen) // 4)]:
        fresh = engine()
        rec = []
        st_in = StepInput.build([(toks, 0, 0, list(range(-(-len(toks) // 16))))], 16, "cpu")
        with torch.inference_mode():
            x = model.embed(st_in.input_ids)
            model.hidden_states(st_in, fresh.cache, rec)
        outs = {-1: x} | dict(enumerate(rec))
        want = drafter.model.context_kv(drafter.model.context(torch.cat([outs[L] for L in cfg.target_layer_ids], -1)),
                                        torch.arange(len(toks)))
        for (k, v), (wk, wv) in zip(c, want):
            assert torch.allclose(k.float(), wk, atol=1e-4, rtol=1e-4), (k.float() - wk).abs().max()
            assert torch.allclose(v.float(), wv, atol=1e-4, rtol=1e-4), (v.float() - wv).abs().max()
        checked += 1
    assert checked >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("sampled", [False, True])
def test_the_fast_path_drafts_the_next_block_inside_the_verify_step(tmp_path, monkeypatch, sampled):
    """On the fast path the verify step ends by drafting each row's next block from the accepted prefix it counted
    on the device (dflash_graphs.in_verify, in the verify graph on a GPU); a propose takes those blocks. Each taken
    block (and its confidences) equals the block a separate propose drafts for the same sequence at that point;
    answers equal plain greedy (sampled: plain sampling, the rows' tokens drawn inside the verify step, so its
    count is the host's and their blocks are taken too); a method switch leaves no drafter hooks on the target."""
    from peregrine.config import EngineConfig
    from peregrine.engine import SamplingParams
    from peregrine.engine.build import build_engine
    from peregrine.speculative import dflash_drafter

    from conftest import write_dummy_model
    from peregrine.config import PRESET_DIR
    from test_specialized import MICRO
    (tmp_path / "target").mkdir()
    target = write_dummy_model(tmp_path / "target", json.loads((PRESET_DIR / "tiny-kimi-linear.json").read_text())
                               | MICRO, seed=1)

    def engine(spec=None):
        e, _ = build_engine(target, EngineConfig(speculative_config=spec, max_num_seqs=2, block_size=16,
                                                 max_model_len=128, decode_backend="latency_specialized"),
                            log=lambda m: None)
        return e
    plain = engine()
    folder, _ = _drafter_folder(tmp_path / "d", plain.model_cfg, dspark=True)
    pairs = []
    real_propose = dflash_drafter.DFlashDrafter.propose

    def propose(self, seqs, ks):
        for seq in seqs:  # the block the verify step left, against one drafted apart now
            r = self.ready.get(id(seq))
            if r is not None and r[0] == seq.num_cached:
                d, c = self.graphs.draft([seq.blocks], [seq.num_cached], [seq.token_ids[-1]])
                pairs.append((r[1:], (d[0], None if c is None else c[0])))
        return real_propose(self, seqs, ks)
    monkeypatch.setattr(dflash_drafter.DFlashDrafter, "propose", propose)
    spec = engine({"method": "dspark", "model": folder})
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (9, 23)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, **(dict(temperature=0.7, seed=2) if sampled else {}))
    assert spec.generate(prompts, params) == plain.generate(prompts, params)
    st = spec.spec.drafter.stats
    assert st["drafted_in_verify"] > 0 and len(pairs) == st["drafted_in_verify"], st
    # FP32 on the CPU: the same blocks; BF16 on a GPU (the verify graph's B rows against one apart): near-ties aside
    fp32 = spec.runner.model.embed_tokens.dtype == torch.float32
    same = sum(d == want_d for (d, _), (want_d, _) in pairs)
    assert same == len(pairs) if fp32 else same >= 0.9 * len(pairs), (same, len(pairs))
    for (d, c), (want_d, want_c) in pairs:
        assert d != want_d or c == pytest.approx(want_c, abs=1e-5 if fp32 else 2e-2)
    runner = spec.runner
    assert runner.after_verify is not None and runner.model.taps is not None
    spec.enable_speculation({"method": "ngram", "num_speculative_tokens": 3})
    assert runner.after_verify is None and runner.model.taps is None


def test_a_drafter_context_buffer_too_big_for_the_gpu_is_a_clear_error():
    from peregrine.speculative.dflash import check_room
    cfg = DFlashConfig.from_dict({"architectures": ["Qwen3DSparkModel"], "hidden_size": 2304, "intermediate_size": 9216,
                                  "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
                                  "head_dim": 128, "block_size": 16, "mask_token_id": 1, "target_layer_ids": [3],
                                  "markov_rank": 8}, "t")
    need = 524288 * 5 * 2 * 8 * 128 * 2  # 512K slots: 20 KiB each in BF16
    assert check_room(cfg, 524288, torch.bfloat16, None, "d") == need == check_room(cfg, 524288, torch.bfloat16, need, "d")
    with pytest.raises(ConfigError, match=r"drafter d: .*524288 token slots need 10.0 GiB, more than the 8.0 GiB free: "
                                          r"lower --max-model-len or --max-num-seqs"):
        check_room(cfg, 524288, torch.bfloat16, 8 << 30, "d")


def test_speculative_config_for_drafter_folders(tmp_path):
    """{"method": "dflash" | "dspark", "model": DIR}: k defaults to the block's drafts; a missing folder, a k past
    the block and a K3 target are clear errors."""
    from peregrine.config import EngineConfig, resolve_model
    from peregrine.engine.build import build_engine
    from peregrine.speculative.config import SpeculativeConfig
    tcfg, _ = resolve_model("tiny-kimi-linear")
    zlab, _ = _drafter_folder(tmp_path / "z", tcfg, block=6)
    deep, _ = _drafter_folder(tmp_path / "s", tcfg, dspark=True, block=6)
    assert SpeculativeConfig.parse({"method": "dflash", "model": zlab}).k == 5  # z-lab: slots 1..5
    assert SpeculativeConfig.parse({"method": "dspark", "model": deep}).k == 6  # DeepSpec: every slot
    assert SpeculativeConfig.parse({"method": "dflash", "model": zlab, "num_speculative_tokens": 3}).k == 3
    with pytest.raises(ConfigError, match="num_speculative_tokens must be an int in 1..5"):
        SpeculativeConfig.parse({"method": "dflash", "model": zlab, "num_speculative_tokens": 7})
    with pytest.raises(ConfigError, match="has no config.json"):
        SpeculativeConfig.parse({"method": "dspark", "model": str(tmp_path / "none")})
    with pytest.raises(ConfigError, match='dflash needs "model"'):
        SpeculativeConfig.parse({"method": "dflash"})
    with pytest.raises(ConfigError, match="AttnRes"):
        build_engine("tiny-k3", EngineConfig(speculative_config={"method": "dflash", "model": zlab}, max_num_seqs=2,
                                             max_model_len=64), dummy_weights=True, log=lambda m: None)


def test_packed_anchors_equal_one_block_at_a_time():
    """Training packs a sequence's anchors into one call (block a sees the context before its start and its own
    block): each block's states equal the one-block call over its own context, the z-lab-checked path."""
    ref, d = zlab_reference(seed=2)
    cfg = DFlashConfig.from_dict(d, "test")
    g = torch.Generator().manual_seed(4)
    m = DFlashModel(cfg, {k: v.detach() for k, v in ref.state_dict().items() if "rotary" not in k},
                    torch.randn(V, H, generator=g), torch.randn(V, H, generator=g))
    C = 12
    kv = m.context_kv(m.context(torch.randn(C, len(TAPS) * H, generator=g)), torch.arange(C))
    starts = torch.tensor([3, 7, 12])
    ids = torch.randint(0, V - 1, (3, BLOCK), generator=g)
    ids[:, 1:] = MASK
    packed = m.hidden(ids, starts, kv)
    for a, s in enumerate(starts.tolist()):
        alone = m.hidden(ids[a], s, [(k[:s], v[:s]) for k, v in kv])
        assert torch.allclose(packed[a], alone, atol=1e-5, rtol=1e-5), a


def test_training_loss_is_deepspecs_per_anchor():
    """train/drafter.sequence_loss against DeepSpec's loss written here anchor by anchor, slot by slot: block
    [x_a, mask...] over the context before a, slot j drafting x_{a+j+1}, the Markov bias from the true previous
    token, w_j = exp(-j/4) on slots inside the sequence, L1 against the target's distribution at a+j, and the
    confidence's BCE target clamp(1 - L1/2, 0, 1)."""
    import math

    import torch.nn.functional as F

    from peregrine.train import drafter as D
    g = torch.Generator().manual_seed(6)
    tcfg = type("T", (), {"hidden_size": H, "vocab_size": V, "num_hidden_layers": TARGET_LAYERS,
                          "pad_token_id": MASK})()
    d = D.drafter_config(tcfg, 2, 4, 8, [-1, 2, 4])
    cfg = DFlashConfig.from_dict(d, "test")
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.2
    m = DFlashModel(cfg, D.init_weights(DFlashModel(cfg, {}, embed, head), 3), embed, head)
    seq, P = torch.randint(0, V - 1, (11,), generator=g).tolist(), 6
    taps, tlogits = torch.randn(11, 3 * H, generator=g), torch.randn(11, V, generator=g)
    import random
    ce, l1, bce, ws, _ = D.sequence_loss(m, taps, tlogits, seq, P, 100, random.Random(0))
    kv = m.context_kv(m.context(taps), torch.arange(11))
    want = [0.0, 0.0, 0.0, 0.0]
    w1, w2 = m.w["markov_head.markov_w1.weight"], m.w["markov_head.markov_w2.weight"]
    for a in range(P - 1, 10):
        ids = torch.tensor([seq[a]] + [cfg.mask_token_id] * 3)
        h = m.hidden(ids, a, [(k[:a], v[:a]) for k, v in kv])
        for j in range(4):
            if a + j + 1 >= 11:
                break
            wj = math.exp(-j / 4.0)
            e = w1[seq[a + j]]
            lg = h[j] @ head.T + w2 @ e
            dist = (lg.softmax(-1) - tlogits[a + j].softmax(-1)).abs().sum()
            c = torch.cat([h[j], e]) @ m.w["confidence_head.proj.weight"][0] + m.w["confidence_head.proj.bias"][0]
            want[0] += wj * F.cross_entropy(lg[None], torch.tensor([seq[a + j + 1]]))
            want[1] += wj * dist
            want[2] += wj * F.binary_cross_entropy_with_logits(c, (1 - dist / 2).clamp(0, 1).detach())
            want[3] += wj
    for got, exp in zip((ce, l1, bce, ws), want):
        assert torch.allclose(torch.as_tensor(got).float(), torch.as_tensor(exp).float(), rtol=1e-4, atol=1e-5)


def test_shipped_tiny_drafter_accepts_and_keeps_answers():
    """peregrine-tiny-dspark (trained by train/drafter.py, shipped beside the presets) loads by name against
    peregrine-tiny, keeps greedy answers, and is accepted on copy and reverse far above chance (its 500-problem
    CPU evaluation at k = 7: copy 5.92, reverse 6.13, add 3.38)."""
    from peregrine.config import EngineConfig
    from peregrine.engine import SamplingParams
    from peregrine.engine.build import build_engine
    from peregrine.eval import EVAL_SEED
    from peregrine.train import tasks
    probs = tasks.generate("copy", 6, EVAL_SEED) + tasks.generate("reverse", 6, EVAL_SEED) + tasks.generate("add", 6, EVAL_SEED)
    prompts = [p.prompt_ids() for p in probs]
    params = [SamplingParams(max_tokens=tasks.max_new_tokens(p)) for p in probs]
    out = {}
    for spec in (None, {"method": "dspark", "model": "peregrine-tiny-dspark", "num_speculative_tokens": 7}):
        e, _ = build_engine("peregrine-tiny", EngineConfig(max_num_seqs=4, max_model_len=128, speculative_config=spec),
                            log=lambda m: None)
        out[spec is None] = e.generate(prompts, params)
    assert out[False] == out[True]
    assert e.spec.mean_acceptance_length >= 3.0, e.spec.mean_acceptance_length


def test_drafter_evaluation_records_answers_acceptance_and_width(tmp_path):
    """train.drafter --eval: per task and method, answers against plain greedy, acceptance length and the width
    the verify steps ran at (full on the CPU: the standard backend has no verify graphs to time)."""
    from peregrine.train.drafter import evaluate
    r = evaluate("peregrine-tiny", "peregrine-tiny-dspark", 4, ["copy"], 7, 64, tmp_path / "e.json", log=lambda m: None)
    assert r["backend"] == "standard" and json.loads((tmp_path / "e.json").read_text())["tasks"] == r["tasks"]
    row = r["tasks"]["copy"]
    assert set(row) == {"plain", "dspark", "suffix", "ngram"}
    for m in ("dspark", "suffix", "ngram"):
        x = row[m]
        assert x["identical_to_plain"] == x["n"] == 4 and x["width"].startswith("full") and x["width_steps"] == [0] * 8
        assert x["differs"] == []
        assert x["acceptance_length"] == pytest.approx(1 + x["accepted"] / x["verifies"], abs=1e-3) and x["verifies"] > 0
    assert row["dspark"]["acceptance_length"] > 2.0


def test_divergences_name_the_first_differing_token_and_the_plain_top5():
    """An answer unlike plain greedy's is reported where it first differs, with the plain model's top logprobs
    there (taken from one step on prompt + common prefix): plain's own token first; a token outside them is no
    near tie."""
    from peregrine.config import EngineConfig
    from peregrine.engine import SamplingParams
    from peregrine.engine.build import build_engine
    from peregrine.train.drafter import divergences
    e, _ = build_engine("peregrine-tiny", EngineConfig(max_num_seqs=2, max_model_len=128), log=lambda m: None)
    prompts = [list(b"rev:abcdef|"), list(b"rev:peregrine|")]
    plain = e.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    got = [plain[0], plain[1][:3] + [(plain[1][3] + 1) % 256] + plain[1][4:]]
    d = divergences(e, prompts, plain, got)
    assert len(d) == 1 and d[0]["problem"] == 1 and d[0]["at"] == 3 and d[0]["plain"] == plain[1][3]
    assert d[0]["top"][0][0] == plain[1][3] and len(d[0]["top"]) == 5
    assert d[0]["near_tie"] == (got[1][3] in [t for t, _ in d[0]["top"]])
    far = [t for t in range(256) if t not in [x for x, _ in d[0]["top"]]][0]
    assert divergences(e, prompts, plain, [plain[0], plain[1][:3] + [far]])[0]["near_tie"] is False


def test_training_continues_from_a_drafter_folder(tmp_path):
    """--init: a saved drafter's tensors become the run's starting weights (trainable FP32, the saved values);
    a folder of another shape is refused, naming the option."""
    from safetensors.torch import save_file

    from peregrine.speculative.dflash import drafter_dir
    from peregrine.train import drafter as D
    folder = drafter_dir("peregrine-tiny-dspark")
    cfg, saved = load_folder(folder)
    fresh = D.init_weights(DFlashModel(cfg, {}, torch.zeros(cfg.vocab_size, cfg.hidden_size),
                                       torch.zeros(cfg.vocab_size, cfg.hidden_size)), 0)
    got = D.load_init(folder, fresh)
    assert set(got) == set(saved) and all(torch.equal(got[k], saved[k].float()) for k in got)
    assert all(t.requires_grad and t.dtype == torch.float32 for t in got.values())
    k = next(iter(fresh))
    save_file({**{n: t.detach() for n, t in fresh.items()}, k: torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(SystemExit, match="--init"):
        D.load_init(tmp_path, fresh)


def test_read_back_splits_one_copy_into_each_block():
    from peregrine.speculative.dflash import read_back
    got = read_back([(torch.tensor([5, 163839]), torch.tensor([0.5, 0.25])), (torch.tensor([7]), None),
                     (torch.tensor([], dtype=torch.long), torch.tensor([]))])
    assert got == [([5, 163839], [0.5, 0.25]), ([7], None), ([], [])]
