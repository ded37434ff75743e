"""latency_specialized vs standard on Kimi K3 layers (bounded-gate KDA with full-rank output gate,
q-LoRA MLA with output gate, latent MoE with SiTU, AttnRes), with BF16 and with MXFP4 experts.

CPU: a micro K3 (same layer kinds as tiny-k3, narrower) through the Triton interpreter in FP32:
logits within 1e-4 at every step and greedy tokens identical. GPU (`pytest -m gpu`): tiny-k3
in BF16 with CUDA graphs, and single steps of k3-slice (real K3 widths) from the same cache state.
"""
import json

import pytest
import torch

from conftest import DEVICE, FULL_SHAPES, dummy_model_dir
from peregrine.config import PRESET_DIR, EngineConfig, ModelConfig
from peregrine.engine import SamplingParams
from peregrine.engine.build import build_engine
from peregrine.testing import rel_rmse
from spec_helpers import verify_step_outputs
from test_spec_specialized import NEAR_TIE
from test_specialized import routing_flips

pytestmark = pytest.mark.gpu

MICRO = {  # tiny-k3's layer kinds at the interpreter's budget: dense 0, KDA, MLA, MoE, two AttnRes blocks
    "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 300, "intermediate_size": 64,
    "attn_res_block_size": 2, "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 32, "routed_expert_hidden_size": 32,
    "num_shared_experts": 1,
}
MICRO_LAC = {"full_attn_layers": [3], "kda_layers": [1, 2, 4], "head_dim": 16, "num_heads": 2}
STEPS = 256 if FULL_SHAPES else 16
TOL = 1e-4 if DEVICE == "cpu" else 3e-2  # FP32 on CPU; BF16 on the GPU
# GPU, a step over TOL before any flip: the BF16 paths drift apart over the steps (KDA state, caches)
# with random weights. It still passes where the specialized logits are no further than this factor
# times the standard path's from an FP32 standard run of the same history (docs/correctness.md §1's reference).
DRIFT_SLACK = 2.0


def k3_raw(mxfp4: bool) -> dict:
    raw = json.loads((PRESET_DIR / "tiny-k3.json").read_text())
    t = raw["text_config"]
    if not FULL_SHAPES:
        t.update(MICRO)
        t["linear_attn_config"].update(MICRO_LAC)
    if not mxfp4:
        t.pop("quantization_config")
    return raw


@pytest.fixture(scope="module", params=["mxfp4", "bf16"])
def model_dir(request, tmp_path_factory):
    raw = k3_raw(request.param == "mxfp4")
    cfg = ModelConfig.from_dict(raw)
    assert cfg.is_k3 and (cfg.expert_quant == "mxfp4") == (request.param == "mxfp4")
    return dummy_model_dir(tmp_path_factory, raw, f"k3-{request.param}", seed=5)


def engine(model_dir, backend, routing=None, **kw):
    """Records (path, logits) per step; with `routing` (a list) also each decode step's routed expert
    ids per MoE layer, [layers, B, k] (eager steps only: pass cuda_graphs=False)."""
    ecfg = EngineConfig(decode_backend=backend, max_num_seqs=4, max_model_len=512, block_size=16, **kw)
    e, _ = build_engine(model_dir, ecfg, log=lambda m: None)
    logits = []
    fwd = e.runner.forward
    moes = [l.mlp for l in e.runner.model.layers if l.is_moe]

    def recording(step):
        out = fwd(step)
        logits.append((e.runner.last_path, out.detach().float().cpu().clone()))
        if routing is not None:
            routing.append(torch.stack([m.last_ids.sort(-1).values.cpu() for m in moes]) if step.is_decode else None)
        return out
    e.runner.forward = recording
    fwd_pieces = e.runner.forward_pieces

    def pieces(step, n):  # a prefill chunk run in pieces beside decodes: always the standard path's
        e.piece_steps.append(step.num_seqs)
        return fwd_pieces(step, n)
    e.piece_steps, e.runner.forward_pieces = [], pieces
    return e, logits


def greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def fp32_truth(model_dir, ps, a, b):
    """The standard path in FP32 over the same prompts: (its per-step logits, per request the first
    step no longer comparable: its history differs from either BF16 run's). Its routing may differ
    from the BF16 runs' (router near-ties); where it is compared, the two BF16 runs route alike, so
    such a difference moves both of them away from it equally."""
    ref, lref = engine(model_dir, "standard", dtype="float32", cuda_graphs=False)
    c = ref.generate(ps, greedy(STEPS))
    until = [next((i for i, (x, y, z) in enumerate(zip(a[r], b[r], c[r])) if not x == y == z), STEPS) + 1
             for r in range(len(ps))]  # a token at step i feeds step i + 1
    return lref, until


def test_logits_close_and_tokens_identical(model_dir):
    """As tests/test_specialized.py: FP32 exact; in BF16 a token or router near-tie may split the paths
    (steps run eagerly on the GPU to record routing): a step over tolerance must be where the routed
    experts first differ, every earlier step within tolerance."""
    ps = [[5, 17, 99, 3, 250], [42, 7]]
    eager = dict(cuda_graphs=False) if DEVICE == "cuda" else {}
    rstd, rspec = [], []
    std, lstd = engine(model_dir, "standard", routing=rstd, **eager)
    spec, lspec = engine(model_dir, "latency_specialized", routing=rspec, **eager)
    a = std.generate(ps, greedy(STEPS))
    b = spec.generate(ps, greedy(STEPS))
    paths = [p for p, _ in lspec]
    assert paths[0] == "standard" and set(paths[1:]) == {"latency_specialized"}, paths
    reasons = spec.stats["fallback_reasons"]
    assert not any("unsupported" in r for r in reasons), reasons
    assert len(lstd) == len(lspec) == STEPS
    div = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), None) for ra, rb in zip(a, b)]
    if DEVICE == "cpu":
        assert div == [None, None], f"FP32 greedy tokens differ at {div}"
    assert len({t for r in a for t in r}) > 4, "degenerate model: (almost) the same token every step"
    flips = routing_flips(rstd, rspec, len(ps))
    if DEVICE == "cpu":
        assert flips == [None, None], f"FP32 routing differs at steps {flips}"
    truth = fp32_truth(model_dir, ps, a, b) if DEVICE == "cuda" else None
    for i, ((_, x), (_, y)) in enumerate(zip(lstd, lspec)):
        for r in range(len(ps)):
            if div[r] is not None and i > div[r] or flips[r] is not None and i > flips[r]:
                continue  # BF16 near-tie flipped a token or an expert: histories differ from here on
            err = rel_rmse(y[r], x[r])
            if err >= TOL and i != flips[r] and truth is not None and i < truth[1][r]:
                z = truth[0][i][1][r]  # both BF16 paths drift from FP32 over the steps: the fused one no more
                e_spec, e_std = rel_rmse(y[r], z), rel_rmse(x[r], z)
                assert e_spec <= DRIFT_SLACK * e_std, (
                    f"request {r} step {i}: specialized {e_spec:.2e} from FP32, standard {e_std:.2e} (apart {err:.2e})")
            else:
                assert err < TOL or i == flips[r], (f"request {r} step {i}: logits relative error {err:.2e} (routing "
                                                    f"flips {flips}, FP32 history comparable until {truth and truth[1]})")
            if i == div[r] and i != flips[r]:  # a token flip must be a near-tie (vLLM's check_logprobs_close rule)
                assert b[r][i] in x[r].topk(5).indices.tolist() and a[r][i] in y[r].topk(5).indices.tolist()


def test_prefill_joining_mid_generation(model_dir):
    """Decode steps on the specialized path, a prefill step (standard) in between: tokens equal runs that
    never switched — standard ones in FP32; in BF16 (where the paths may part at near-ties) each
    request alone on the specialized path, which only ever prefills its own prompt."""
    pa, pb = [9, 8, 7, 6], [1, 2, 3]
    ref, _ = engine(model_dir, "standard" if DEVICE == "cpu" else "latency_specialized")
    want = ref.generate([pa], greedy(8))[0], ref.generate([pb], greedy(4))[0]
    spec, log = engine(model_dir, "latency_specialized")  # B's prefill in pieces beside A's decode steps
    got = {}
    spec.add_request(pa, greedy(8), on_token=lambda o: o.finished and got.__setitem__("a", o.output_token_ids))
    for _ in range(3):
        spec.step()
    spec.add_request(pb, greedy(4), on_token=lambda o: o.finished and got.__setitem__("b", o.output_token_ids))
    while spec.has_unfinished():
        spec.step()
    assert (got["a"], got["b"]) == want
    paths = [p for p, _ in log]
    assert paths.count("latency_specialized") >= 5 and spec.piece_steps == [1] and set(paths[1:]) == {"latency_specialized"}, paths


def test_speculative_verify_on_k3_runs_specialized_and_keeps_tokens(model_dir):
    """Speculative verify steps on K3 layers run on the specialized path (none falls back), and greedy output
    equals plain greedy output (FP32). In BF16 a verify step scores several positions in one forward, which
    rounds differently from one position a step: the first differing token must then be a near-tie of the
    plain run (test_spec_specialized's rule, docs/correctness.md §2)."""
    p = [4, 4, 5, 4, 4, 5, 4, 4, 5, 4, 4]
    plain, logs = engine(model_dir, "standard")
    want = plain.generate([p], greedy(12))[0]
    spec, slog = engine(model_dir, "latency_specialized",
                        speculative_config={"method": "draft_model", "model": model_dir, "num_speculative_tokens": 2})
    got = spec.generate([p], greedy(12))[0]
    i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if DEVICE == "cpu" or i is None:
        assert got == want
    else:  # plain step i (step 0 the prefill) produced token i
        top = logs[i][1][0].topk(2).values
        assert (top[0] - top[1]) / top[0].abs() < NEAR_TIE, f"token {i}: {got[i]} for {want[i]}, not a near tie {top}"
    assert spec.stats["spec"]["num_drafts"] > 0  # the model drafts for itself: every step verifies
    assert set(spec.stats["fallback_reasons"]) == {"prefill in batch"}, spec.stats["fallback_reasons"]  # the prompt only
    paths = [path for path, _ in slog]
    assert paths[0] == "standard" and set(paths[1:]) == {"latency_specialized"}, paths


def test_k3_verify_step_matches_standard(model_dir):
    """One verify step of T = 3 tokens for 2 sequences from the same cache contents: the specialized K3 step's
    logits, per-position KDA checkpoints, states and MLA cache equal the standard path's (verify as a chunk)."""
    std, _ = engine(model_dir, "standard")
    spec, _ = engine(model_dir, "latency_specialized")
    ps = [[3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8, 9, 7]]
    for e in (std, spec):
        e.generate(ps, greedy(3))  # real cache contents in slots 0, 1
    for name in ("state", "conv", "latent"):
        getattr(spec.cache, name).copy_(getattr(std.cache, name))
    T, c = 3, std.cache
    rows = [([7, 8, 9], 8, 0, [0]), ([1, 2, 3], 10, 1, [c.block_size * 2])]
    outs = verify_step_outputs((std, spec), rows, T)
    (l0, ck0, s0, lat0), (l1, ck1, s1, lat1) = outs
    assert torch.isfinite(ck1[0]).all() and torch.isfinite(ck1[1].float()).all(), "checkpoint not fully written"
    for a, b, what in ((l0, l1, "logits"), (ck0[0], ck1[0], "state checkpoints"), (ck0[1], ck1[1], "conv checkpoints"),
                       (s0, s1, "state after the step"), (lat0, lat1, "MLA cache")):
        assert rel_rmse(b.float(), a.float()) < TOL, what


def test_mxfp4_v4_repacked_experts_keep_tokens(model_dir, monkeypatch):
    """PEREGRINE_MXFP4=v4: the runner repacks the MXFP4 experts in place (kernels/mxfp4_repack.py) and decodes
    through kernels/moe_mxfp4_v4.py (its portable form on the CPU) while the standard path (prefill) dequantizes
    the repacked tensors: logits close to and tokens equal to an engine that kept the checkpoint layout."""
    if "mxfp4" not in model_dir:
        pytest.skip("BF16 experts: nothing to repack")
    from peregrine.decode.specialized import MXFP4_ENV
    ps = [[3, 1, 4, 1, 5], [9, 2, 6]]
    ref, lref = engine(model_dir, "latency_specialized")
    want = ref.generate(ps, greedy(6))
    monkeypatch.setenv(MXFP4_ENV, "v4")
    e, log = engine(model_dir, "latency_specialized")
    moes = [l.mlp for l in e.runner.model.layers if l.is_moe]
    assert e.runner.mxfp4 == "v4" and all(m.mx_layout == "v4" for m in moes)
    assert e.generate(ps, greedy(6)) == want
    assert [p for p, _ in log] == [p for p, _ in lref]
    for (_, a), (_, b) in zip(lref, log):
        assert rel_rmse(b, a) < TOL
    monkeypatch.setenv(MXFP4_ENV, "v5")
    with pytest.raises(ValueError, match="PEREGRINE_MXFP4='v5'"):
        engine(model_dir, "latency_specialized")


@pytest.mark.skipif(DEVICE != "cuda", reason="k3-slice needs an H200")
@pytest.mark.parametrize("quant", ["mxfp4", "bf16", "mxfp4-v4"])
def test_k3_slice_steps_match_standard(quant, tmp_path, monkeypatch):
    """Real K3 widths (hidden 7168, 96 heads, latent 3584, 192 experts top-16): one specialized
    decode step and one standard step from the same caches give close logits and states (mxfp4-v4: the experts
    repacked in place for kernels/moe_mxfp4_v4.py, PEREGRINE_MXFP4=v4, which the standard step reads too)."""
    from peregrine.decode.batch import StepInput
    from peregrine.decode.specialized import MXFP4_ENV
    if quant == "mxfp4-v4":
        monkeypatch.setenv(MXFP4_ENV, "v4")
    raw = json.loads((PRESET_DIR / "k3-slice.json").read_text())
    if quant == "bf16":
        raw["text_config"].pop("quantization_config")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    e, _ = build_engine(str(tmp_path), EngineConfig(decode_backend="latency_specialized", max_num_seqs=8,
                                                    max_model_len=256, block_size=64, cuda_graphs=False),
                        dummy_weights=True, log=lambda m: None)
    r, c = e.runner, e.runner.cache
    e.generate([[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]], greedy(3))  # real cache content
    st = StepInput.build([([7], 7, 0, [0]), ([11], 5, 1, [1]), ([13], 9, 2, [2])], c.block_size, c.latent.device)
    saved = [t.clone() for t in (c.state, c.conv, c.latent)]
    moes = [l.mlp for l in r.model.layers if l.is_moe]
    with torch.inference_mode():
        want = r.standard._forward(st).float()
        ids_std = [m.last_ids.sort(-1).values.clone() for m in moes]
        after = [t.clone() for t in (c.state, c.conv)]
        for t, s in zip((c.state, c.conv, c.latent), saved):
            t.copy_(s)
        got, _ = r._step(st)
        ids_spec = [m.last_ids.sort(-1).values for m in moes]
    # a BF16 router near-tie (top-16 of 192) may swap an expert for a row: that row's logits then
    # differ by design; every row whose experts agree in every layer must be close
    flipped = [any(not torch.equal(x[i], y[i]) for x, y in zip(ids_std, ids_spec)) for i in range(3)]
    for i in range(3):
        assert flipped[i] or rel_rmse(got[i], want[i]) < TOL, f"row {i}: {rel_rmse(got[i], want[i]):.2e}, flips {flipped}"
    if not any(flipped):  # after a flip the later layers' inputs, so their states, differ by design
        assert rel_rmse(c.state, after[0]) < TOL and rel_rmse(c.conv, after[1]) < TOL
