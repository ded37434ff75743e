"""kernels/norm_gemm.py (residual add + RMSNorm in the skinny GEMM's prologue) against FP32 math written here
and against the two-kernel chain it would replace, on real and odd shapes, plain and split-K, into poisoned
outputs that are column slices of SENTINEL buffers."""
import pytest
import torch

from peregrine import kernels
from peregrine.kernels.gemm import skinny_gemm
from peregrine.kernels.norm import add_rms_norm
from peregrine.kernels.norm_gemm import norm_gemm, norm_gemm_ref
from peregrine.testing import SENTINEL, assert_close
from tests.conftest import DEVICE, FULL_SHAPES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not kernels.available(DEVICE), reason="triton kernels unavailable")]

EPS = 1e-6
PAD = 3  # SENTINEL columns right of each output
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
PLAIN = {"kernel": "plain", "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}
SPLIT = dict(PLAIN, kernel="splitk", SPLIT_K=3)
SHAPES = [(1, 37, 72), (3, 20, 100), (5, 33, 64), (16, 40, 48)]  # (M, N, K): FMA and dot paths, ragged N and K
if FULL_SHAPES:
    SHAPES += [(1, 12576, 2304), (4, 6720, 2304), (8, 12576, 2304), (2, 2304, 7168)]


def reference(x, nw, w, residual):
    """From the math: v = x + residual (rounded to the residual's dtype), v·rsqrt(mean v² + eps)·nw rounded to
    x's dtype, then an FP64 product with w."""
    v = x.double() if residual is None else (x.double() + residual.double()).to(residual.dtype).double()
    n = (v / torch.sqrt((v * v).mean(-1, keepdim=True) + EPS) * nw.double()).to(x.dtype)
    return n.double() @ w.double().t(), v


def _boxed(rows, cols, dtype):
    buf = torch.full((rows, cols + PAD), SENTINEL, dtype=dtype, device=DEVICE)
    buf[:, :cols] = float("nan")
    return buf, buf[:, :cols]


@pytest.mark.parametrize("cfg", [None, PLAIN, SPLIT], ids=["plan", "plain", "splitk"])
@pytest.mark.parametrize("res", [True, False], ids=["residual", "norm-only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_norm_gemm_equals_the_math(M, N, K, dtype, res, cfg):
    g = torch.Generator().manual_seed(M * 7 + N + K)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    r = torch.randn(M, K, generator=g).to(DEVICE, dtype) if res else None
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEVICE, dtype)
    before = [t.clone() for t in (x, nw, w) + ((r,) if res else ())]
    ybuf, y = _boxed(M, N, dtype)
    rbuf, ro = _boxed(M, K, dtype) if res else (None, None)
    got = norm_gemm(x, nw, w, EPS, residual=r, residual_out=ro, out=y, config=cfg)
    assert got.data_ptr() == y.data_ptr() and not y.isnan().any()
    want, v = reference(x, nw, w, r)
    assert_close(y.double(), want, TOL[dtype])
    assert (ybuf[:, N:] == SENTINEL).all()
    if res:
        assert not ro.isnan().any() and (rbuf[:, K:] == SENTINEL).all()
        assert_close(ro.double(), v, TOL[dtype])
    for b, t in zip(before, (x, nw, w) + ((r,) if res else ())):
        assert torch.equal(b, t), "an input was written"


@pytest.mark.parametrize("M", [1, 4, 8])
def test_norm_gemm_agrees_with_the_two_kernel_chain(M):
    """The chain it replaces (add_rms_norm, then skinny_gemm) on the same inputs: the same residual and,
    within the norm's rounding, the same product."""
    N, K, dtype = 50, 96, torch.bfloat16 if DEVICE == "cuda" else torch.float32
    g = torch.Generator().manual_seed(M)
    x, r = (torch.randn(M, K, generator=g).to(DEVICE, dtype) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEVICE, dtype)
    ro = torch.empty_like(r)
    fused = norm_gemm(x, nw, w, EPS, residual=r, residual_out=ro)
    h, r2 = add_rms_norm(x, r.clone(), nw, EPS)
    chain = skinny_gemm(h, w)
    assert torch.equal(ro, r2)
    assert_close(fused.float(), chain.float(), TOL[dtype])
    ref, _ = norm_gemm_ref(x, nw, w, EPS, residual=r)
    assert_close(fused.float(), ref, TOL[dtype])


def test_norm_gemm_rejects_an_aliased_residual():
    """Other programs still read the residual while one column of programs writes the sum: never in place."""
    x, r = torch.randn(2, 16, device=DEVICE), torch.randn(2, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="alias"):
        norm_gemm(x, torch.ones(16, device=DEVICE), torch.randn(8, 16, device=DEVICE), EPS, residual=r, residual_out=r)


def test_bench_smoke_on_cpu(monkeypatch):
    """The microbenchmark at tiny widths (fake clock): both forms run on the same case, bytes as documented."""
    from peregrine.bench import kernels, kernels_gemm as kg, kernels_norm_gemm as bench
    assert "norm_gemm" in kernels.FAMILIES
    if DEVICE == "cuda":
        pytest.skip("the GPU pass runs the real benchmark")
    monkeypatch.setattr(kg, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "SHAPES", ((24, 32),))
    monkeypatch.setattr(bench, "MS", (1, 3))
    calls = []
    monkeypatch.setattr(kg, "graph_time", lambda fns, iters: (calls.append(len(fns)), [f() for f in fns[:2]], (2.0, [2.0]))[-1])
    rows = bench.run(1000.0)
    assert [r["M"] for r in rows] == [1, 3] and len(calls) == 4
    r = rows[1]
    b = kg.DTYPE.itemsize
    assert r["bytes"] == 24 * 32 * b + (3 * 32 + 3 * 24) * b + (2 * 3 * 32 + 32) * b  # w, x + y, residual r/w + norm w
    assert r["gbps"] == r["bytes"] / 2.0 / 1e6 and r["pct_of_copy"] == r["gbps"] / 1000.0


def test_compiles_for_sm90_without_spills():
    from tests.conftest import run_aot
    rows = run_aot("import json; from peregrine.bench import kernels_norm_gemm as b; print(json.dumps(b.compile_check()))")
    for r in rows:
        assert "error" not in r and r["regs"] > 0 and r["spill"] == 0, r
