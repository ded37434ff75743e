"""MLA absorbed decode over the paged latent cache vs an independent FP32 reference (docs/correctness.md §1)."""
import json
import math

import pytest
import torch

from peregrine.cache import quantize_fp8
from peregrine.kernels import available
from peregrine.kernels.mla import MAX_SPLITS, MlaTiling, load_plan, lookup, mla_decode, pick_num_splits
from peregrine.testing import SENTINEL, assert_close, poisoned
from tests.conftest import DEVICE, FULL_SHAPES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not available(DEVICE), reason="triton kernels unavailable")]

SM_SCALE = 192 ** -0.5          # Kimi-Linear: (nope 128 + rope 64)^-1/2
TINY = (4, 128, 32)             # tiny-kimi-linear: H, kv_lora, rope
REAL = (32, 512, 64)            # Kimi-Linear
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, "fp8": 1e-2}
RAGGED = [1, 3, 63, 64, 65, 200]
# With an explicit num_splits: small tiles and no minimum split, so short contexts really
# spread over several splits (and a split can end mid-block).
SPLIT_TILING = MlaTiling(block_n=16, min_split_tokens=16)
FP8_NAN_BITS = 0x7F             # e4m3fn NaN (torch can't masked_fill FP8 directly)


def reference(q, latent, scale, block_tables, lens, kv_lora):
    """Written from docs/models.md, independent of the kernel: gather, dequantise, softmax, weight c (FP64, CPU)."""
    q, latent, block_tables = q.cpu().double(), latent.cpu(), block_tables.cpu()
    B, H, L = q.shape
    page = latent.shape[1]
    out = torch.zeros(B, H, kv_lora, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        t = torch.arange(n)
        blk, off = block_tables[b, t // page], t % page
        ent = latent[blk, off].double()
        if scale is not None:
            ent = ent * scale.cpu()[blk, off].double()[:, None]
        s = q[b] @ ent.T * SM_SCALE
        p = torch.exp(s - s.max(-1, keepdim=True).values)
        out[b] = (p / p.sum(-1, keepdim=True)) @ ent[:, :kv_lora]
    return out.float()


def make_case(lens, H, C, R, page, dtype, fp8=False, seed=0, spare_blocks=3):
    """Cache with every entry that is not part of a sequence set to NaN, blocks permuted,
    and block-table slots past a sequence's blocks pointing at NaN blocks."""
    g = torch.Generator().manual_seed(seed)
    B, L = len(lens), C + R
    need = [math.ceil(n / page) for n in lens]
    max_blocks = max(need + [1]) + 1  # one spare table column: capacity past the longest sequence
    nblk = sum(need) + spare_blocks
    perm = torch.randperm(nblk, generator=g)
    vals = torch.randn(nblk, page, L, generator=g)
    valid = torch.zeros(nblk, page, dtype=torch.bool)
    bt = torch.empty(B, max_blocks, dtype=torch.int64)
    k = 0
    for b, n in enumerate(lens):
        for j in range(max_blocks):
            if j < need[b]:
                blk = int(perm[k]); k += 1
                bt[b, j] = blk
                valid[blk, : min(page, n - j * page)] = True
            else:  # unused slot: a NaN block (reading it would poison the output)
                bt[b, j] = int(perm[-1 - (j % spare_blocks)])
    if fp8:
        lat, scale = quantize_fp8(vals)
        lat.view(torch.uint8)[~valid] = FP8_NAN_BITS
        scale[~valid] = float("nan")
    else:
        lat, scale = vals.to(dtype), None
        lat[~valid] = float("nan")
    q = torch.randn(B, H, L, generator=g).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    dev = lambda x: None if x is None else x.to(DEVICE)
    return dev(q), dev(lat), dev(scale), dev(bt), dev(lens_t)


def run_checked(q, lat, scale, bt, lens, C, num_splits=None, **kw):
    """Kernel call into a NaN-poisoned slice of a SENTINEL buffer; checks the inputs and the
    rows around the output are left bit-for-bit alone."""
    B, H, _ = q.shape
    big = torch.full((B + 2, H, C), SENTINEL, dtype=q.dtype, device=q.device)
    out = big[1:B + 1]
    out.copy_(poisoned(out.shape, q.dtype, q.device))
    before = [x.clone() for x in (q, lat, bt, lens) + ((scale,) if scale is not None else ())]
    if num_splits is not None:
        kw.setdefault("tiling", SPLIT_TILING)
    got = mla_decode(q, lat, scale, bt, lens, SM_SCALE, kv_lora_rank=C, out=out, num_splits=num_splits, **kw)
    assert got.data_ptr() == out.data_ptr()
    for edge in (big[0], big[-1]):  # SENTINEL as rounded to the dtype, bit for bit
        assert torch.equal(edge, torch.full_like(edge, SENTINEL))
    after = (q, lat, bt, lens) + ((scale,) if scale is not None else ())
    for x, y in zip(before, after):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), "kernel wrote into an input"
    return got


CASES = [  # (dims, page, dtype, num_splits, lens)
    (TINY, 16, torch.float32, None, RAGGED),
    (TINY, 64, torch.float32, 1, RAGGED),
    (TINY, 16, torch.float32, 3, [200, 7, 0, 100]),
    (TINY, 64, torch.bfloat16, None, [65, 1, 130]),
    (REAL, 64, torch.float32, None, [200, 1, 65]),
    (REAL, 16, torch.bfloat16, 2, [3, 100]),
]
if FULL_SHAPES:
    CASES += [
        (REAL, 64, torch.bfloat16, None, RAGGED),
        (REAL, 64, torch.bfloat16, None, [8192, 1, 5000]),
        (REAL, 64, torch.bfloat16, None, [32768]),
        (REAL, 16, torch.float32, None, [4097, 8191]),
        ((96, 512, 64), 64, torch.bfloat16, None, [1, 8192, 3000]),  # K3 heads: 3 head groups
    ]


@pytest.mark.parametrize("dims,page,dtype,num_splits,lens", CASES)
def test_mla_decode(dims, page, dtype, num_splits, lens):
    H, C, R = dims
    q, lat, scale, bt, lens_t = make_case(lens, H, C, R, page, dtype)
    got = run_checked(q, lat, scale, bt, lens_t, C, num_splits=num_splits)
    assert got.dtype == dtype
    assert_close(got.float(), reference(q, lat, scale, bt, lens_t, C), TOL[dtype])


FP8_CASES = [(TINY, 16, torch.float32, None, RAGGED), (REAL, 64, torch.float32, 3, [65, 200])]
if FULL_SHAPES:
    FP8_CASES += [(REAL, 64, torch.bfloat16, None, [1, 8192, 65]), (REAL, 64, torch.bfloat16, None, [32768])]


@pytest.mark.parametrize("dims,page,dtype,num_splits,lens", FP8_CASES)
def test_mla_decode_fp8(dims, page, dtype, num_splits, lens):
    H, C, R = dims
    q, lat, scale, bt, lens_t = make_case(lens, H, C, R, page, dtype, fp8=True)
    got = run_checked(q, lat, scale, bt, lens_t, C, num_splits=num_splits)
    assert_close(got.float(), reference(q, lat, scale, bt, lens_t, C), TOL["fp8"])


def test_empty_sequence_gives_zeros():
    H, C, R = TINY
    q, lat, scale, bt, lens_t = make_case([0, 5], H, C, R, 16, torch.float32)
    for s in (1, 4):
        got = run_checked(q, lat, scale, bt, lens_t, C, num_splits=s)
        assert torch.equal(got[0], torch.zeros_like(got[0]))


def test_non_contiguous_query():
    H, C, R = TINY
    q, lat, scale, bt, lens_t = make_case([70, 9], H, C, R, 16, torch.float32)
    wide = torch.randn(q.shape[0], H + 1, C + R + 16, device=q.device)
    wide[:, 1:, : C + R] = q
    qv = wide[:, 1:, : C + R]  # strided in batch and head
    got = run_checked(qv, lat, scale, bt, lens_t, C, num_splits=2)
    assert_close(got, reference(q, lat, scale, bt, lens_t, C), TOL[torch.float32])


def test_deterministic_and_batch_invariant():
    """Bitwise: repeated calls agree, and a sequence's output doesn't depend on its batch mates."""
    H, C, R = TINY
    lens = [200, 3, 64, 130]
    q, lat, scale, bt, lens_t = make_case(lens, H, C, R, 16, torch.float32, seed=3)
    a = mla_decode(q, lat, scale, bt, lens_t, SM_SCALE, kv_lora_rank=C, num_splits=4, tiling=SPLIT_TILING)
    b = mla_decode(q, lat, scale, bt, lens_t, SM_SCALE, kv_lora_rank=C, num_splits=4, tiling=SPLIT_TILING)
    assert torch.equal(a, b)
    for i in (0, 2):
        one = mla_decode(q[i:i + 1], lat, scale, bt[i:i + 1], lens_t[i:i + 1], SM_SCALE, kv_lora_rank=C, num_splits=4, tiling=SPLIT_TILING)
        assert torch.equal(one[0], a[i])


def test_lengths_change_under_a_fixed_grid():
    """Graph replay: same buffers, same grid, context_lens updated in place between calls."""
    H, C, R = TINY
    q, lat, scale, bt, lens_t = make_case([200, 150], H, C, R, 16, torch.float32, seed=5)
    out = torch.empty(2, H, C, device=q.device)
    for lens in ([200, 150], [1, 150], [65, 0], [130, 17]):
        lens_t.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        mla_decode(q, lat, scale, bt, lens_t, SM_SCALE, kv_lora_rank=C, num_splits=5, out=out, tiling=SPLIT_TILING)
        assert_close(out, reference(q, lat, scale, bt, lens_t, C), TOL[torch.float32], f"lens {lens}")


def test_pick_num_splits():
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 8
    for B in (1, 2, 3, 4, 8, 64):
        prev = 0
        for ctx in (1, 64, 1024, 8192, 131072):
            s = pick_num_splits(B, 32, ctx, DEVICE)
            assert 1 <= s <= MAX_SPLITS and s >= prev  # grows with the bound, never past the cap
            assert B * s <= max(sms, B), "programs past one wave leave a nearly empty second wave"
            prev = s
    assert pick_num_splits(1, 32, 64, DEVICE) == 1
    assert pick_num_splits(8, 32, 131072, DEVICE) == max(1, sms // 8)
    assert pick_num_splits(2, 32, 131072, DEVICE, MlaTiling(programs_per_sm=2)) == min(MAX_SPLITS, sms)


def test_many_splits_keep_a_minimum_chunk():
    """A long-capacity table's many splits: short sequences use few, full splits (default tiling)."""
    H, C, R = TINY
    q, lat, scale, bt, lens_t = make_case([1, 200, 129, 300], H, C, R, 16, torch.float32, seed=7)
    got = run_checked(q, lat, scale, bt, lens_t, C, num_splits=8, tiling=MlaTiling())
    assert_close(got, reference(q, lat, scale, bt, lens_t, C), TOL[torch.float32])


# FP8 cache with FP16 dot operands: PV weights in log space (their own running max), q̂ pre-scaled.
FP16_TILING = MlaTiling(block_n=16, min_split_tokens=16, fp8_compute="fp16")


@pytest.mark.parametrize("dims,lens,num_splits", [(TINY, [200, 1, 65], None), (TINY, [300, 0, 40], 5),
                                                  (REAL, [130, 7], 3)] + ([(REAL, [8192, 1, 3000], None)] if FULL_SHAPES else []))
def test_mla_decode_fp8_fp16_operands(dims, lens, num_splits):
    H, C, R = dims
    q, lat, scale, bt, lens_t = make_case(lens, H, C, R, 64, torch.bfloat16, fp8=True, seed=13)
    scale.mul_(1e-3)  # small scales: p·scale would leave FP16's normal range
    tiling = FP16_TILING if not FULL_SHAPES or num_splits else MlaTiling(block_n=32, fp8_compute="fp16")
    got = run_checked(q, lat, scale, bt, lens_t, C, num_splits=num_splits, tiling=tiling)
    assert_close(got.float(), reference(q, lat, scale, bt, lens_t, C), TOL["fp8"])
    if 0 in lens:
        assert torch.equal(got[lens.index(0)], torch.zeros_like(got[0]))


def test_combine_with_many_splits():
    """More splits than one combine tile row group (BLOCK_S 256, 16-channel slices), ragged lengths."""
    H, C, R = TINY
    q, lat, scale, bt, lens_t = make_case([3300, 17, 1000], H, C, R, 64, torch.float32, seed=17)
    got = run_checked(q, lat, scale, bt, lens_t, C, num_splits=200)
    assert_close(got, reference(q, lat, scale, bt, lens_t, C), TOL[torch.float32])


def test_plan_loader_and_fallbacks(tmp_path):
    good = {"num_splits": 64, "block_h": 32, "block_n": 32, "num_warps": 8, "num_stages": 2, "fp8_compute": "fp16"}
    entries = {"fp8,1,8192": good, "fp8,1,32768": good | {"num_splits": 132}, "fp8,8,8192": good | {"num_splits": 16},
               "bf16,1,8192": good | {"block_n": 48}, "bf16,2,8192": good | {"fp8_compute": "fp4"},
               "bf16,4,8192": {"block_n": 64}, "fp8,2,x": good}
    p = tmp_path / "plan.json"
    p.write_text(json.dumps({"entries": entries}))
    plan = load_plan(str(p))
    assert set(plan) == {("fp8", 1, 8192), ("fp8", 1, 32768), ("fp8", 8, 8192)}
    t, s = lookup("fp8", 1, 8192, path=str(p))
    assert s == 64 and t == MlaTiling(block_n=32, num_stages=2, fp8_compute="fp16")
    assert lookup("fp8", 1, 10000, path=str(p))[1] == 132   # next bucket up
    assert lookup("fp8", 1, 1 << 20, path=str(p))[1] == 132  # past the largest: the largest
    assert lookup("fp8", 3, 4096, path=str(p))[1] == 16      # next planned batch up
    assert lookup("bf16", 1, 8192, path=str(p)) is None      # nothing valid planned: heuristic
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    assert load_plan(str(bad)) == {} and load_plan(str(tmp_path / "none.json")) == {}
    committed = load_plan()
    for (cache, b, ctx), (t, s) in committed.items():
        assert 1 <= s <= MAX_SPLITS


def test_bench_plan_writer_round_trips(tmp_path):
    """What `kernels_mla --tune` writes is what mla_decode's plan loader reads."""
    from peregrine.bench import kernels_mla as bench
    from peregrine.kernels import mla
    assert all(mla._valid(t) for ts in bench.TUNE_TILINGS.values() for t in ts)
    t = MlaTiling(block_n=32, num_stages=4, fp8_compute="fp16", min_split_tokens=32)
    best = {mla.plan_key("fp8", 8, 32768): {"tiling": vars(t), "num_splits": 16, "time_ms": 0.1, "gbps": 3000.0},
            mla.plan_key("bf16", 1, 8192): {"tiling": vars(MlaTiling()), "num_splits": 132, "time_ms": 0.01}}
    p = tmp_path / "mla_plan.json"
    bench.write_plan(best, {"gpu": "test"}, path=p)
    assert load_plan(str(p)) == {("fp8", 8, 32768): (t, 16), ("bf16", 1, 8192): (MlaTiling(), 132)}
    row = {"cache": "fp8", "B": 8, "context": 32768, "num_splits": 16, "time_ms": 0.1, "gbps": 3000.0,
           "pct_of_copy": 0.7, "rel_err": 1e-3, "tiling": vars(t)}
    assert "fp16" in bench.table([row])


VERIFY_CASES = [  # (dims, page, dtype, fp8, T, query_rows, num_splits, sequence lengths counting the T rows)
    (TINY, 16, torch.float32, False, 4, 0, None, [4, 70, 33]),  # the first sequence's row 0 sees one entry
    (TINY, 16, torch.float32, False, 3, 2, 3, [3, 100]),  # ragged: the second program of a sequence has one row
    (TINY, 64, torch.float32, False, 5, 4, 1, [9, 64]),  # one split: the program writes o itself
    (TINY, 16, torch.float32, True, 4, 2, 2, [40, 5]),
    (REAL, 16, torch.float32, False, 8, 2, 2, [8, 150]),
]
if FULL_SHAPES:
    VERIFY_CASES += [(REAL, 64, torch.bfloat16, False, 8, 0, None, [8192, 9]),
                     (REAL, 64, torch.bfloat16, True, 4, 0, None, [300, 4096])]


def _verify_rows(bt, lens, T):
    """The verify step's rows as the plain kernel sees them: sequence s's table for each of its T rows, row r
    attending to the entries before len_s - (T - 1) + r."""
    rows = torch.repeat_interleave(bt, T, dim=0)
    r = torch.arange(T, dtype=lens.dtype, device=lens.device).repeat(lens.shape[0])
    return rows, torch.repeat_interleave(lens, T) - (T - 1) + r


@pytest.mark.parametrize("dims,page,dtype,fp8,T,query_rows,num_splits,lens", VERIFY_CASES)
def test_mla_verify_rows_share_the_latent_reads(dims, page, dtype, fp8, T, query_rows, num_splits, lens):
    """#42: T query rows of a sequence in one program (tokens_per_seq, query_rows) equal the FP64 reference of
    each row alone over its causal prefix; output rows poisoned, the rows around them untouched."""
    H, C, R = dims
    _, lat, scale, bt, lens_t = make_case(lens, H, C, R, page, dtype, fp8=fp8)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(len(lens) * T, H, C + R, generator=g).to(dtype).to(DEVICE)
    tiling = SPLIT_TILING if num_splits is not None and not fp8 else None
    got = run_checked(q, lat, scale, bt, lens_t, C, num_splits=num_splits, tokens_per_seq=T,
                      query_rows=query_rows, **({"tiling": tiling} if tiling else {}))
    rows, row_lens = _verify_rows(bt, lens_t, T)
    assert_close(got.float(), reference(q, lat, scale, rows, row_lens, C), TOL["fp8" if fp8 else dtype])


@pytest.mark.parametrize("T,query_rows,num_splits", [(4, 2, 3), (3, 0, 1)])
def test_mla_verify_rows_with_w_uv(T, query_rows, num_splits):
    """The verify layout through combine_uv (W_UV in the combine): each row's attention output times W_UV."""
    from peregrine.kernels.mla import mla_decode_uv_ref
    H, C, R = TINY
    _, lat, scale, bt, lens_t = make_case([50, 6], H, C, R, 16, torch.float32)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2 * T, H, C + R, generator=g).to(DEVICE)
    w_uv = torch.randn(H, 16, C, generator=g).to(DEVICE)
    got = mla_decode(q, lat, scale, bt, lens_t, SM_SCALE, kv_lora_rank=C, w_uv=w_uv, num_splits=num_splits,
                     tiling=SPLIT_TILING, tokens_per_seq=T, query_rows=query_rows)
    rows, row_lens = _verify_rows(bt, lens_t, T)
    want = mla_decode_uv_ref(q, lat, scale, rows, row_lens, SM_SCALE, w_uv, kv_lora_rank=C)
    assert_close(got, want, TOL[torch.float32])


def test_verify_query_rows():
    """Rows a verify program takes: a power of two, one by default, never more than T's."""
    from peregrine.kernels.mla import verify_query_rows
    assert verify_query_rows(8) == 1 and verify_query_rows(8, 2) == 2 and verify_query_rows(8, 3) == 4
    assert verify_query_rows(3, 8) == 4 and verify_query_rows(2, 4) == 2


def test_mla_kernels_compile_for_sm90():
    """The interpreter cannot catch compile errors: the split kernel for sm_90a (ptxas included). The decode
    tilings and the one-row verify layout must not spill; the two-row (M = 64) layout's spills are reported by
    the bench and are why it is opt-in."""
    from conftest import run_aot
    rows = run_aot("import json; from peregrine.bench import kernels_mla as b; print(json.dumps(b.compile_check()))")
    assert [r["kernel"] for r in rows] == ["decode bf16", "decode fp8", "verify qr=1 bf16", "verify qr=2 bf16",
                                           "verify qr=2 fp8"]
    for row in rows:
        assert "error" not in row and 0 < row["regs"] <= 255, row
        if "qr=2" not in row["kernel"]:
            assert row["spill"] == 0, row
