"""The MoE prefill's grouped GEMM over MXFP4 experts (peregrine/kernels/moe_mxfp4_prefill.py) against FP64 math
written here (each expert's weights dequantized by the format's own helpers, its run's rows times them), in both
weight layouts (the checkpoint's and v4's), with and without a row gather, on odd shapes (empty runs, runs shorter
and longer than a block, K not a whole number of steps, R not of column tiles) and real ones, into poisoned outputs
inside wider SENTINEL buffers (columns past the output untouched)."""
import pytest
import torch

from conftest import FULL_SHAPES
from peregrine.kernels import mxfp4_format, mxfp4_repack
from peregrine.kernels.moe_mxfp4_prefill import grouped_mm, grouped_mm_ref
from peregrine.testing import SENTINEL, assert_close

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative RMSE: FP32 sums in another order; BF16 A rows
PAD = 3  # SENTINEL columns right of each output
# (counts per expert, R output rows, K reduction), tiles small enough for the interpreter to cross their edges
SHAPES = [([3, 0, 70, 1, 9], 40, 96), ([0, 0, 5], 16, 32), ([1], 130, 64)]
if FULL_SHAPES:  # the 48B's up (2I x hidden) and down (hidden x I), K3's up, ~8 rows an expert as a 1K chunk gives
    SHAPES += [([8] * 256, 2048, 2304), ([8] * 256, 2304, 1024), ([9] * 64, 6144, 3584)]


def _experts(E, R, K, seed, v4):
    g = torch.Generator().manual_seed(seed)
    codes, scales = mxfp4_format.quantize(torch.randn(E, R, K, generator=g))
    return mxfp4_repack.repack(codes, scales) if v4 else (codes, scales)


def ref(a, codes, scales, counts, v4, rows):
    x = (a if rows is None else a[rows]).double().cpu()
    out, at = [], 0
    for e, n in enumerate(counts):
        c, s = codes[e].cpu(), scales[e].cpu()
        if v4:  # back to the checkpoint layout first
            c, s = mxfp4_repack.unpack(c, s)
        out.append(x[at:at + n] @ mxfp4_format.dequantize(c, s).double().T)
        at += n
    return torch.cat(out)


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("v4", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts,R,K", SHAPES)
def test_grouped_mm_against_fp64(counts, R, K, dtype, v4, gather, device):
    E, P = len(counts), sum(counts)
    codes, scales = (t.to(device) for t in _experts(E, R, K, 0, v4))
    g = torch.Generator().manual_seed(1)
    N = P + 7 if gather else P
    a = torch.randn(N, K, generator=g).to(device=device, dtype=dtype)
    rows = torch.randint(0, N, (P,), generator=g).to(device) if gather else None
    buf = torch.full((P, R + PAD), SENTINEL, dtype=dtype, device=device)
    buf[:, :R] = float("nan")
    small = (16, 32, 64) if not FULL_SHAPES else (64, 128, 64)  # CPU: several blocks and column tiles a run
    out = grouped_mm(a, codes, scales, torch.tensor(counts, device=device), v4, rows, out=buf[:, :R], tile=small)
    assert not out.isnan().any(), "rows or columns left unwritten"
    assert_close(out.double().cpu(), ref(a, codes, scales, counts, v4, rows), TOL[dtype])
    assert (buf[:, R:] == SENTINEL).all()


def test_the_module_reference_and_empty_inputs(device):
    codes, scales = (t.to(device) for t in _experts(3, 24, 64, 2, True))
    counts = torch.tensor([2, 0, 5], device=device)
    a = torch.randn(7, 64, device=device)
    assert_close(grouped_mm_ref(a, codes, scales, counts, True).double().cpu(), ref(a, codes, scales, [2, 0, 5], True, None),
                 1e-6)
    empty = grouped_mm(a[:0], codes, scales, torch.zeros(3, dtype=torch.long, device=device), True)
    assert empty.shape == (0, 24)


@pytest.mark.parametrize("act", ["swiglu", "situ"])
@pytest.mark.parametrize("v4", [False, True])
def test_grouped_experts_over_mxfp4_equal_the_dequantize_loop(act, v4, device):
    """models/moe.py: the MoE's experts through the grouped kernel (the prefill's and graph-captured steps' path)
    against its dequantize-then-GEMM loop over the used experts (the path it replaces), the shared expert's and
    residual's adds included."""
    from peregrine.models import moe
    from peregrine.kernels.mxfp4_repack import dequantize as dq_v4
    E, I, Dz, N, k = 6, 64, 96, 29, 3
    q13, s13 = _experts(E, 2 * I, Dz, 3, v4)
    q2, s2 = _experts(E, Dz, I, 4, v4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, Dz, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    w = torch.rand(N, k, generator=g)
    add = (torch.randn(N, Dz, generator=g),)
    f = (lambda gu: moe.situ(gu, 1.0, 1.0)) if act == "situ" else moe.swiglu
    dev = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    x, ids, w, q13, s13, q2, s2 = dev(x, ids, w, q13, s13, q2, s2)
    add = tuple(dev(*add))
    want = moe.mxfp4_experts(x, q13, s13, q2, s2, ids, w, f, dequantize=dq_v4 if v4 else moe.mxfp4.dequantize) + add[0]
    got = moe.grouped_experts(x, None, None, ids, w, f, add=add, mx=(q13, s13, q2, s2, v4))
    assert_close(got.double().cpu(), want.double().cpu(), 1e-5)


def test_compiles_for_sm90():
    """Ahead of time for sm_90a in BF16 at the default tile (no GPU needed): it compiles and spills nothing."""
    from conftest import run_aot
    rows = run_aot("import json; from peregrine.bench import kernels_moe_mxfp4_prefill as b; print(json.dumps(b.compile_check()))")
    for r in rows:
        assert "error" not in r and r["regs"] > 0 and r["spill"] == 0, r
