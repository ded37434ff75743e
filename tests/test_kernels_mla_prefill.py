"""MLA prefill attention (non-absorbed, causal) vs an independent FP64 reference (docs/correctness.md §1)."""
import pytest
import torch

from peregrine.kernels import available
from peregrine.kernels.mla_prefill import (PrefillConfig, mla_prefill, mla_prefill_reference, mla_prefill_varlen,
                                           mla_prefill_varlen_reference)
from peregrine.testing import SENTINEL, assert_close, poisoned
from tests.conftest import DEVICE, FULL_SHAPES, run_aot

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not available(DEVICE), reason="triton kernels unavailable")]

TINY_A = (4, 64, 32, 64)     # tiny-kimi-linear: H, Dn, Dr, Dv
TINY_B = (2, 32, 16, 32)     # the smaller tiny model
ODD = (3, 24, 8, 40)         # no power-of-2 head dim: every tile padded and masked
REAL = (32, 128, 64, 128)    # Kimi-Linear
K3 = (96, 128, 64, 128)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
LAT_C = 40                   # latent columns before k_rope in the [L, LAT_C + Dr] storage (512 in the model)
PAD_COLS = 5                 # NaN columns after [k_nope | v] in each head's row of the kv storage
SPARE_ROWS = 3               # NaN rows past L in every key storage


def reference(q, k_nope, k_rope, v, start):
    """Written from the math, not from the kernel module: per head, explicit scores over the
    concatenated [nope | rope] key, a boolean causal mask, exp / sum (FP64 on the inputs' device)."""
    q, k_nope, k_rope, v = (x.double() for x in (q, k_nope, k_rope, v))
    T, H, D = q.shape
    L, Dn = k_nope.shape[0], k_nope.shape[2]
    scale = D ** -0.5
    visible = torch.arange(L, device=q.device)[None, :] <= (start + torch.arange(T, device=q.device))[:, None]
    out = torch.empty(T, H, v.shape[2], dtype=torch.float64, device=q.device)
    for h in range(H):
        k = torch.cat([k_nope[:, h], k_rope], dim=1)             # [L, Dn + Dr]
        s = (q[:, h] @ k.T) * scale
        s = torch.where(visible, s, torch.full_like(s, -torch.inf))
        w = torch.exp(s - s.max(dim=1, keepdim=True).values)
        out[:, h] = (w / w.sum(dim=1, keepdim=True)) @ v[:, h]
    return out


def make_case(dims, T, L, dtype=torch.float32, seed=0, strided_q=False):
    """Inputs as the model passes them: k_nope / v views of one [L, H, Dn + Dv] tensor (here with an
    extra NaN head and NaN pad columns), k_rope a view of the [L, C + Dr] latent (NaN in the C
    columns); every storage has NaN rows past L, so a wrong stride or row bound shows."""
    H, Dn, Dr, Dv = dims
    g = torch.Generator().manual_seed(seed)
    kv = torch.full((L + SPARE_ROWS, H + 1, Dn + Dv + PAD_COLS), float("nan"))
    kv[:L, :H, :Dn + Dv] = torch.randn(L, H, Dn + Dv, generator=g)
    lat = torch.full((L + SPARE_ROWS, LAT_C + Dr), float("nan"))
    lat[:L, LAT_C:] = torch.randn(L, Dr, generator=g)
    qs = torch.full((T, H, Dn + Dr + (PAD_COLS if strided_q else 0)), float("nan"))
    qs[..., :Dn + Dr] = torch.randn(T, H, Dn + Dr, generator=g)
    kv, lat, qs = (x.to(dtype).to(DEVICE) for x in (kv, lat, qs))
    return qs[..., :Dn + Dr], kv[:L, :H, :Dn], lat[:L, LAT_C:], kv[:L, :H, Dn:Dn + Dv]


def run_checked(q, k_nope, k_rope, v, start=None, config=None, call=None):
    """Kernel (mla_prefill, or `call(..., out=)`) into a NaN-poisoned slice of a SENTINEL buffer;
    checks the rows around the output and every input are left bit-for-bit alone."""
    T, H, _ = q.shape
    Dv = v.shape[2]
    big = torch.full((T + 2, H, Dv), SENTINEL, dtype=q.dtype, device=q.device)
    out = big[1:T + 1]
    out.copy_(poisoned(out.shape, q.dtype, q.device))
    before = [x.clone() for x in (q, k_nope, k_rope, v)]
    if call is None:
        got = mla_prefill(q, k_nope, k_rope, v, q.shape[2] ** -0.5, start=start, out=out, config=config)
    else:
        got = call(q, k_nope, k_rope, v, out=out)
    assert got.data_ptr() == out.data_ptr()
    for edge in (big[0], big[-1]):
        assert torch.equal(edge, torch.full_like(edge, SENTINEL))
    for x, y in zip(before, (q, k_nope, k_rope, v)):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), "kernel wrote into an input"
    assert not torch.isnan(got).any(), "an output element was left unwritten (or read a NaN)"
    return got


CASES = [  # (dims, T, L, dtype); start = L - T
    (TINY_B, 1, 1, torch.float32),
    (TINY_B, 7, 7, torch.float32),
    (TINY_B, 65, 65, torch.float32),
    (TINY_B, 100, 257, torch.float32),   # later chunk: prefix of 157, a ragged diagonal
    (TINY_A, 1, 257, torch.float32),     # one query over the whole prefix
    (TINY_A, 63, 63, torch.float32),
    (TINY_A, 3, 100, torch.float32),
    (ODD, 33, 70, torch.float32),
    (REAL, 65, 200, torch.float32),      # the real head dims, FP32 (a few seconds in the interpreter)
    (REAL, 1, 300, torch.float32),
]
if FULL_SHAPES:
    CASES += [
        (TINY_A, 257, 257, torch.float32), (TINY_A, 100, 257, torch.bfloat16),
        (REAL, 1, 1, torch.float32), (REAL, 100, 257, torch.float32), (REAL, 257, 257, torch.float32),
        (REAL, 1, 1, torch.bfloat16), (REAL, 3, 100, torch.bfloat16), (REAL, 257, 257, torch.bfloat16),
        (REAL, 65, 4097, torch.bfloat16), (REAL, 1, 8192, torch.bfloat16),
        (REAL, 4096, 8192, torch.bfloat16), (REAL, 4096, 4096, torch.bfloat16), (REAL, 1000, 5000, torch.float32),
        (REAL, 64, 32768, torch.bfloat16),  # turn-2 prefix hit
        (K3, 100, 300, torch.bfloat16), (K3, 1024, 2048, torch.bfloat16),
    ]


@pytest.mark.parametrize("dims,T,L,dtype", CASES)
def test_mla_prefill(dims, T, L, dtype):
    q, kn, kr, v = make_case(dims, T, L, dtype)
    got = run_checked(q, kn, kr, v)
    assert got.dtype == dtype and got.shape == (T, dims[0], dims[3])
    assert_close(got.float(), reference(q, kn, kr, v, L - T), TOL[dtype])


# Tiles smaller and larger than each other and than T: the unmasked / diagonal split at every alignment.
CONFIG_CASES = [PrefillConfig(16, 16, 4, 1), PrefillConfig(16, 64, 4, 2), PrefillConfig(64, 16, 4, 2),
                PrefillConfig(32, 32, 4, 2)]


@pytest.mark.parametrize("cfg", CONFIG_CASES)
@pytest.mark.parametrize("T,L", [(37, 37), (50, 113)])
def test_tile_configs(cfg, T, L):
    q, kn, kr, v = make_case(TINY_B, T, L, seed=1)
    assert_close(run_checked(q, kn, kr, v, config=cfg), reference(q, kn, kr, v, L - T), TOL[torch.float32])


# KV splits (+ combine): splits that are empty for a whole query block, splits past some rows'
# diagonal (a 64-row block over 16-key splits), a ragged last split, prefix and first chunk.
SPLIT_CASES = [(PrefillConfig(16, 16, 4, 1, num_splits=7), 37, 37), (PrefillConfig(64, 16, 4, 2, num_splits=4), 64, 64),
               (PrefillConfig(32, 16, 4, 2, num_splits=3), 20, 150),
               (PrefillConfig(64, 32, 4, 2, num_splits=16), 5, 300)]


@pytest.mark.parametrize("cfg,T,L", SPLIT_CASES)
def test_kv_splits(cfg, T, L):
    q, kn, kr, v = make_case(TINY_B, T, L, seed=5)
    assert_close(run_checked(q, kn, kr, v, config=cfg), reference(q, kn, kr, v, L - T), TOL[torch.float32])


def test_auto_splits_fill_the_sms(monkeypatch):
    """Few queries over a long prefix split the keys by themselves (MIN_SPLIT_KEYS lowered to fit the CPU)."""
    from peregrine.kernels import mla_prefill as mp
    monkeypatch.setattr(mp, "MIN_SPLIT_KEYS", 64)
    cfg = PrefillConfig(32, 32, 4, 2)
    T, L = 3, 400
    S = mp.pick_splits(T, L, TINY_A[0], cfg, DEVICE)
    assert 1 < S <= mp.MAX_SPLITS and S * TINY_A[0] <= mp._num_sms(torch.device(DEVICE))
    assert mp.pick_splits(T, 100, TINY_A[0], cfg, DEVICE) == 1   # too few keys to split
    q, kn, kr, v = make_case(TINY_A, T, L, seed=6)
    assert_close(run_checked(q, kn, kr, v, config=cfg), reference(q, kn, kr, v, L - T), TOL[torch.float32])


def test_explicit_start_and_unseen_keys_never_read():
    """start + T < L: keys past start + T - 1 are visible to no query; NaN there must not leak in
    (nor from a strided q's NaN pad columns)."""
    T, L, start = 40, 120, 30
    q, kn, kr, v = make_case(TINY_A, T, L, seed=2, strided_q=True)
    for x in (kn, kr, v):
        x[start + T:] = float("nan")
    ref = reference(q[:, :, :], kn[:start + T], kr[:start + T], v[:start + T], start)
    assert_close(run_checked(q, kn, kr, v, start=start), ref, TOL[torch.float32])
    first = make_case(TINY_A, T, L, seed=2)[0]
    got = run_checked(first, kn[:T], kr[:T], v[:T], start=0)  # first chunk of a chunked prefill
    assert_close(got, reference(first, kn[:T], kr[:T], v[:T], 0), TOL[torch.float32])


def test_causal_mask_is_exact():
    """Changing the last key (visible only to the last query) leaves every other output bit-for-bit."""
    T, L = 70, 90
    q, kn, kr, v = make_case(TINY_B, T, L, seed=3)
    a = run_checked(q, kn, kr, v)
    kn[-1] += 3.0
    kr[-1] -= 2.0
    v[-1] *= -5.0
    b = run_checked(q, kn, kr, v)
    assert torch.equal(a[:-1], b[:-1])
    assert not torch.equal(a[-1], b[-1])


def test_module_reference_matches():
    """The kernel module's own FP32 twin agrees with the independent one (it is what the bench checks against)."""
    T, L = 45, 80
    q, kn, kr, v = make_case(ODD, T, L, seed=4)
    ref = reference(q, kn, kr, v, L - T)
    assert_close(mla_prefill_reference(q, kn, kr, v, q.shape[2] ** -0.5), ref, 1e-6)
    out = poisoned((T, ODD[0], ODD[3]), q.dtype, q.device)
    assert mla_prefill_reference(q, kn, kr, v, q.shape[2] ** -0.5, out=out) is out
    assert_close(out, ref, 1e-6)


def test_empty_query_and_validation():
    q, kn, kr, v = make_case(TINY_B, 4, 9)
    assert mla_prefill(q[:0], kn, kr, v, 0.1).shape == (0, 2, 32)
    bad = [
        dict(start=6), dict(start=-1),                                   # start + T > L, start < 0
        dict(q=q[..., :-1]),                                             # q dim != Dn + Dr
        dict(k_rope=kr[:-1]), dict(v=v[:, :1]),                          # L / H mismatch
        dict(v=v.to(torch.float16)),                                     # mixed dtypes
        dict(k_nope=kn.transpose(1, 2).contiguous().transpose(1, 2)),    # last dim not contiguous
        dict(sm_scale=0.0), dict(out=torch.empty(4, 2, 31, device=q.device)),
    ]
    for kw in bad:
        args = dict(q=q, k_nope=kn, k_rope=kr, v=v, sm_scale=0.1) | kw
        with pytest.raises(ValueError):
            mla_prefill(**args)


# ---- varlen: several sequences in one launch ----

VARLEN_SEQS = [(5, 5), (1, 40), (33, 100), (0, 7), (17, 17), (64, 64)]  # (T_b, L_b), one with no queries


def varlen_case(dims, seqs, dtype=torch.float32, seed=7):
    """Packed q / keys of the sequences in make_case's layout (NaN storage around), and their prefix sums."""
    q, kn, kr, v = make_case(dims, sum(t for t, _ in seqs), sum(n for _, n in seqs), dtype, seed)
    cu = lambda xs: [sum(xs[:i]) for i in range(len(xs) + 1)]  # noqa: E731
    return q, kn, kr, v, cu([t for t, _ in seqs]), cu([n for _, n in seqs])


def varlen_reference(q, kn, kr, v, cq, ck, starts):
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64, device=q.device)
    for b, st in enumerate(starts):
        a, e, ka = cq[b], cq[b + 1], ck[b]
        ke = ka + st + e - a  # the keys its queries may see (NaN may follow)
        if e > a:
            out[a:e] = reference(q[a:e], kn[ka:ke], kr[ka:ke], v[ka:ke], st)
    return out


@pytest.mark.parametrize("cfg", [None, PrefillConfig(16, 16, 4, 1, num_splits=3), PrefillConfig(32, 64, 4, 2)])
@pytest.mark.parametrize("explicit_starts", [False, True])
def test_varlen(cfg, explicit_starts):
    q, kn, kr, v, cq, ck = varlen_case(TINY_B, VARLEN_SEQS)
    starts = [n - t - (min(3, n - t) if explicit_starts else 0) for t, n in VARLEN_SEQS]
    if explicit_starts:  # keys past start + T of each sequence are seen by none of its queries: NaN them
        for b, (t, n) in enumerate(VARLEN_SEQS):
            for x in (kn, kr, v):
                x[ck[b] + starts[b] + t:ck[b + 1]] = float("nan")
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=DEVICE) for c in (cq, ck))
    st = torch.tensor(starts, dtype=torch.int32, device=DEVICE) if explicit_starts else None
    def call(*a, out):
        return mla_prefill_varlen(*a, cu_q, cu_k, q.shape[2] ** -0.5, starts=st, out=out, config=cfg)
    got = run_checked(q, kn, kr, v, call=call)
    assert_close(got, varlen_reference(q, kn, kr, v, cq, ck, starts), TOL[torch.float32])


def test_varlen_matches_single_sequence_calls_bitwise():
    """A sequence's output does not depend on its batch mates (same tiles, same splits)."""
    cfg = PrefillConfig(16, 32, 4, 2, num_splits=2)
    q, kn, kr, v, cq, ck = varlen_case(TINY_A, VARLEN_SEQS, seed=8)
    got = mla_prefill_varlen(q, kn, kr, v, cq, ck, q.shape[2] ** -0.5, config=cfg)  # host lists work too
    for b in range(len(VARLEN_SEQS)):
        a, e, ka, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
        one = mla_prefill(q[a:e], kn[ka:ke], kr[ka:ke], v[ka:ke], q.shape[2] ** -0.5, config=cfg)
        assert torch.equal(one, got[a:e]), b
    ref = mla_prefill_varlen_reference(q, kn, kr, v, cq, ck, q.shape[2] ** -0.5)
    assert_close(ref, varlen_reference(q, kn, kr, v, cq, ck, [n - t for t, n in VARLEN_SEQS]), 1e-6)


def test_varlen_validation():
    q, kn, kr, v, cq, ck = varlen_case(TINY_B, [(3, 5), (2, 2)])
    for bad in (dict(cu_seqlens_q=[0, 3]), dict(cu_seqlens_k=[0, 2, 7]), dict(cu_seqlens_k=[1, 5, 7]),
                dict(cu_seqlens_q=[0, 3, 2, 5], cu_seqlens_k=[0, 5, 6, 7]), dict(starts=[3, 0]), dict(starts=[0])):
        args = dict(cu_seqlens_q=cq, cu_seqlens_k=ck) | bad
        with pytest.raises(ValueError):
            mla_prefill_varlen(q, kn, kr, v, sm_scale=0.1, **args)


# ---- the GPU microbenchmark's CPU-side helpers, and the compiled code (no GPU needed) ----

def test_bench_counting_and_shapes():
    from peregrine.bench import kernels, kernels_mla_prefill as bench
    assert "mla_prefill" in kernels.FAMILIES
    assert bench.visible_pairs(4, 0) == 10 and bench.visible_pairs(2, 3) == 4 + 5
    H, Dn, Dr, Dv = bench.DIMS
    assert bench.flops(1024, 0) == 2 * H * (Dn + Dr + Dv) * 1024 * 1025 // 2
    assert bench.io_bytes(64, 32704) == 2 * (64 * H * (Dn + Dr) + 32768 * (H * (Dn + Dv) + Dr) + 64 * H * Dv)
    shapes = bench.shapes(full=True)
    assert (32768, 0) in shapes and (64, 32704) in shapes and (2048, 30720) in shapes
    assert set(bench.shapes(full=False)) <= set(shapes)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            bench.run(1000.0)


def test_bench_shape_smoke_on_cpu(monkeypatch):
    """The bench's whole per-shape path (every candidate checked against the reference, splits, the
    SDPA baseline with the lower-right causal mask) at tiny dims in the interpreter, fake clock."""
    from peregrine.bench import kernels_mla_prefill as bench
    from peregrine.kernels import mla_prefill as mp
    if DEVICE != "cpu":
        pytest.skip("the GPU pass runs the real benchmark")
    H, Dn, Dr, Dv = TINY_B
    for name, val in dict(DIMS=TINY_B, LAT=LAT_C + Dr, SM_SCALE=(Dn + Dr) ** -0.5, DTYPE=torch.float32,
                          CHECK_ROWS=16).items():
        monkeypatch.setattr(bench, name, val)
    monkeypatch.setattr(mp, "CONFIG_CANDIDATES", (PrefillConfig(32, 16, 4, 2), PrefillConfig(16, 32, 4, 1)))
    monkeypatch.setattr(mp, "MIN_SPLIT_KEYS", 32)
    clock = iter(range(1, 1000))
    row = bench.bench_shape(5, 120, 1000.0, device="cpu", timer=lambda fn: (fn(), [float(next(clock))])[1])
    assert "error" not in row and [c.get("error") for c in row["configs"]] == [None] * len(row["configs"])
    assert row["time_ms"] == 1.0 and row["config"] == vars(mp.FP32_CONFIG) and row["rel_err"] < 1e-5
    assert {c["splits"] for c in row["configs"]} > {1}  # 5 queries over 125 keys: split candidates tried
    assert row["tflops"] == pytest.approx(bench.flops(5, 120) / 1e9) and row["pct_of_copy"] > 0
    ran = {k: b for k, b in row["torch_all"].items() if "time_ms" in b}
    assert ran and all(b["vs_kernel"] < 1e-5 for b in ran.values()), row["torch_all"]
    assert row["torch_ms"] == min(b["time_ms"] for b in ran.values())
    assert "T" in bench.table([row]) and "FAILED" in bench.table([{"T": 1, "start": 0, "error": "x"}], head=False)


def test_configs_compile_for_sm90_without_spills():
    """Ahead-of-time sm_90a compile of every default and benchmark candidate at the Kimi-Linear dims:
    the defaults must not spill; a spilling candidate must not be a default."""
    from peregrine.kernels import mla_prefill as mp
    rows = run_aot("import json; from peregrine.bench import kernels_mla_prefill as b; "
                   "print(json.dumps(b.compile_check()))")
    defaults = {str(c) for c in (*mp.CONFIGS.values(), mp.SMALL_T_CONFIG)} | {
        f"{mp.SMALL_T_CONFIG} split", f"{mp.PrefillConfig()} varlen", f"{mp.SMALL_T_CONFIG} split varlen",
        f"{mp.FP32_CONFIG} fp32", "combine"}
    assert defaults <= {r["config"] for r in rows}
    for r in rows:
        assert "error" not in r, r
        assert r["config"] in ("combine", f"{mp.FP32_CONFIG} fp32") or r["wgmma"] > 0, f"{r['config']}: no wgmma"
        if r["config"] in defaults:
            assert r["spill"] == 0 and r["regs"] <= 255, r
