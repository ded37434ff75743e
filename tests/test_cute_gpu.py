"""CuTe kernels on the GPU (issue #46), from the libraries scripts/build_cute_gpu.sh builds on a CPU machine (.cute/,
carried to the device): the persistent task kernel over the 48B layer's dense GEMV chain, its MoE block (router,
top-k, routed experts, shared expert, combine) and the whole KDA layer equals the ops' FP32 reference (the router's
choice exactly, the KDA states too)
over two steps whose counters are never zeroed, and a wait that can never be met writes the error word and returns
instead of hanging. Skipped without a GPU or without the built library (the chain-layer arithmetic of bench
kernels_cute --chain runs on the CPU)."""
import json
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "moe", "layer"])
@pytest.mark.parametrize("B", [1, 2, 4, 8])
def test_persistent_equals_its_ops_and_trips_its_error_word(case, B):
    path = os.path.join(ROOT, ".cute", f"libpersistent-48b{case}-b{B}.so")
    if not torch.cuda.is_available() or not os.path.exists(path):
        pytest.skip("needs a GPU and .cute/ from scripts/build_cute_gpu.sh")
    from peregrine.bench.kernels_cute import TOL, persistent_case
    row = persistent_case(path, timed=False)
    assert "error" not in row, json.dumps(row)[:4000]  # its per-step and per-op errors, whole
    assert row["rel_err"] < TOL and row["error_word"] == 0 and all(row.get("ids_equal", [True])), json.dumps(row)[:4000]
    assert row["missing_dep"]["error_word"] == row["missing_dep"]["want"], row


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8])
def test_persistent_layer_equals_the_models_own_layer(B):
    """The persistent kernel against the model's code path, not only the ops' reference: a 48B KDA + MoE decoder
    layer (models/kimi.py, BF16, dummy weights) through its standard decode forward, and the same layer's table
    (persistent/tasks.py's from_layer) through the built library: outputs within BF16's relative error, KDA states
    too (docs/correctness.md: different paths agree to the model dtype's rounding)."""
    import json
    from types import SimpleNamespace
    path = os.path.join(ROOT, ".cute", f"libpersistent-48blayer-b{B}.so")
    if not torch.cuda.is_available() or not os.path.exists(path):
        pytest.skip("needs a GPU and .cute/ from scripts/build_cute_gpu.sh")
    from peregrine.config import resolve_model
    from peregrine.kernels.cute import persistent_layer as tg
    from peregrine.models.kimi import DecoderLayer
    from peregrine.persistent import table as tb
    from peregrine.persistent.tasks import from_layer
    cfg, _ = resolve_model("kimi-linear-48b-a3b")
    i = next(j for j in cfg.kda_layers if cfg.is_moe(j))
    g = torch.Generator(device="cuda").manual_seed(B)
    layer = DecoderLayer(cfg, i, torch.bfloat16).cuda()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.1
            p.copy_(torch.randn(p.shape, device="cuda", generator=g) * scale + (1.0 if p.dim() == 1 and "norm" in name else 0.0))
    compiled = json.load(open(path[:-3] + ".json"))
    compiled.pop("case")
    S, H, d, W = compiled["kda_slots"], cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    slots = torch.randperm(S, device="cuda", generator=g)[:B]
    state = 0.1 * torch.randn(S, H, d, d, device="cuda", generator=g)
    conv = torch.randn(S, W - 1, 3 * H * d, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(B, cfg.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    step = SimpleNamespace(input_ids=torch.zeros(B, dtype=torch.long, device="cuda"), q_lens=[1] * B, kda_slots=slots)
    cache = SimpleNamespace(kda_index={i: 0}, state=[state.clone()], conv=[conv.clone()])
    with torch.no_grad():
        want = layer(x, step, cache).float()
    ops, width, consts, out = tb.kda_layer(from_layer(layer, cfg), cfg.routed_scaling_factor)
    t = tb.encode(ops, width, compiled["ctas"], B)
    kda = {"state": state.clone(), "conv_state": conv.float(), "slots": slots.to(torch.int32)}
    run = tg.Runner(path, t, B, compiled, kda)
    act = torch.full((B, width), float("nan"), device="cuda")
    tb.load_consts(act, consts)
    act[:, :cfg.hidden_size] = x.float()
    run.step(act)
    torch.cuda.synchronize()
    assert run.error() == 0
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(act[:, out:out + cfg.hidden_size], want) < 2e-2
    assert rel(kda["state"], cache.state[0].float()) < 2e-2


def test_chain_layer_is_the_difference_of_two_steps(tmp_path):
    """bench kernels_cute --chain: one layer of today's chain is the two-layer step's graph replay minus the
    one-layer step's, per B (CPU: bench decode's JSON layout written here)."""
    import json
    from peregrine.bench.kernels_cute import chain_layer_ms
    for n, ms in ((1, (1.0, 1.5)), (2, (1.25, 1.875))):
        d = tmp_path / f"c{n}"
        d.mkdir()
        rows = [{"batch": B, "graph_replay_ms": m, "distinct_experts_mean": 8.0 * B} for B, m in zip((1, 8), ms)]
        (d / "x-decode.json").write_text(json.dumps({"backends": {"latency_specialized": {"batches": rows}}}))
    got = chain_layer_ms(str(tmp_path / "c1"), str(tmp_path / "c2"))
    assert got == {1: {"chain_layer_ms": 0.25, "chain_experts": 8.0}, 8: {"chain_layer_ms": 0.375, "chain_experts": 64.0}}
