"""The prefill MoE's fused gather + up GEMM + SwiGLU (peregrine/kernels/moe_gate_up.py) against its FP32
reference and against grouped_experts' unfused form, with poisoned outputs, odd widths and experts that
get no pair, one pair or more than a tile."""
import pytest
import torch

from conftest import FULL_SHAPES
from peregrine import kernels
from peregrine.kernels.moe_gate_up import DEFAULT, GateUpConfig, gate_up_swiglu, gate_up_swiglu_ref, plan_tiles
from peregrine.testing import assert_close, poisoned

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# (N tokens, E experts, k, D, I): odd widths; more pairs of one expert than a 32-row tile; 48B widths on the GPU
SHAPES = [(29, 12, 4, 40, 24), (70, 5, 2, 33, 17), (3, 8, 3, 16, 16)] + ([(1024, 256, 8, 2304, 1024)] if FULL_SHAPES else [])


def _case(N, E, k, D, I, dtype, device, seed, skewed=False):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(N, D, generator=g, device=device) / 2).to(dtype)
    w13 = (torch.randn(E, 2 * I, D, generator=g, device=device) / D ** 0.5).to(dtype)
    scores = torch.rand(N, E, generator=g, device=device)
    if skewed:  # expert 0 for every token, the last expert for none
        scores[:, 0] += 2
        scores[:, -1] -= 2
    w, ids = scores.topk(k, -1)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    return x, w13, flat, order, w.flatten()[order].float()


def _skip_without_kernels(device):
    if not kernels.available(device):
        pytest.skip("triton kernels unavailable")


@pytest.mark.parametrize("block_m", [4, 32])
def test_plan_tiles_covers_every_sorted_pair_once_with_its_expert(block_m, device):
    N, E, k = 29, 12, 4
    _, _, flat, order, _ = _case(N, E, k, 8, 8, torch.float32, device, 1, skewed=True)
    rowmap, expert, used = plan_tiles(flat, order, E, block_m)
    assert expert.numel() == N * k // block_m + E and rowmap.numel() == expert.numel() * block_m
    real = rowmap.view(-1, block_m)[: int(used)]
    i = real[real >= 0].long()
    assert torch.equal(torch.sort(i).values, torch.arange(N * k, device=device))  # each pair once
    rows_expert = expert[: int(used)].long()[:, None].expand_as(real)
    assert torch.equal(flat[order][i], rows_expert[real >= 0])  # a tile holds one expert's pairs
    assert (rowmap.view(-1, block_m)[int(used):] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,E,k,D,I", SHAPES)
def test_gate_up_swiglu_equals_its_reference(N, E, k, D, I, dtype, device):
    _skip_without_kernels(device)
    x, w13, flat, order, ws = _case(N, E, k, D, I, dtype, device, N + E, skewed=N == 70)
    out = poisoned((N * k, I), dtype, device)
    assert gate_up_swiglu(x, w13, flat, order, ws, k, out=out) is out
    assert_close(out, gate_up_swiglu_ref(x, w13, flat, order, ws, k), TOL[dtype])


def test_gate_up_swiglu_tiles_smaller_than_the_defaults(device):
    """A config whose tiles cut every width (M, N and K loops of several steps with ragged ends)."""
    _skip_without_kernels(device)
    x, w13, flat, order, ws = _case(29, 12, 4, 40, 24, torch.float32, device, 5)
    got = gate_up_swiglu(x, w13, flat, order, ws, 4, config=GateUpConfig(16, 16, 16, 4, 1))
    assert_close(got, gate_up_swiglu_ref(x, w13, flat, order, ws, 4), TOL[torch.float32])
    assert DEFAULT.block_m >= 64  # the GPU's tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_with_the_fused_up_gemm_equals_its_unfused_form(dtype, device, monkeypatch):
    from peregrine.models import moe as M
    from peregrine.models.layers import swiglu
    _skip_without_kernels(device)
    N, E, k, D, I = 29, 12, 4, 40, 24
    x, w13, _, _, _ = _case(N, E, k, D, I, dtype, device, 6)
    w2 = (torch.randn(E, D, I, device=device) / I ** 0.5).to(dtype)
    ids, w = M.select(torch.randn(N, E, device=device), torch.zeros(E, device=device), k, True, 2.5)
    monkeypatch.setattr(M, "FUSED_GLUE", True)
    out = {}
    for on in (True, False):
        monkeypatch.setattr(M, "FUSED_GATE_UP", on)
        out[on] = M.grouped_experts(x, w13, w2, ids, w, swiglu)
    assert not out[True].isnan().any()
    assert_close(out[True], out[False], TOL[dtype])


def test_bench_smoke_on_cpu(monkeypatch):
    """bench moe_grouped at tiny widths (fake clock, torch's CPU grouped GEMM): every form and candidate runs,
    the floors count what the step moves."""
    from peregrine.bench import moe_grouped as bench
    if torch.cuda.is_available() or not kernels.available("cpu"):
        pytest.skip("the GPU pass runs the real benchmark")
    for name, val in dict(DEVICE="cpu", TOKENS=(5, 9), E=12, I=16, D=24, DTYPE=torch.float32, CANDIDATES_MIN_TOKENS=9).items():
        monkeypatch.setattr(bench, name, val)
    monkeypatch.setattr(bench, "graph_time", lambda calls, iters: ([c() for c in calls], (2.0, [2.0]))[-1])
    rows = bench.run(1000.0)
    assert [r["tokens"] for r in rows] == [5, 9] and not rows[0]["up_fused_candidates_ms"]
    assert len(rows[1]["up_fused_candidates_ms"]) == len(bench.GATE_UP_CANDIDATES)
    r = rows[1]
    assert r["act_bytes"] == 9 * 8 * (24 + 2 * 16 + 16 + 24) * 4 and r["flop"] == 2 * 9 * 8 * (2 * 16 * 24 + 16 * 24)
    assert r["weight_bytes"] == r["experts_used"] * (2 * 16 * 24 + 24 * 16) * 4


def test_compiles_for_sm90_on_the_tensor_cores():
    """Ahead of time for sm_90a in BF16 at 48B widths (no GPU needed): the default and every benchmark
    candidate compile to wgmma with cp.async loads and spill nothing."""
    from conftest import run_aot
    rows = run_aot("import json; from peregrine.bench import moe_grouped as b; print(json.dumps(b.compile_check()))")
    for r in rows:
        assert "error" not in r and r["spill"] == 0 and r["wgmma"] > 0 and r["cp_async"] > 0, r
