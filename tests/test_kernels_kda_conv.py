"""KDA prefill's fused short conv (peregrine/kernels/kda_conv.py) against its FP32 reference and the model's
torch forms (models/kda.py causal_conv + l2norm), on real and odd widths, with poisoned outputs and rows
of a larger buffer it must not touch."""
import pytest
import torch

from conftest import FULL_SHAPES
from peregrine.kernels.kda_conv import kda_conv, kda_conv_ref
from peregrine.testing import SENTINEL, assert_close, poisoned

pytestmark = pytest.mark.gpu

EPS = 1e-6  # QK_NORM_EPS
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# (T, H, d): 48B's heads (32 x 128), K3's 96 heads, a head width that is no power of two, rows shorter than the
# window, and token counts off the 32-token block
SHAPES = [(40, 32, 128), (3, 2, 24), (1, 4, 16), (70, 3, 72)] + ([(4099, 96, 128), (8192, 32, 128)] if FULL_SHAPES else [])
W = 4  # the presets' short_conv_kernel_size


def _case(T, H, d, dtype, device, seed, pad=5):
    g = torch.Generator(device=device).manual_seed(seed)
    C = 3 * H * d
    wide = torch.randn(T, C + pad, generator=g, device=device).to(dtype)  # x is a column slice: row stride C + pad
    win = torch.randn(W - 1, C, generator=g, device=device).to(dtype)
    w = (torch.randn(C, W, generator=g, device=device) * 0.5).to(dtype)
    return wide[:, :C], win, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,d", SHAPES)
def test_kda_conv_equals_its_reference(T, H, d, dtype, device):
    x, win, w = _case(T, H, d, dtype, device, T + H)
    out = poisoned((3, T, H, d), dtype, device)
    assert kda_conv(x, win, w, H, EPS, out=out) is out
    ref = kda_conv_ref(x, win, w, H, EPS)
    for p, name in enumerate("qkv"):
        assert_close(out[p], ref[p], TOL[dtype], name)
    assert torch.equal(kda_conv(x, win, w, H, EPS), out)  # its own buffer: the same bits


def test_kda_conv_equals_the_models_torch_forms(device):
    """The model's causal_conv (state then inputs) and l2norm: what the fla path feeds chunk_kda."""
    from peregrine.models import kda as K
    T, H, d = 37, 2, 24
    x, win, w = _case(T, H, d, torch.float32, device, 3)
    y = K.causal_conv(torch.cat([win, x])[None], w)[0].view(T, 3, H, d)
    out = kda_conv(x, win, w, H, K.QK_NORM_EPS)
    assert_close(out[0], K.l2norm(y[:, 0]), 1e-5, "q")
    assert_close(out[1], K.l2norm(y[:, 1]), 1e-5, "k")
    assert_close(out[2], y[:, 2], 1e-5, "v")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_conv_writes_only_its_rows_of_a_larger_buffer(dtype, device):
    """Rows [a, a + T) of planes of a [3, N, H, d] buffer (the varlen call's layout): the rest stays bit-exact."""
    T, H, d, a, N = 45, 2, 24, 7, 60
    x, win, w = _case(T, H, d, dtype, device, 11)
    buf = torch.full((3, N, H, d), SENTINEL, dtype=dtype, device=device)
    buf[:, a:a + T] = float("nan")
    kda_conv(x, win, w, H, EPS, out=buf[:, a:a + T])
    ref = kda_conv_ref(x, win, w, H, EPS)
    assert_close(buf[:, a:a + T], ref, TOL[dtype])
    assert (buf[:, :a] == SENTINEL).all() and (buf[:, a + T:] == SENTINEL).all()


def test_kda_conv_rejects_bad_shapes(device):
    x, win, w = _case(8, 2, 16, torch.float32, device, 0)
    with pytest.raises(AssertionError):
        kda_conv(x, win[:2], w, 2, EPS)  # a window of W - 2 rows
    with pytest.raises(AssertionError):
        kda_conv(x.t().contiguous().t(), win, w, 2, EPS)  # no unit inner stride


def test_bench_smoke_on_cpu(monkeypatch):
    """The microbenchmark at tiny widths (fake clock) against the torch form: bytes count what it moves."""
    from peregrine import kernels
    from peregrine.bench import kernels as fams, kernels_kda_conv as bench
    assert "kda_conv" in fams.FAMILIES
    if torch.cuda.is_available() or not kernels.available("cpu"):
        pytest.skip("the GPU pass runs the real benchmark")
    for name, val in dict(DEVICE="cpu", TOKENS=(5, 9), H=2, D=16, PAD=3, DTYPE=torch.float32).items():
        monkeypatch.setattr(bench, name, val)
    monkeypatch.setattr(bench, "graph_time", lambda calls, iters: ([c() for c in calls], (2.0, [2.0]))[-1])
    rows = bench.run(1000.0)
    assert [r["shape"] for r in rows] == ["5 tokens x 2 heads x 16", "9 tokens x 2 heads x 16"]
    assert rows[1]["bytes"] == 2 * 9 * 96 * 4 and rows[1]["torch_ms"] == 2.0
    assert rows[1]["pct_of_copy"] == rows[1]["bytes"] / 2.0 / 1e6 / 1000.0


def test_compiles_for_sm90():
    """Ahead of time for sm_90a in BF16 at 48B widths (no GPU needed): it compiles and spills nothing."""
    from conftest import run_aot
    rows = run_aot("import json; from peregrine.bench import kernels_kda_conv as b; print(json.dumps(b.compile_check()))")
    for r in rows:
        assert "error" not in r and r["regs"] > 0 and r["spill"] == 0, r


@pytest.mark.parametrize("ch_major", [True, False])
def test_kda_conv_grid_orders_give_the_same_bits(ch_major, device):
    T, H, d = 70, 3, 24
    x, win, w = _case(T, H, d, torch.bfloat16, device, 21)
    out = poisoned((3, T, H, d), torch.bfloat16, device)
    kda_conv(x, win, w, H, EPS, out=out, ch_major=ch_major, block_t=16, num_warps=2)
    assert torch.equal(out, kda_conv(x, win, w, H, EPS))
