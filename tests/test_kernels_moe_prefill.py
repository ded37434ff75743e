"""The MoE prefill glue kernels (peregrine/kernels/moe_prefill.py) against FP32 math written here, on odd
and real shapes, into poisoned outputs inside wider SENTINEL buffers (columns past the output untouched);
then grouped_experts with them against its torch form."""
import pytest
import torch

from conftest import FULL_SHAPES
from peregrine import kernels
from peregrine.kernels.moe_prefill import combine, gather_pairs, swiglu_weighted
from peregrine.testing import SENTINEL, assert_close

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}  # BF16: an FP32 sigmoid ulp may flip a rounding
SAME = 0.9  # BF16: at least this share of elements bitwise equal to the reference's (its rounding points)
PI = [(1, 16), (37, 100), (64, 24)] + ([(8192, 1024), (333, 1024)] if FULL_SHAPES else [])
NKD = [(1, 1, 16), (5, 3, 100), (33, 8, 72)] + ([(1024, 8, 2304), (77, 8, 7168)] if FULL_SHAPES else [])
PAD = 3  # SENTINEL columns right of each output


def ref_swiglu_weighted(gu, w):
    g, u = gu.double().chunk(2, dim=-1)
    a = (g * torch.sigmoid(g) * u).to(gu.dtype)  # the activation's rounding
    return (a.double() * w.double()[:, None]).to(gu.dtype)


def ref_combine(ys, inv, k, add=()):
    y = ys.double()[inv].view(-1, k, ys.shape[1]).sum(1).to(ys.dtype)
    for a in add:  # each add rounded to the model dtype, as `y + a`
        y = (y.double() + a.double()).to(ys.dtype)
    return y


def _rand(shape, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device).mul(2).to(dtype)


def _boxed(rows, cols, dtype, device):
    """A NaN output [rows, cols] inside a SENTINEL buffer [rows, cols + PAD]."""
    buf = torch.full((rows, cols + PAD), SENTINEL, dtype=dtype, device=device)
    buf[:, :cols] = float("nan")
    return buf, buf[:, :cols]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("P,I", PI)
def test_swiglu_weighted(P, I, dtype, device):
    gu = _rand((P, 2 * I), dtype, device, 0)
    w = torch.rand(P, generator=torch.Generator(device=device).manual_seed(1), device=device)
    buf, out = _boxed(P, I, dtype, device)
    swiglu_weighted(gu, w, out=out)
    assert not out.isnan().any()
    ref = ref_swiglu_weighted(gu, w)
    assert_close(out, ref, TOL[dtype])
    assert dtype == torch.float32 or (out == ref).float().mean() >= SAME
    assert (buf[:, I:] == SENTINEL).all()
    assert torch.equal(swiglu_weighted(gu, w), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,k,D", NKD)
def test_combine(N, k, D, dtype, device):
    ys = _rand((N * k, D), dtype, device, 2)
    inv = torch.randperm(N * k, generator=torch.Generator().manual_seed(3)).to(device)
    buf, out = _boxed(N, D, dtype, device)
    combine(ys, inv, k, out=out)
    assert not out.isnan().any()
    ref = ref_combine(ys, inv, k)
    assert_close(out, ref, TOL[dtype])
    assert dtype == torch.float32 or (out == ref).float().mean() >= SAME
    assert (buf[:, D:] == SENTINEL).all()
    assert torch.equal(combine(ys, inv, k), out)  # a fixed order: bitwise reproducible


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_add", [1, 2])
@pytest.mark.parametrize("N,k,D", NKD[1:] + [(3, 2, 1030)])
def test_combine_adds_its_addends_as_the_separate_adds_would(N, k, D, n_add, dtype, device):
    """combine(..., add=(shared, residual)): the sum over k, then each addend, rounded after each add. Against
    the FP64 reference rounded at the same points; and bitwise the same as the kernel's sum followed by torch's
    adds (the chain it replaces in models/moe.py), addends read through row strides wider than D."""
    ys = _rand((N * k, D), dtype, device, 2)
    inv = torch.randperm(N * k, generator=torch.Generator().manual_seed(3)).to(device)
    add = tuple(_rand((N, D + 5), dtype, device, 10 + i)[:, 2:2 + D] for i in range(n_add))  # strided rows
    keep = [a.clone() for a in add]
    buf, out = _boxed(N, D, dtype, device)
    combine(ys, inv, k, out=out, add=add)
    assert not out.isnan().any()
    ref = ref_combine(ys, inv, k, add)
    assert_close(out, ref, TOL[dtype] * (1 + n_add))
    assert dtype == torch.float32 or (out == ref).float().mean() >= SAME
    chain = combine(ys, inv, k)
    for a in add:
        chain = chain + a
    assert torch.equal(out, chain)
    assert (buf[:, D:] == SENTINEL).all() and all(torch.equal(a, b) for a, b in zip(add, keep))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,k,D", NKD + [(3, 2, 1030)])  # 1030: a second, ragged column block
def test_gather_pairs(N, k, D, dtype, device):
    """Sorted pairs' rows from a strided x (rows wider than D): bitwise copies, row p = token order[p] // k."""
    wide = _rand((N, D + 5), dtype, device, 4)
    x = wide[:, :D]
    order = torch.randperm(N * k, generator=torch.Generator().manual_seed(5)).to(device)
    buf, out = _boxed(N * k, D, dtype, device)
    before = wide.clone()
    gather_pairs(x, order, k, out=out)
    want = torch.stack([x[int(p) // k] for p in order.tolist()])
    assert torch.equal(out, want)
    assert (buf[:, D:] == SENTINEL).all() and torch.equal(wide, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_with_the_glue_kernels_equals_its_torch_form(dtype, device, monkeypatch):
    """Routed tokens through grouped_experts with the kernels and with the torch form (the loop over
    used experts on the CPU, the grouped GEMM on the GPU in BF16): the same [N, D] output."""
    from peregrine.models import moe as M
    from peregrine.models.layers import swiglu
    if not kernels.available(device):
        pytest.skip("triton kernels unavailable")
    N, E, k, D, I = 29, 12, 4, 40, 24
    x = _rand((N, D), dtype, device, 4) / 4
    w13 = _rand((E, 2 * I, D), dtype, device, 5) / D ** 0.5
    w2 = _rand((E, D, I), dtype, device, 6) / I ** 0.5
    ids, w = M.select(_rand((N, E), torch.float32, device, 7), torch.zeros(E, device=device), k, True, 2.5)
    out = {}
    for on in (True, False):
        monkeypatch.setattr(M, "FUSED_GLUE", on)
        assert M.fused_glue(x, swiglu) == on
        out[on] = M.grouped_experts(x, w13, w2, ids, w, swiglu)
    assert not out[True].isnan().any()
    assert_close(out[True], out[False], TOL[dtype])


def test_bench_smoke_on_cpu(monkeypatch):
    """The microbenchmark's cases at tiny widths (fake clock): both forms run, bytes count what they move."""
    from peregrine.bench import kernels, kernels_moe_prefill as bench
    assert "moe_prefill" in kernels.FAMILIES
    if not kernels_available_on_cpu():
        pytest.skip("the GPU pass runs the real benchmark")
    for name, val in dict(DEVICE="cpu", TOKENS=(3, 5), I=16, D=24, DTYPE=torch.float32).items():
        monkeypatch.setattr(bench, name, val)
    ran = []
    monkeypatch.setattr(bench, "graph_time", lambda calls, iters: (ran.append(len(calls)), [c() for c in calls], (2.0, [2.0]))[-1])
    rows = bench.run(1000.0)
    assert [r["kernel"] for r in rows] == ["gather_pairs", "swiglu_weighted", "combine", "combine_add2"] * 2
    assert len(ran) == 16 + 2 * len(bench.GATHER_TILES) and set(rows[0]["tiles_ms"]) == {f"{r}x{b}" for r, b in bench.GATHER_TILES}
    P = 5 * bench.TOP_K
    assert rows[4]["bytes"] == 5 * 24 * 2 + P * 8 + P * 24 * 2
    assert rows[5]["bytes"] == P * 2 * 16 * 2 + P * 4 + P * 16 * 2
    assert rows[6]["bytes"] == P * 24 * 2 + P * 8 + 5 * 24 * 2
    assert rows[7]["bytes"] == P * 24 * 2 + P * 8 + 3 * 5 * 24 * 2
    assert rows[6]["gbps"] == rows[6]["bytes"] / 2.0 / 1e6 and rows[6]["pct_of_copy"] == rows[6]["gbps"] / 1000.0


def kernels_available_on_cpu() -> bool:
    return not torch.cuda.is_available() and kernels.available("cpu")


def test_compiles_for_sm90():
    """Ahead of time for sm_90a in BF16 (no GPU needed): both kernels compile (the rounding's integer
    ops type-check as the GPU compiler sees them) and spill nothing."""
    from conftest import run_aot
    rows = run_aot("import json; from peregrine.bench import kernels_moe_prefill as b; print(json.dumps(b.compile_check()))")
    for r in rows:
        assert "error" not in r and r["regs"] > 0 and r["spill"] == 0, r


ROUTER_IDS_SAME = 0.99  # rows whose top-8 experts match the FP32 form's (a near-tie may flip the 8th)


@pytest.mark.skipif(not torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA GPU (mm with an FP32 out_dtype is CUDA-only)")
def test_gpu_bf16_router_gemm_equals_the_fp32_form():
    """The prefill router's BF16 GEMM with FP32 accumulation and output against the FP32 form written here
    (both BF16 operands up-cast): 48B shapes, logits within FP32 summation-order error, the same top-8
    experts on nearly every row, and the fast form taken (not its fallback)."""
    from peregrine.models import moe as M
    N, D, E = 8192, 2304, 256
    x = _rand((N, D), torch.bfloat16, "cuda", 11)
    w = (_rand((E, D), torch.float32, "cuda", 12) / D ** 0.5).to(torch.bfloat16)
    ref = x.double() @ w.double().T
    got = M.router_gemm(x, w)
    assert M.BF16_ROUTER is not False and got.dtype == torch.float32
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    bias = torch.zeros(E, device="cuda")
    same = (M.select(got, bias, 8, True, 1.0)[0] == M.select(ref.float(), bias, 8, True, 1.0)[0]).all(-1)
    assert same.float().mean() >= ROUTER_IDS_SAME
    small = M.router_gemm(x[:M.GLUE_MIN_TOKENS - 1], w)  # a decode-sized step: the FP32 form, bitwise
    assert torch.equal(small, x[:M.GLUE_MIN_TOKENS - 1].float() @ w.float().T)


@pytest.mark.parametrize("E,k,renorm", [(256, 8, True), (12, 4, False), (40, 3, True)])
def test_prefill_routing_kernel_equals_select(E, k, renorm, device, monkeypatch):
    """route_logits on a prefill-sized step (the top-k kernel) against select's torch form: the same experts in
    the same order and the same weights to FP32 rounding; a decode-sized step keeps select, bitwise."""
    from peregrine.models import moe as M
    if not kernels.available(device):
        pytest.skip("triton kernels unavailable")
    N = 70
    logits = _rand((N, E), torch.float32, device, 13) * 3
    bias = _rand((E,), torch.float32, device, 14) / 10
    x = torch.zeros(N, 8, device=device)
    monkeypatch.setattr(M, "FUSED_ROUTER", True)
    ids, w = M.route_logits(logits, bias, k, renorm, 2.5, x)
    want_ids, want_w = M.select(logits, bias, k, renorm, 2.5)
    assert ids.dtype == torch.int64 and torch.equal(ids, want_ids)
    assert_close(w, want_w, 1e-6)
    monkeypatch.setattr(M, "FUSED_ROUTER", None)  # None: on the GPU for >= 64 rows outside FP32; here FP32 rows
    small = M.route_logits(logits[:5], bias, k, renorm, 2.5, x[:5])
    assert all(torch.equal(a, b) for a, b in zip(small, M.select(logits[:5], bias, k, renorm, 2.5)))
