"""RMSNorm / fused add + RMSNorm (peregrine/kernels/norm.py) against FP32 math written here."""
import pytest
import torch

from conftest import FULL_SHAPES
from peregrine.kernels import norm
from peregrine.kernels.norm import add_rms_norm, rms_norm
from peregrine.testing import SENTINEL, assert_close, poisoned

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
EPS = 1e-5  # the presets' rms_norm_eps
DS = [256, 100, 4097, 2304] + ([7168, 512, 9000] if FULL_SHAPES else [])
MS = [1, 3, 7, 16]


def ref_norm(v, w, eps=EPS):
    v = v.double()
    return (v / torch.sqrt((v * v).sum(-1, keepdim=True) / v.shape[-1] + eps) * w.double()).float()


def _rand(shape, dtype, device, seed, scale=1.0):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("d", DS)
def test_rms_norm(d, m, dtype, device):
    x, w = _rand((m, d), dtype, device, 0, 3.0), _rand((d,), dtype, device, 1)
    out = poisoned((m, d), dtype, device)
    rms_norm(x, w, EPS, out=out)
    assert_close(out, ref_norm(x, w), TOL[dtype])
    assert torch.equal(rms_norm(x, w, EPS), out)


@pytest.mark.parametrize("res_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,d", [(1, 256), (7, 100), (3, 4097), (16, 2304)])
def test_add_rms_norm(m, d, dtype, res_dtype, device):
    x, w = _rand((m, d), dtype, device, 2), _rand((d,), dtype, device, 3)
    res = _rand((m, d), res_dtype, device, 4, 2.0)
    want_res = (res.double() + x.double()).to(res_dtype)  # one rounding of the exact sum
    out = poisoned((m, d), dtype, device)
    y, r = add_rms_norm(x, res, w, EPS, out=out)
    assert r is res and y is out
    if res_dtype == dtype == torch.bfloat16 and device == "cuda":  # exact FP32 sum, one RTNE rounding
        assert torch.equal(res, want_res)
    if res_dtype == torch.bfloat16:  # the interpreter rounds FP32 -> BF16 toward zero: one ulp
        assert ((res.double() - want_res.double()).abs() <= want_res.double().abs() * 2 ** -7).all()
    else:
        assert_close(res, want_res, 1e-7, "residual")
    assert_close(out, ref_norm(res, w), TOL[dtype])


@pytest.mark.parametrize("fused", [False, True])
def test_two_pass_path(fused, device, monkeypatch):
    monkeypatch.setattr(norm, "MAX_BLOCK", 1024)  # 4097 -> five chunks, two passes
    m, d = 3, 4097
    x, w = _rand((m, d), torch.float32, device, 5), _rand((d,), torch.float32, device, 6)
    out = poisoned((m, d), torch.float32, device)
    if fused:
        res = _rand((m, d), torch.float32, device, 7)
        want = ref_norm(res + x, w)
        add_rms_norm(x, res, w, EPS, out=out)
    else:
        want = ref_norm(x, w)
        rms_norm(x, w, EPS, out=out)
    assert_close(out, want, TOL[torch.float32])


@pytest.mark.parametrize("fused", [False, True])
def test_strided_rows_leave_neighbours(fused, device):
    m, d = 5, 100
    xb = _rand((m, d + 9), torch.bfloat16, device, 8)
    x, w = xb[:, 4:4 + d], _rand((d,), torch.bfloat16, device, 9)
    buf = torch.full((m + 2, d + 16), SENTINEL, dtype=torch.bfloat16, device=device)
    before = buf.clone()
    out = buf[1:m + 1, 8:8 + d]
    if fused:
        rb = torch.full((m, d + 6), SENTINEL, dtype=torch.float32, device=device)
        rb[:, 3:3 + d] = _rand((m, d), torch.float32, device, 10)
        rb_before = rb.clone()
        add_rms_norm(x, rb[:, 3:3 + d], w, EPS, out=out)
        want = ref_norm(rb[:, 3:3 + d], w)
        assert torch.equal(rb[:, :3], rb_before[:, :3]) and torch.equal(rb[:, 3 + d:], rb_before[:, 3 + d:])
    else:
        rms_norm(x, w, EPS, out=out)
        want = ref_norm(x, w)
    assert_close(out, want, TOL[torch.bfloat16])
    keep = torch.ones_like(buf, dtype=torch.bool)
    keep[1:m + 1, 8:8 + d] = False
    assert torch.equal(buf[keep], before[keep])


def test_references_agree(device):
    x, w = _rand((3, 100), torch.float32, device, 11), _rand((100,), torch.float32, device, 12)
    res = _rand((3, 100), torch.bfloat16, device, 13)
    assert_close(norm.rms_norm_ref(x, w, EPS), ref_norm(x, w), 1e-6)
    y, r = norm.add_rms_norm_ref(x, res, w, EPS)
    assert r.dtype == torch.bfloat16 and torch.equal(r, (res.float() + x).to(torch.bfloat16))


def ref_gated(o, r, w, eps=EPS):
    """FP64: per head RMSNorm(o)·w ⊙ σ(r), flattened over heads."""
    T, H, d = o.shape
    return (ref_norm(o.reshape(T * H, d), w, eps).double().view(T, H, d)
            * torch.sigmoid(r.double()).view(T, H, d)).flatten(1).float()


GATED = [(1, 4, 64), (37, 3, 100), (70, 32, 128)] + ([(4097, 32, 128), (33, 64, 128)] if FULL_SHAPES else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,d", GATED)
def test_gated_rms_norm_reads_strided_rows_and_writes_only_its_slice(T, H, d, dtype, device):
    """KDA's output norm (fla rows' W_o input): o rows of a larger buffer, r a column slice of a projection,
    out a block of a sentinel-filled buffer (its neighbours untouched); odd T, H and d (masked tails)."""
    ob = _rand((T, H + 1, d), dtype, device, 20, 2.0)
    o = ob[:, 1:]  # each row's heads contiguous, row stride (H + 1)·d
    rb = _rand((T, H * d + 24), dtype, device, 21, 3.0)
    r = rb[:, 16:16 + H * d]
    w = _rand((d,), dtype, device, 22)
    buf = torch.full((T + 2, H * d + 8), SENTINEL, dtype=dtype, device=device)
    before = buf.clone()
    out = buf[1:T + 1, 8:]
    got = norm.gated_rms_norm(o, r, w, EPS, out=out)
    assert got is out
    assert_close(out, ref_gated(o, r, w), TOL[dtype])
    keep = torch.ones_like(buf, dtype=torch.bool)
    keep[1:T + 1, 8:] = False
    assert torch.equal(buf[keep], before[keep])
    assert_close(norm.gated_rms_norm_ref(o, r, w, EPS), ref_gated(o, r, w), 1e-6, "reference")
    fresh = norm.gated_rms_norm(o, r, w, EPS)
    assert fresh.dtype == dtype and torch.equal(fresh, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_models_norm_and_shared_swiglu_take_the_kernels_for_prefill_sized_steps(dtype, device, monkeypatch):
    """models/layers.py: rms_norm (2-D rows, a strided column slice as MLA's latent norm reads, 3-D) and the
    dense / shared-expert MLP through the kernels (layers.FUSED on) against their torch forms (off), and
    the switch itself: on by default only for a prefill-sized step on the GPU outside FP32."""
    from peregrine import kernels
    from peregrine.models import layers as L
    if not kernels.available(device):
        pytest.skip("triton kernels unavailable")
    wide = _rand((70, 300), dtype, device, 5, 3.0)
    w = _rand((200,), dtype, device, 6)
    mlp = L.DenseMLP(200, 48, dtype).to(device)
    with torch.no_grad():
        mlp.gate_up.copy_(_rand((96, 200), dtype, device, 7) / 200 ** 0.5)
        mlp.down.copy_(_rand((200, 48), dtype, device, 8) / 48 ** 0.5)
    cases = {"rows": lambda: L.rms_norm(wide[:, :200].contiguous(), w, EPS),
             "strided": lambda: L.rms_norm(wide[:, 50:250], w, EPS),
             "3-D": lambda: L.rms_norm(wide[:, :200].contiguous().view(7, 10, 200), w, EPS),
             "mlp": lambda: mlp(wide[:, :200])}
    from peregrine.kernels import moe_prefill
    calls = []
    for mod, name in ((norm, "rms_norm"), (moe_prefill, "swiglu_weighted")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=real, _n=name, **k: calls.append(_n) or _f(*a, **k))
    out = {}
    for on in (True, False):
        monkeypatch.setattr(L, "FUSED", on)
        out[on] = {k: f() for k, f in cases.items()}
    assert calls == ["rms_norm"] * 3 + ["swiglu_weighted"]  # the kernels ran when on, and only then
    for k in cases:
        assert out[True][k].dtype == dtype and not out[True][k].isnan().any(), k
        assert_close(out[True][k], out[False][k], TOL[dtype]), k
    monkeypatch.setattr(L, "FUSED", None)
    assert not L.fused(wide.cpu())  # the CPU (or the interpreter): the torch forms
    if torch.cuda.is_available():
        g = wide.cuda()
        assert L.fused(g) == (dtype != torch.float32) and not L.fused(g[:L.FUSED_MIN_ROWS - 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer_i", [0, 1])  # a dense layer, a MoE layer
def test_a_layers_residual_adds_in_its_norm_and_combine_give_the_separate_adds_bits(layer_i, dtype, device, monkeypatch):
    """DecoderLayer.finish on one rank: h = x + W_o(o) inside the post-attention norm's pass, and (MoE layers)
    the shared expert's output and h inside the experts' combine. Bitwise the output of the separate adds
    (h = x + W_o(o); routed + shared; h + that) over the same kernels; x is never written."""
    import test_model
    from peregrine.kernels import moe_prefill
    from peregrine.models import layers as L, moe as M
    if not kernels_available(device):
        pytest.skip("triton kernels unavailable")
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter's FP32 -> BF16 cast truncates (the norm kernel's stored sum): the GPU pass runs it")
    monkeypatch.setattr(L, "FUSED", True)
    cfg, m = test_model.tiny()
    layer = m.layers[layer_i].to(device=device, dtype=dtype)
    assert layer.is_moe == (layer_i == 1) and layer.is_kda
    D = cfg.hidden_size
    x = _rand((70, D), dtype, device, 21)
    o = _rand((70, layer.attn.o_proj.shape[1]), dtype, device, 22)
    x0 = x.clone()
    calls = []
    for mod, name in ((norm, "add_rms_norm"), (moe_prefill, "combine")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=real, _n=name, **k: calls.append((_n, len(k.get("add", ())))) or _f(*a, **k))
    with torch.inference_mode():
        got = layer.finish(x, o, None)
        h = x + layer.attn.post(o, None)
        n = layer.post_attention_layernorm(h)
        if layer.is_moe:
            p = layer.mlp
            ids, w = M.route_logits(p.router_logits(n), p.bias, cfg.num_experts_per_token, cfg.moe_renormalize,
                                    cfg.routed_scaling_factor, n)
            want = h + (M.grouped_experts(n, p.w13, p.w2, ids, w, p.act) + p.shared(n))
        else:
            want = h + layer.mlp(n)
    assert torch.equal(x, x0)
    assert not got.isnan().any() and torch.equal(got, want)
    assert calls[0] == ("add_rms_norm", 0)
    assert (("combine", 2) in calls) == layer.is_moe  # the shared expert's output and the residual


def kernels_available(device) -> bool:
    from peregrine import kernels
    return kernels.available(device)


def test_gated_norm_bench_smoke_on_cpu(monkeypatch):
    """The norm microbenchmark's gated rows at tiny widths (fake clock): the row is there, its bytes count
    o and r read and out written, and its % of copy follows from them."""
    from peregrine import kernels
    from peregrine.bench import kernels_norm as bench
    if torch.cuda.is_available() or not kernels.available("cpu"):
        pytest.skip("the GPU pass runs the real benchmark")
    for name, val in dict(DEVICE="cpu", GATED_T=(70,), GATED_H=3, GATED_D=16, TAIL=5,
                          DTYPE=torch.float32, DS=(100,), MS=(1, 16), MAX_COPIES=1).items():
        monkeypatch.setattr(bench, name, val)
    (name, calls, nbytes), *_ = bench._gated_cases(70)
    assert name == "gated_rms_norm" and nbytes == 3 * 70 * 48 * 2
    monkeypatch.setattr(bench, "graph_time", lambda calls, iters: ([c() for c in calls], (2.0, [2.0]))[-1])
    rows = bench.run(1000.0)
    gated = [r for r in rows if r["kernel"] == "gated_rms_norm"]
    assert len(gated) == 1 and gated[0]["shape"] == "70 tokens x 3 heads x 16"
    assert gated[0]["pct_of_copy"] == nbytes / 2.0 / 1e6 / 1000.0 and "fla_ms" in gated[0]
