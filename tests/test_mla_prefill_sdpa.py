"""The cold-row MLA prefill route through torch SDPA (kernels/mla_prefill_sdpa.py) vs the FP64 reference,
its gate, and the model's fallback to the Triton kernel when the backend refuses."""
import pytest
import torch

from peregrine.kernels import available
from peregrine.kernels import mla_prefill_sdpa as cold
from peregrine.testing import assert_close, rel_rmse
from tests.conftest import DEVICE, FULL_SHAPES
from tests.test_kernels_mla_prefill import ODD, REAL, TINY_A, make_case, reference, run_checked

CPU_CASES = [(TINY_A, 1), (TINY_A, 70), (ODD, 33), (REAL, 65), (TINY_A, 32)]
pytestmark = pytest.mark.gpu  # the GPU pass (pytest -m gpu) runs them on cuDNN; CPU runs the math backend

GPU_CASES = [(REAL, 1024), (REAL, 4097), ((96, 128, 64, 128), 2048)] + ([(REAL, 16384)] if FULL_SHAPES else [])


def _backend():
    """cuDNN on the GPU (the route's own); the math backend on CPU, which checks the layout work around it."""
    from torch.nn.attention import SDPBackend
    return SDPBackend.CUDNN_ATTENTION if DEVICE == "cuda" else SDPBackend.MATH


@pytest.mark.parametrize("dims,T", GPU_CASES if DEVICE == "cuda" else CPU_CASES)
def test_attend_equals_the_reference(dims, T, monkeypatch):
    """Inputs as the model passes them (strided q, k_nope / v views of one kv tensor, k_rope a latent view; NaN
    around each), into a poisoned slice of a sentinel buffer: every output written, nothing else touched.
    Lengths off the bucket grid, so the zero padding past T is in every case (CPU: buckets of 16)."""
    if DEVICE != "cuda":
        monkeypatch.setattr(cold, "BUCKET", 16)
    assert cold.padded(T) > T or T % cold.BUCKET == 0
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    q, kn, kr, v = make_case(dims, T, T, dtype, strided_q=True)
    got = run_checked(q, kn, kr, v, call=lambda *a, out: cold.attend(*a, q.shape[2] ** -0.5, out, _backend()))
    assert_close(got.float(), reference(q, kn, kr, v, 0), 1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_assemble_k_broadcasts_the_shared_rope_key_and_zeroes_the_padding():
    q, kn, kr, v = make_case(ODD, 9, 9)
    k = cold.assemble_k(kn, kr, 12)
    assert k.shape == (12, ODD[0], ODD[1] + ODD[2]) and k.is_contiguous() and torch.equal(k[:9, :, :kn.shape[2]], kn)
    assert torch.equal(k[:9, :, kn.shape[2]:], kr[:, None].expand(-1, kn.shape[1], -1))
    assert not k[9:].any()


def test_warm_builds_one_plan_per_bucket_up_to_the_longest_step(monkeypatch):
    """Every padded length a cold row of MIN_T..max_T tokens can have, once each, with the layer's scale."""
    from torch.nn.attention import SDPBackend
    monkeypatch.setattr(cold, "ENABLED", True)
    monkeypatch.setattr(cold, "MIN_T", 10)
    monkeypatch.setattr(cold, "BUCKET", 8)
    monkeypatch.setattr(cold, "_broken", None)
    seen = []
    real = cold.attend
    monkeypatch.setattr(cold, "attend", lambda q, kn, kr, v, scale, out: seen.append((q.shape[0], scale))
                        or real(q, kn, kr, v, scale, out, backend=SDPBackend.MATH))
    logs = []
    assert cold.warm(2, 8, 4, 8, 0.25, torch.float32, "cpu", 30, logs.append) == 3
    assert seen == [(16, 0.25), (24, 0.25), (32, 0.25)] and "ready" in logs[-1]
    assert cold.warm(2, 8, 4, 8, 0.25, torch.float32, "cpu", 9) == 0, "no row reaches MIN_T"
    monkeypatch.setattr(cold, "ENABLED", False)
    assert cold.warm(2, 8, 4, 8, 0.25, torch.float32, "cpu", 30) == 0 and len(seen) == 3


def test_the_gate_takes_only_long_cold_rows_on_a_gpu(monkeypatch):
    q = torch.zeros(2, 1, 3, dtype=torch.bfloat16)
    n = cold.MIN_T
    monkeypatch.setattr(cold, "ENABLED", True)
    assert cold.usable(q, n, n, 0)
    assert not cold.usable(q, n, n + 5, 5), "a row after a cached prefix needs the lower-right mask"
    assert not cold.usable(q, n - 1, n - 1, 0), "short rows stay on the Triton kernel"
    monkeypatch.setattr(cold, "ENABLED", None)
    assert not cold.usable(q, n, n, 0), "a CPU tensor never takes the cuDNN route"
    monkeypatch.setattr(cold, "ENABLED", False)
    assert not cold.usable(q.to(DEVICE), n, n, 0)
    if DEVICE == "cuda":
        monkeypatch.setattr(cold, "ENABLED", None)
        assert cold.usable(q.cuda(), n, n, 0) == torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.skipif(not available(DEVICE), reason="triton kernels unavailable")
def test_model_routes_cold_rows_and_falls_back_to_the_kernel(monkeypatch, caplog):
    """An MLA layer's prefill_attn sends a cold row (start 0) through the route and a row after a prefix through
    the Triton kernel; both agree with the kernel alone; a backend error turns the route off, with a warning,
    and the kernel serves that row and the ones after."""
    from peregrine.models import mla as M
    from tests.test_prefill import tiny
    dt = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    cfg, _ = tiny()
    torch.manual_seed(0)
    with torch.device(DEVICE):
        layer = M.MLA(cfg, cfg.mla_layers[0], dt)
    for p in layer.parameters():
        p.data = (torch.randn_like(p.float()) * 0.3).to(p.dtype)
    x = torch.randn(24, cfg.hidden_size, device=DEVICE).to(dt)
    with torch.inference_mode():
        q, lat, _ = layer.project(x)
    monkeypatch.setattr(M, "PREFILL_KERNEL", True)
    monkeypatch.setattr(cold, "MIN_T", 4)
    monkeypatch.setattr(cold, "_broken", None)
    calls = []
    real = cold.attend
    monkeypatch.setattr(cold, "attend", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k, backend=_backend()))

    def attn(on, rows, start):
        monkeypatch.setattr(cold, "ENABLED", on)
        with torch.inference_mode():
            return layer.prefill_attn(q[start:rows], lat[:rows].to(dt), start)
    kernel = attn(False, 24, 0)
    assert calls == []
    routed = attn(True, 24, 0)
    assert calls == [24] and rel_rmse(routed, kernel) < (1e-2 if dt == torch.bfloat16 else 1e-5)
    assert torch.equal(attn(True, 24, 10), attn(False, 24, 10)) and calls == [24], "a prefix row took the route"

    def refuse(*a, **k):
        calls.append("refused")
        raise RuntimeError("cuDNN: no engine for this shape")
    monkeypatch.setattr(cold, "attend", refuse)
    with caplog.at_level("WARNING"):
        assert torch.equal(attn(True, 24, 0), kernel)
    assert "refused" in caplog.text and cold._broken is not None
    assert torch.equal(attn(True, 24, 0), kernel) and calls == [24, "refused"], "the route stays off after an error"


def test_engine_warm_up_builds_plans_up_to_the_longest_prefill_step(monkeypatch):
    """build.warm_cold_attention (a server's start-up, bench ttft's) warms every bucket up to the smaller of
    max_model_len and the step budget, with the model's MLA dims and scale."""
    from torch.nn.attention import SDPBackend
    from peregrine.config import EngineConfig
    from peregrine.engine.build import build_engine, warm_cold_attention
    from peregrine.models import mla as M
    e, _ = build_engine("tiny-kimi-linear", EngineConfig(max_model_len=100, max_num_batched_tokens=70),
                        dummy_weights=True, log=lambda m: None)
    layer = next(m for m in e.model.modules() if isinstance(m, M.MLA))
    monkeypatch.setattr(M, "PREFILL_KERNEL", True)
    for k, v in dict(ENABLED=True, MIN_T=20, BUCKET=16, _broken=None).items():
        monkeypatch.setattr(cold, k, v)
    seen = []
    real = cold.attend
    monkeypatch.setattr(cold, "attend", lambda q, kn, kr, v, scale, out: seen.append((tuple(q.shape), tuple(v.shape), scale))
                        or real(q, kn, kr, v, scale, out, backend=SDPBackend.MATH))
    assert warm_cold_attention(e, lambda m: None) == 4  # 32, 48, 64, 80: the padded lengths of rows of 20..70 tokens
    H, d = layer.H, layer.nope + layer.rope
    assert seen == [((T, H, d), (T, H, layer.vd), layer.sm_scale) for T in (32, 48, 64, 80)]


def test_inputs_on_the_grid_go_in_uncopied_and_others_as_padded_copies(monkeypatch):
    monkeypatch.setattr(cold, "BUCKET", 16)
    x = torch.randn(32, 2, 8)
    assert cold._padded_copy(x, 32) is x
    odd = torch.randn(32, 2, 11)[..., :8]  # row strides of 22 / 11 elements: not 16-byte aligned
    y = cold._padded_copy(odd, 32)
    assert y is not odd and y.is_contiguous() and torch.equal(y, odd)
    z = cold._padded_copy(x[:20], 32)
    assert z.shape == (32, 2, 8) and torch.equal(z[:20], x[:20]) and not z[20:].any()


def test_attend_reads_the_models_views_uncopied_on_the_grid(monkeypatch):
    """The model's layout (q [T, H, Dn+Dr] contiguous, k_nope / v halves of one [T, H, Dn+Dv] tensor, k_rope the
    latent's tail) at a length on the bucket grid: q and v go to the backend as they are, and the result holds."""
    H, Dn, Dr, Dv = REAL if DEVICE == "cuda" else TINY_A
    if DEVICE != "cuda":
        monkeypatch.setattr(cold, "BUCKET", 16)
    T = 2 * cold.BUCKET
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    g = torch.Generator().manual_seed(3)
    q = torch.randn(T, H, Dn + Dr, generator=g).to(DEVICE, dtype)
    kv = torch.randn(T, H, Dn + Dv, generator=g).to(DEVICE, dtype)
    lat = torch.randn(T, 512 + Dr, generator=g).to(DEVICE, dtype)
    kn, v, kr = kv[..., :Dn], kv[..., Dn:], lat[:, 512:]
    assert cold._padded_copy(q, T) is q and cold._padded_copy(v, T) is v
    out = torch.full((T, H, Dv), float("nan"), dtype=dtype, device=DEVICE)
    cold.attend(q, kn, kr, v, (Dn + Dr) ** -0.5, out, _backend())
    assert_close(out.float(), reference(q, kn, kr, v, 0), 1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_server_warm_up_on_an_engine_without_a_gpu_route():
    """build.warm_up (the server's start-up) on a CPU engine: no prefill graphs to capture, no cold-row plans
    to build (the gate is shut off the GPU), and nothing raised."""
    from peregrine.config import EngineConfig
    from peregrine.engine.build import build_engine, warm_cold_attention, warm_up
    e, _ = build_engine("tiny-kimi-linear", EngineConfig(max_model_len=256), dummy_weights=True, log=lambda m: None)
    warm_up(e, lambda m: None)
    if DEVICE != "cuda":
        assert warm_cold_attention(e, lambda m: None) == 0
