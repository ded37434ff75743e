"""MLA decode prologue (kv RMSNorm + cache write + W_UK absorption in one launch) vs the FP32 reference."""
from types import SimpleNamespace

import pytest
import torch

from peregrine.cache import ModelCache, quantize_fp8
from peregrine.kernels import available
from peregrine.kernels.mla_prologue import mla_prologue, mla_prologue_ref, pick_block_r
from peregrine.kernels.norm import rms_norm
from peregrine.testing import SENTINEL, assert_close, poisoned
from tests.conftest import DEVICE, FULL_SHAPES
from test_specialized import model_dir  # noqa: F401  (the fixture: test_specialized's model, built once)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not available(DEVICE), reason="triton kernels unavailable")]

BF16, F32, FP8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
EPS = 1e-6
ODD = dict(H=3, nope=24, r=40, rope=8, vd=16)       # nothing a power of 2 but rope
REAL = dict(H=2, nope=128, r=512, rope=64, vd=128)  # Kimi-Linear-48B's head and latent dims, 2 heads
QH_TOL = {F32: 1e-5, BF16: 1e-2}
ENTRY_TOL = {F32: 1e-6, BF16: 1e-2, FP8: 4e-2}      # written entries (dequantised) vs the FP32 entries
# vs write_latent's: the norm's own BF16 rounding at most (an ulp there can move an FP8 row's scale,
# flipping some e4m3 roundings); with FP32 inputs the bytes themselves are checked
WRITE_TOL = {F32: 1e-6, BF16: 6e-3, FP8: 3e-2}
SCALE_ULP = 2.0 ** -23  # one FP32 ulp, relative: the FP8 scales against the chain on CUDA (see the test)
PAGE, BLOCKS = 16, 4                                # a small paged cache: 64 flat slots


def make_case(N, H, nope, r, rope, vd, dtype, cache_dtype, seed=0):
    """Inputs laid out as the runner has them: q and kva column slices of one projection row (row
    stride > width), W_UK a per-head view into kv_b; a cache with every entry a sentinel."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype).to(DEVICE)  # noqa: E731
    qk, L = nope + rope, r + rope
    proj = rnd(N, H * qk + L + 7)
    proj[:, H * qk:] *= 3  # kva off unit scale: the norm must matter
    q, kva = proj[:, : H * qk].view(N, H, qk), proj[:, H * qk: H * qk + L]
    kv_b = rnd(H * (nope + vd), r, scale=nope ** -0.5)
    w_uk = kv_b.view(H, nope + vd, r)[:, :nope]
    kv_norm = (1 + 0.3 * torch.randn(r, generator=g)).to(dtype).to(DEVICE)
    if cache_dtype == FP8:
        latent = torch.randint(0, 0x7E, (BLOCKS, PAGE, L), generator=g, dtype=torch.uint8).view(FP8).to(DEVICE)
        scale = torch.full((BLOCKS, PAGE), SENTINEL, dtype=F32, device=DEVICE)
    else:
        latent, scale = torch.full((BLOCKS, PAGE, L), SENTINEL, dtype=cache_dtype, device=DEVICE), None
    slots = torch.randperm(BLOCKS * PAGE, generator=g)[:N].to(DEVICE)
    return q, kva, w_uk, kv_norm, latent, scale, slots


def write_ref(latent, scale, slots, entries):
    """What ModelCache.write_latent stores for these entries (the real method on a one-layer stand-in)."""
    lat, sc = latent.clone(), None if scale is None else scale.clone()
    stand_in = SimpleNamespace(mla_index={0: 0}, latent=lat[None], scale=None if sc is None else sc[None],
                               fp8=sc is not None, cfg=SimpleNamespace(latent_dim=lat.shape[-1]))
    ModelCache.write_latent(stand_in, 0, slots, entries)
    return lat, sc


def dequant(latent, scale):
    x = latent.float()
    return x if scale is None else x * scale[..., None]


def check(N, dims, dtype, cache_dtype, seed=0):
    q, kva, w_uk, kv_norm, latent, scale, slots = make_case(N, **dims, dtype=dtype, cache_dtype=cache_dtype, seed=seed)
    lat0, sc0 = latent.clone(), None if scale is None else scale.clone()
    out = poisoned((N, dims["H"], dims["r"] + dims["rope"]), dtype, DEVICE)
    got = mla_prologue(q, kva, w_uk, kv_norm, EPS, latent, scale, slots, out=out)
    assert got is out
    qh_ref, ent_ref = mla_prologue_ref(q, kva, w_uk, kv_norm, EPS)
    assert_close(out, qh_ref, QH_TOL[dtype], "qh")
    assert torch.equal(out[..., dims["r"]:], q[..., dims["nope"]:]), "q_rope must pass through bit for bit"
    # untouched slots: bit-identical
    keep = torch.ones(BLOCKS * PAGE, dtype=torch.bool, device=DEVICE)
    keep[slots] = False
    flat, flat0 = latent.view(-1, latent.shape[-1]), lat0.view(-1, latent.shape[-1])
    assert torch.equal(flat[keep].view(torch.uint8), flat0[keep].view(torch.uint8)), "an untouched cache entry changed"
    if scale is not None:
        assert torch.equal(scale.view(-1)[keep], sc0.view(-1)[keep]), "an untouched scale changed"
    # written slots: what write_latent stores for the reference entries (rounded to the model dtype, as the chain's are)
    lat_w, sc_w = write_ref(lat0, sc0, slots, ent_ref.to(dtype))
    want = dequant(lat_w, sc_w).view(-1, latent.shape[-1])[slots]
    have = dequant(latent, scale).view(-1, latent.shape[-1])[slots]
    kind = FP8 if cache_dtype == FP8 else BF16 if BF16 in (dtype, cache_dtype) else F32
    assert_close(have, want, WRITE_TOL[kind], "entries vs write_latent(reference)")
    assert_close(have, ent_ref, ENTRY_TOL[kind], "entries vs the FP32 reference")
    if scale is not None:  # a BF16 norm output moves the row max by up to a BF16 ulp
        rtol = 1e-6 if dtype == F32 else 2 ** -7
        torch.testing.assert_close(scale.view(-1)[slots], sc_w.view(-1)[slots], rtol=rtol, atol=0)
    if dtype == F32 and cache_dtype != F32:  # exact entries: the cast (or quantisation) is write_latent's to the bit
        assert (flat[slots].view(torch.uint8) != lat_w.view(-1, latent.shape[-1])[slots].view(torch.uint8)).sum() <= 2


@pytest.mark.parametrize("N", [1, 3])
@pytest.mark.parametrize("dtype,cache_dtype", [(F32, F32), (F32, BF16), (BF16, BF16), (BF16, FP8), (F32, FP8)])
def test_odd_shapes(N, dtype, cache_dtype):
    check(N, ODD, dtype, cache_dtype, seed=N)


@pytest.mark.parametrize("cache_dtype", [BF16, FP8])
def test_real_dims(cache_dtype):
    check(3, REAL, BF16, cache_dtype, seed=11)


def test_more_rows_than_one_dot():
    """A verify step's B·T rows (> ROWS): the absorb programs loop over row chunks."""
    check(19, ODD, F32, FP8, seed=5)


@pytest.mark.parametrize("cache_dtype", [BF16, FP8])
def test_cache_bits_equal_the_chain(cache_dtype):
    """BF16 model: the entries written are the chain's to the bit (rms_norm's rounding, then the cast or
    quantize_fp8), since the norm is the same expression; the FP8 scales within an ulp."""
    q, kva, w_uk, kv_norm, latent, scale, slots = make_case(3, **REAL, dtype=BF16, cache_dtype=cache_dtype, seed=2)
    lat0, sc0 = latent.clone(), None if scale is None else scale.clone()
    r = REAL["r"]
    entries = torch.cat([rms_norm(kva[:, :r], kv_norm, EPS), kva[:, r:]], -1)
    lat_w, sc_w = write_ref(lat0, sc0, slots, entries)
    mla_prologue(q, kva, w_uk, kv_norm, EPS, latent, scale, slots)
    assert torch.equal(latent.view(torch.uint8), lat_w.view(torch.uint8))
    if scale is not None:  # amax / 448: torch on CUDA divides by a Python scalar as a multiply by its
        # reciprocal (H200 run: some scales 1 ulp off the kernel's IEEE division; the FP8 bytes still equal)
        assert torch.allclose(scale, sc_w, rtol=SCALE_ULP, atol=0)


def test_fp8_all_zero_entry_takes_the_minimum_scale():
    q, kva, w_uk, kv_norm, latent, scale, slots = make_case(1, **ODD, dtype=F32, cache_dtype=FP8, seed=4)
    kva.zero_()
    mla_prologue(q, kva, w_uk, kv_norm, EPS, latent, scale, slots)
    _, want = quantize_fp8(torch.zeros(1, ODD["r"] + ODD["rope"]))
    assert scale.view(-1)[slots].item() == want.item()
    assert (latent.view(-1, latent.shape[-1])[slots].float() == 0).all()


def test_block_r_heuristic():
    assert pick_block_r(512) == 64 and 32 * (512 // pick_block_r(512)) == 256  # 48B at B=1: 256 programs
    assert pick_block_r(40) == 16 and pick_block_r(8) == 16


def test_bench_parses_args_on_cpu():
    from peregrine.bench import kernels_mla_prologue as b
    a = b.parse_args(["--quick", "--batches", "1,3", "--results-dir", "x"])
    assert a.quick and a.batches == [1, 3] and a.results_dir == "x"
    assert b.case_bytes(1, "bf16") > 4 * 2 ** 20  # W_UK alone is 4 MB in BF16


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_specialized_fused_glue_equals_the_chain(model_dir, monkeypatch, kv):
    """latency_specialized with the fused prologue (the default) against the five-op chain (the form of shapes
    the prologue does not take), with the model-dtype cache and an FP8 one: the prologue is what runs; in FP32 the same
    greedy tokens and routed experts; every decode step's logits within tolerance up to the first differing
    token or routed-expert set (in BF16 the absorbed q̂ is summed in another order, so a near-tie may flip,
    as in test_specialized's shared-slot test)."""
    from test_specialized import STEPS, TOL, engine, first_divergence, greedy, prompts
    from peregrine.decode import specialized
    d = model_dir
    calls = []
    real = specialized.mla_prologue
    monkeypatch.setattr(specialized, "mla_prologue", lambda *a, **k: calls.append(1) or real(*a, **k))
    eager = dict(cuda_graphs=False) if DEVICE == "cuda" else {}
    ps = prompts(2, 13)
    rf, rc = [], []
    fused, lf = engine(d, "latency_specialized", routing=rf, kv_cache_dtype=kv, **eager)
    chain, lc = engine(d, "latency_specialized", routing=rc, kv_cache_dtype=kv, **eager)
    n = STEPS if FULL_SHAPES else 8
    a = fused.generate(ps, greedy(n))
    assert calls, "the fused prologue never ran"
    calls.clear()
    monkeypatch.setattr(specialized, "prologue_why_not", lambda *a: "the chain, for this test")  # eager: read each step
    b = chain.generate(ps, greedy(n))
    assert not calls, "the chain still ran the prologue"
    assert [p for p, _ in lf][1:] == ["latency_specialized"] * (len(lf) - 1)
    div = [first_divergence(x, y) for x, y in zip(a, b)]
    flips = [None] * len(ps)  # first decode step whose routed experts differ, per request
    for i, (x, y) in enumerate(zip(rf, rc)):
        for r in range(len(ps)):
            if x is not None and flips[r] is None and not torch.equal(x[:, r], y[:, r]):
                flips[r] = i
    if DEVICE == "cpu":
        assert div == [None, None] and flips == [None, None], f"FP32: tokens differ at {div}, routing at {flips}"
    for i, ((_, x), (_, y)) in enumerate(zip(lf, lc)):
        for r in range(len(ps)):
            if div[r] is not None and i > div[r] or flips[r] is not None and i >= flips[r]:
                continue  # histories (or this step's experts) differ: nothing left to compare
            assert (x[r] - y[r]).norm() / x[r].norm() < TOL, f"request {r} step {i} (routing flips {flips})"
