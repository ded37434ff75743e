"""MLA split combine with the W_UV projection fused in (kernels/mla.py combine_uv) vs the FP32 reference
and vs the chain it replaces (combine, then torch.bmm with W_UV, then the reshape copy)."""
import pytest
import torch

from peregrine.kernels import available, gemm, mla
from peregrine.kernels.mla import UvTiling, combine_uv, mla_decode, mla_decode_uv_ref, mla_partials, uv_why_not
from peregrine.testing import SENTINEL, assert_close, poisoned
from tests.conftest import DEVICE, FULL_SHAPES
from test_kernels_mla import SM_SCALE, SPLIT_TILING, make_case
from test_specialized import model_dir  # noqa: F401  (the fixture: test_specialized's model, built once)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not available(DEVICE), reason="triton kernels unavailable")]

BF16, F32 = torch.bfloat16, torch.float32
ODD = (3, 40, 8, 24)            # H, kv_lora C, rope R, v: nothing a power of 2 but R
REAL = (32, 512, 64, 128)       # Kimi-Linear-48B
TOL = {F32: 1e-5, BF16: 1e-2}
CHAIN_TOL = {F32: 1e-5, BF16: 8e-3}  # vs the chain: the output rounding (truncation under the interpreter) and FP32 order
RAGGED = [50, 0, 7, 130, 1]     # a length-0 row, and rows that leave most splits inactive
# (block_v, block_c, block_b): the default; v and channels in several slices with partial row groups;
# one channel slice (no workspace, no counters); one row per program
TILINGS = {"default": UvTiling(), "sliced": UvTiling(block_v=16, block_c=16, block_b=2),
           "one_slice": UvTiling(block_c=64, num_warps=8), "rows1": UvTiling(block_b=1)}


def make_w_uv(H, V, C, dtype, seed=0):
    """W_UV as the runner has it: a per-head view into kv_b (rows nope.. of each head's nope + v)."""
    g = torch.Generator().manual_seed(seed)
    nope = 5
    kv_b = (torch.randn(H * (nope + V), C, generator=g) * C ** -0.5).to(dtype).to(DEVICE)
    return kv_b.view(H, nope + V, C)[:, nope:]


def chain(q, lat, scale, bt, lens, w, C, **kw):
    """SpecializedRunner._mla_attend's former tail: o in the model dtype, then the bmm and the reshape."""
    o = mla_decode(q, lat, scale, bt, lens, SM_SCALE, kv_lora_rank=C, **kw)
    return torch.bmm(o.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1).reshape(q.shape[0], -1)


def run_fused(q, lat, scale, bt, lens, w, C, **kw):
    """Fused call into a NaN-poisoned, row-strided slice of a SENTINEL buffer: every output element is
    written, nothing around it is, and no input changes."""
    B, HV = q.shape[0], w.shape[0] * w.shape[1]
    big = torch.full((B + 2, HV + 3), SENTINEL, dtype=q.dtype, device=q.device)
    out = big[1:B + 1, 1:HV + 1]
    out.copy_(poisoned(out.shape, q.dtype, q.device))
    before = [x.clone() for x in (q, lat, bt, lens, w)]
    got = mla_decode(q, lat, scale, bt, lens, SM_SCALE, kv_lora_rank=C, w_uv=w, out=out, **kw)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
    edge = torch.ones_like(big, dtype=torch.bool)
    edge[1:B + 1, 1:HV + 1] = False
    assert (big[edge] == SENTINEL).all(), "wrote outside its output"
    for x, y in zip(before, (q, lat, bt, lens, w)):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), "kernel wrote into an input"
    return got


def check(dims, lens, dtype, num_splits, uv, page=16, seed=0):
    H, C, R, V = dims
    q, lat, scale, bt, lens_t = make_case(lens, H, C, R, page, dtype, seed=seed)
    w = make_w_uv(H, V, C, dtype, seed)
    kw = dict(num_splits=num_splits, tiling=SPLIT_TILING if num_splits else None)
    got = run_fused(q, lat, scale, bt, lens_t, w, C, uv_tiling=uv, **kw)
    assert_close(got, mla_decode_uv_ref(q, lat, scale, bt, lens_t, SM_SCALE, w, kv_lora_rank=C), TOL[dtype])
    assert_close(got, chain(q, lat, scale, bt, lens_t, w, C, **kw).float(), CHAIN_TOL[dtype], "vs the chain")
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.equal(got[b], torch.zeros_like(got[b])), "a length-0 row must give zeros"
    return got


@pytest.mark.parametrize("tiling", list(TILINGS))
@pytest.mark.parametrize("num_splits", [None, 1, 3, 7])
def test_odd_shapes(tiling, num_splits):
    check(ODD, RAGGED, F32, num_splits, TILINGS[tiling], seed=num_splits or 0)


@pytest.mark.parametrize("num_splits", [1, 5])
def test_bf16(num_splits):
    check(ODD, RAGGED, BF16, num_splits, UvTiling(), seed=3)


def test_many_splits_read_in_chunks():
    """BLOCK_S 256 > the channel slice's split tile (128 at 32 channels): the splits in two chunks."""
    check(ODD, [3300, 17, 1000], F32, 200, UvTiling(), page=64, seed=4)


def test_real_dims():
    check(REAL, [130, 1] if not FULL_SHAPES else [8192, 1, 3000, 65], BF16, None, UvTiling(), page=64, seed=5)


def test_o_is_rounded_to_the_model_dtype_before_w_uv():
    """W_UV = (1 + 2^-7)·I (BF16-exact): out = round(o_rounded · (1 + 2^-7)), with o_rounded the chain's
    BF16 combine output and the FP32 product exact; a kernel that multiplied the FP32 o instead would
    round differently in many places. Rounding is the dtype cast's: RNE compiled, truncation interpreted."""
    H, C, R = 2, 32, 16
    q, lat, scale, bt, lens_t = make_case([3, 5, 40], H, C, R, 16, BF16, seed=6)
    f = 1 + 2 ** -7
    w = (torch.eye(C) * f).expand(H, C, C).to(BF16).to(DEVICE)
    kw = dict(num_splits=3, tiling=SPLIT_TILING)
    o = mla_decode(q, lat, scale, bt, lens_t, SM_SCALE, kv_lora_rank=C, **kw)
    got = mla_decode(q, lat, scale, bt, lens_t, SM_SCALE, kv_lora_rank=C, w_uv=w, **kw).view(-1, H, C)

    def to_bf16(x):  # FP32 -> BF16 as the kernel's cast does here
        if DEVICE == "cpu":
            return (x.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(BF16)
        return x.to(BF16)
    want = to_bf16(o.float() * f)
    unrounded = to_bf16(mla.mla_decode_ref(q, lat, scale, bt, lens_t, SM_SCALE, kv_lora_rank=C) * f)
    same = (got == want).float().mean().item()
    assert same == 1.0 if DEVICE == "cpu" else same > 0.99, f"{100 * same:.2f}% equal to the rounded chain"
    assert (unrounded != want).float().mean().item() > 0.05, "the case does not tell the rounding points apart"


def test_deterministic_batch_invariant_and_counters_reset():
    """Bitwise: repeated launches agree whichever slice arrives last, a row's result does not depend on its
    batch mates, and every launch leaves its arrival counters at zero."""
    H, C, R, V = ODD
    q, lat, scale, bt, lens_t = make_case([200, 3, 64, 130], H, C, R, 16, F32, seed=7)
    w = make_w_uv(H, V, C, F32)
    kw = dict(kv_lora_rank=C, num_splits=4, tiling=SPLIT_TILING, w_uv=w, uv_tiling=UvTiling(block_c=16, block_b=2))
    a = mla_decode(q, lat, scale, bt, lens_t, SM_SCALE, **kw)
    assert torch.equal(a, mla_decode(q, lat, scale, bt, lens_t, SM_SCALE, **kw))
    for i in (0, 3):
        one = mla_decode(q[i:i + 1], lat, scale, bt[i:i + 1], lens_t[i:i + 1], SM_SCALE, **kw)
        assert torch.equal(one[0], a[i])
    buf, _ = gemm._counters[str(q.device)]
    assert int(buf.count_nonzero()) == 0


def test_combine_uv_on_given_partials_and_empty_batch():
    H, C, R, V = ODD
    q, lat, scale, bt, lens_t = make_case([70, 9], H, C, R, 16, F32, seed=8)
    w = make_w_uv(H, V, C, F32)
    p = mla_partials(q, lat, scale, bt, lens_t, SM_SCALE, kv_lora_rank=C, num_splits=3, tiling=SPLIT_TILING)
    assert p.part is not None and p.direct is None and p.num_splits == 3
    assert_close(combine_uv(p, w), mla_decode_uv_ref(q, lat, scale, bt, lens_t, SM_SCALE, w, kv_lora_rank=C), TOL[F32])
    empty = mla_decode(q[:0], lat, scale, bt[:0], lens_t[:0], SM_SCALE, kv_lora_rank=C, w_uv=w)
    assert empty.shape == (0, H * V)


def test_why_not():
    H, C, R, V = ODD
    q = torch.zeros(2, H, C + R, device=DEVICE)
    w = make_w_uv(H, V, C, F32)
    assert uv_why_not(q, w, C) is None
    assert "dtypes" in uv_why_not(q, w.to(BF16), C)
    assert "shape" in uv_why_not(q, w[:2], C) and "shape" in uv_why_not(q, w, C + 1)
    assert "inner stride" in uv_why_not(q, w.transpose(1, 2).contiguous().transpose(1, 2), C)
    assert "rows" in uv_why_not(torch.zeros(mla.UV_MAX_ROWS + 1, H, C + R, device=DEVICE), w, C)
    assert mla._uv_valid(UvTiling()) and not mla._uv_valid(UvTiling(block_b=3))
    assert not mla._uv_valid(UvTiling(block_c=64)) and mla._uv_valid(UvTiling(block_c=64, num_warps=8))  # registers


def test_bench_parses_args_on_cpu():
    from peregrine.bench import kernels_mla_uv as b
    a = b.parse_args(["--quick", "--batches", "1,3", "--contexts", "1024", "--tilings", "128x32x16w4,64x32x4w4"])
    assert a.quick and a.batches == [1, 3] and a.contexts == [1024]
    assert a.tilings == [UvTiling(128, 32, 16, 4), UvTiling(64, 32, 4, 4)]
    assert b.case_bytes(1, 1024, 16) > 4 * 2 ** 20  # W_UV alone is 4 MB in BF16


def test_specialized_fused_uv_equals_the_bmm(model_dir, monkeypatch):
    """latency_specialized with W_UV in the combine at every B against it never (combine, bmm, copy: the form
    batches over FUSED_UV_MAX_B take): the fused path is what runs; FP32: the same greedy tokens and routing; every
    decode step's logits within tolerance up to the first differing token, or (BF16: o is rounded at the
    same point but the sums differ in order, so a router near-tie may flip) the first step whose routed
    experts differ."""
    from test_specialized import STEPS, assert_same_greedy_and_close_steps, engine, greedy, prompts
    from peregrine.decode import specialized
    calls = []
    real = specialized.mla_decode
    monkeypatch.setattr(specialized, "mla_decode", lambda *a, **k: calls.append(k.get("w_uv") is not None) or real(*a, **k))
    eager = dict(cuda_graphs=False) if DEVICE == "cuda" else {}
    ps = prompts(2, 17)
    rf, rb = [], []
    fused, lf = engine(model_dir, "latency_specialized", routing=rf, **eager)
    bmm, lb = engine(model_dir, "latency_specialized", routing=rb, **eager)
    fused.runner.fused_uv_max_b, bmm.runner.fused_uv_max_b = specialized.MAX_DECODE_BATCH, 0  # eager: read each step
    n = STEPS if FULL_SHAPES else 6
    a = fused.generate(ps, greedy(n))
    assert calls and all(calls), "the fused W_UV path never ran"
    calls.clear()
    b = bmm.generate(ps, greedy(n))
    assert calls and not any(calls), "fused_uv_max_b = 0 still ran the fused path"
    assert [p for p, _ in lf][1:] == ["latency_specialized"] * (len(lf) - 1)
    assert_same_greedy_and_close_steps(a, b, lf, lb, rf, rb)


@pytest.mark.parametrize("n_prompts", [2, 3])
def test_specialized_fused_uv_by_default_only_up_to_its_batch(model_dir, monkeypatch, n_prompts):
    """The fused combine + W_UV serves decode batches of up to FUSED_UV_MAX_B rows (where it won on the
    H200) and the combine, bmm chain the larger ones."""
    from test_specialized import engine, greedy, prompts
    from peregrine.decode import specialized
    calls = []
    real = specialized.mla_decode
    monkeypatch.setattr(specialized, "mla_decode",
                        lambda *a, **k: calls.append((a[0].shape[0], k.get("w_uv") is not None)) or real(*a, **k))
    e, _ = engine(model_dir, "latency_specialized", **(dict(cuda_graphs=False) if DEVICE == "cuda" else {}))
    assert e.runner.fused_uv_max_b == specialized.FUSED_UV_MAX_B == 2
    e.generate(prompts(n_prompts, 3), greedy(3))
    assert calls and all(fused == (rows <= specialized.FUSED_UV_MAX_B) for rows, fused in calls), calls
    assert any(rows == n_prompts for rows, _ in calls)
