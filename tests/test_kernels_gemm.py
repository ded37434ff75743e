"""Skinny GEMM (peregrine/kernels/gemm.py) against an FP32 reference written here."""
import pytest
import torch

from conftest import FULL_SHAPES
from peregrine.bench.kernels_gemm import SHAPES
from peregrine.kernels import gemm
from peregrine.kernels.gemm import grouped_gemm, skinny_gemm
from peregrine.testing import SENTINEL, assert_close, poisoned

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# CPU (interpreter) subset: odd sizes around the tiles; the tiny preset's hidden 256.
ODD = [(1, 100, 257), (3, 257, 100), (7, 100, 1000), (16, 256, 256), (1, 4097, 33)]
REAL = [(m, n, k) for n, k in SHAPES for m in (1, 3, 16)] if FULL_SHAPES else []
# Each variant forced on one shape, so all four code paths run everywhere.
VARIANTS = {
    "plain_dot": dict(kernel="plain", BLOCK_N=32, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=2, dot=True),
    "plain_fma": dict(kernel="plain", BLOCK_N=16, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=2, dot=False),
    "splitk_dot": dict(kernel="splitk", BLOCK_N=32, BLOCK_K=64, SPLIT_K=4, num_warps=4, num_stages=2, dot=True),
    "splitk_fma": dict(kernel="splitk", BLOCK_N=16, BLOCK_K=64, SPLIT_K=3, num_warps=4, num_stages=2, dot=False),
    "inline_dot": dict(kernel="splitk", BLOCK_N=32, BLOCK_K=64, SPLIT_K=4, num_warps=4, num_stages=2, dot=True,
                       reduce="inline"),
    "inline_fma": dict(kernel="splitk", BLOCK_N=8, BLOCK_K=64, SPLIT_K=3, num_warps=2, num_stages=2, dot=False,
                       reduce="inline"),
}


def ref(x, w):  # independent of the code under test
    return torch.einsum("mk,nk->mn", x.double(), w.double()).float()


def _inputs(m, n, k, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    w = (torch.randn(n, k, generator=g, device=device) / k ** 0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mnk", ODD + REAL)
def test_matches_reference(mnk, dtype, device):
    x, w = _inputs(*mnk, dtype, device)
    out = poisoned((mnk[0], mnk[1]), dtype, device)
    skinny_gemm(x, w, out=out)
    assert_close(out, ref(x, w), TOL[dtype])
    y = skinny_gemm(x, w)
    assert y.dtype == dtype and y.shape == (mnk[0], mnk[1])
    assert torch.equal(y, out), "out= and allocated result differ"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mnk", [(1, 100, 257), (7, 33, 1000)])
def test_variants(variant, mnk, dtype, device):
    x, w = _inputs(*mnk, dtype, device, seed=1)
    out = poisoned((mnk[0], mnk[1]), dtype, device)
    skinny_gemm(x, w, out=out, config=VARIANTS[variant])
    assert_close(out, ref(x, w), TOL[dtype], variant)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mnk", [(1, 100, 257), (3, 33, 1024), (2, 40, 64)])
def test_prefetch_keeps_the_bits(variant, mnk, dtype, device, monkeypatch):
    """The weight prefetch only moves loads earlier: the same products in the same order, so the
    same bits, on even and ragged K, one K step per split (nothing to prefetch) and many."""
    x, w = _inputs(*mnk, dtype, device, seed=4)
    want = skinny_gemm(x, w, config=VARIANTS[variant])
    seen, kernel = [], gemm._gemm_kernel

    class Spy:  # the config's flag must reach the kernel, else this test compares a kernel with itself
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(kw["PREFETCH"]) or kernel[grid](*a, **kw)
    monkeypatch.setattr(gemm, "_gemm_kernel", Spy())
    got = poisoned(want.shape, dtype, device)
    skinny_gemm(x, w, out=got, config=VARIANTS[variant] | {"prefetch": True})
    assert seen == [True], seen
    assert torch.equal(got, want), variant
    assert_close(got, ref(x, w), TOL[dtype], variant)


@pytest.mark.parametrize("variant", ["plain_dot", "splitk_fma", "inline_fma"])
def test_out_slice_and_strided_x(variant, device):
    m, n, k = 3, 100, 130
    x_big, w = _inputs(m, 1, k + 7, torch.bfloat16, device)[0], _inputs(m, n, k, torch.bfloat16, device)[1]
    x = x_big[:, 5:5 + k]  # row stride k + 7
    buf = torch.full((m + 2, n + 20), SENTINEL, dtype=torch.bfloat16, device=device)
    before = buf.clone()
    out = buf[1:m + 1, 10:10 + n]
    skinny_gemm(x, w, out=out, config=VARIANTS[variant])
    assert_close(out, ref(x, w), TOL[torch.bfloat16])
    keep = torch.ones_like(buf, dtype=torch.bool)
    keep[1:m + 1, 10:10 + n] = False
    assert torch.equal(buf[keep], before[keep]), "neighbours of the out slice were touched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_splitk_bitwise_reproducible(dtype, device):
    x, w = _inputs(5, 64, 2048, dtype, device, seed=2)
    cfg = VARIANTS["splitk_dot"] | {"SPLIT_K": 8}
    a = skinny_gemm(x, w, config=cfg)
    b = skinny_gemm(x, w, out=poisoned(a.shape, dtype, device), config=cfg)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mnk", [(1, 100, 257), (5, 64, 2048), (3, 300, 700)])
def test_inline_reduce_equals_the_reduce_kernel_bit_for_bit_and_resets_its_counters(mnk, dtype, device):
    """The last-arrival sum is the reduce kernel's sum in the same order; every launch leaves its
    arrival counters at zero (else the next launch's last program would never see its count)."""
    x, w = _inputs(*mnk, dtype, device, seed=3)
    for name in ("splitk_fma", "splitk_dot"):
        base = VARIANTS[name] | {"SPLIT_K": 4}
        want = skinny_gemm(x, w, config=base)
        for _ in range(3):  # repeated launches reuse counters other launches reset
            got = skinny_gemm(x, w, out=poisoned(want.shape, dtype, device), config=base | {"reduce": "inline"})
            assert torch.equal(got, want), name
    buf, _ = gemm._counters[str(x.device)]
    assert int(buf.count_nonzero()) == 0


def test_plan_entries_valid_and_fallback():
    for key, e in gemm.load_plan().items():
        m, n, k = map(int, key.split(","))
        cfg = gemm.lookup(m, n, k)
        assert cfg["kernel"] in ("plain", "splitk", "torch") and cfg["BLOCK_K"] & (cfg["BLOCK_K"] - 1) == 0, key
        assert e.get("kernel") == cfg["kernel"]
        assert e["measured"]["time_ms"] > 0, key  # every entry carries the timing that chose it
    cfg = gemm.lookup(3, 12345, 6789)  # not in any plan
    assert cfg == gemm.heuristic(3, 12345, 6789)
    small_n = gemm.heuristic(1, 256, 2304)  # router: few N tiles -> split K
    assert small_n["kernel"] == "splitk" and small_n["SPLIT_K"] > 1


def test_an_untuned_row_count_takes_the_next_tuned_ones_config():
    """Verify steps run B·T rows (3, 5, 6, 7 at B = 1) the plan was not tuned at: they take the entry of the next
    larger tuned M at the same (N, K) (read here from the plan file itself), the heuristic only past the largest."""
    import json
    entries = json.loads(gemm.PLAN_PATH.read_text())["entries"]
    tuned: dict[tuple, dict[int, dict]] = {}
    for key, e in entries.items():
        m, n, k = map(int, key.split(","))
        tuned.setdefault((n, k), {})[m] = e
    for (n, k), by_m in tuned.items():
        for m in range(1, max(by_m) + 3):
            cfg = gemm.lookup(m, n, k)
            src = by_m.get(m) or by_m.get(min((t for t in by_m if t > m), default=0))
            if src is None:
                assert cfg == gemm.heuristic(m, n, k), (m, n, k)
                continue
            assert all(cfg[f] == src[f] for f in ("kernel", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps")), (m, n, k)
    assert gemm.lookup(3, 163840, 2304)["kernel"] == entries["4,163840,2304"]["kernel"]


@pytest.mark.parametrize("mnk", [(3, 4096, 128), (5, 4096, 128), (3, 2304, 1024), (7, 2304, 1024), (5, 2048, 2304)])
def test_a_borrowed_plan_config_computes_the_product(mnk, device):
    """The configs untuned row counts borrow (Triton ones of the 48B's shapes: dot tiles, split-K) on their rows,
    into a poisoned output."""
    m, n, k = mnk
    cfg = gemm.lookup(m, n, k)
    assert cfg["kernel"] in ("plain", "splitk") and f"{m},{n},{k}" not in gemm.load_plan()
    x, w = _inputs(m, n, k, torch.bfloat16, device, seed=7)
    y = skinny_gemm(x, w, out=poisoned((m, n), torch.bfloat16, device))
    assert_close(y, ref(x, w), TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cublas_plan_entry_into_strided_out(device, dtype):
    """A plan entry may pick cuBLAS ("torch"); it must honour `out` slices like the Triton kernels."""
    x, w = torch.randn(3, 100, device=device, dtype=dtype), torch.randn(40, 100, device=device, dtype=dtype)
    buf = torch.full((3, 64), SENTINEL, device=device, dtype=dtype)
    y = buf[:, 8:48]
    y.fill_(float("nan"))
    skinny_gemm(x, w, out=y, config=gemm.heuristic(3, 40, 100) | {"kernel": "torch"})
    assert_close(y, gemm.skinny_gemm_ref(x, w), 1e-5 if dtype == torch.float32 else 1e-2)
    assert (buf[:, :8] == SENTINEL).all() and (buf[:, 48:] == SENTINEL).all()


def test_the_wide_decode_sweep_yields_valid_configs_that_compute_the_product(device):
    from peregrine.bench import kernels_gemm as kg
    for (n, k), m in [(s, m) for s in kg.DECODE_48B for m in (1, 2, 4, 8)]:
        cfgs = list(kg.wide_candidates(m, n, k))
        assert cfgs, (m, n, k)
        for c in cfgs:
            grid, k_per, _ = gemm.tiling(m, n, k, c)
            assert gemm.NUM_SMS // 2 <= grid[0] * grid[1] and k_per * (grid[1] - 1) < k, (m, n, k, c)
            assert c["dot"] or m <= gemm.FMA_MAX_ROWS
    x, w = _inputs(2, 600, 1100, torch.bfloat16, device, seed=4)
    cfgs = list(kg.wide_candidates(2, 600, 1100))
    picks = [next(c for c in cfgs if c["BLOCK_N"] == 4), next(c for c in cfgs if c["dot"]),
             next(c for c in cfgs if c["reduce"] == "inline")]
    for c in picks:
        assert_close(skinny_gemm(x, w, out=poisoned((2, 600), torch.bfloat16, device), config=c), ref(x, w),
                     TOL[torch.bfloat16], str(c))


def test_the_deep_sweep_pipelines_tensor_core_tiles_that_compute_the_product(device):
    from peregrine.bench import kernels_gemm as kg
    for m in (1, 2, 4, 8):
        cfgs = list(kg.deep_candidates(m, 2304, 4096))
        deep = [c for c in cfgs if c["dot"]]
        assert deep and {c["num_stages"] for c in deep} == set(kg.DEEP_STAGES), m
        for c in deep:
            grid, k_per, _ = gemm.tiling(m, 2304, 4096, c)
            assert gemm.NUM_SMS <= grid[0] * grid[1] and k_per // c["BLOCK_K"] >= c["num_stages"], c
        assert all(c["prefetch"] for c in cfgs if not c["dot"]) and (m > 2 or len(cfgs) > len(deep)), m
    x, w = _inputs(3, 640, 2048, torch.bfloat16, device, seed=5)
    cfgs = [c for c in kg.deep_candidates(3, 640, 2048) if c["dot"]]
    for c in (next(c for c in cfgs if c["num_stages"] == 4), next(c for c in cfgs if c["SPLIT_K"] > 1)):
        assert_close(skinny_gemm(x, w, out=poisoned((3, 640), torch.bfloat16, device), config=c), ref(x, w),
                     TOL[torch.bfloat16], str(c))


# grouped_gemm: (M, N per group, K, G); small odd K, odd M, K long enough to split; B=16 rows
GROUPED = [(3, 48, 40, 2), (1, 96, 300, 3), (16, 32, 257, 2)]
GROUPED_CASES = [(s, v) for s in GROUPED for v in [None, *VARIANTS]
                 if v is None or s[1] % VARIANTS[v]["BLOCK_N"] == 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mnkg,variant", GROUPED_CASES)
def test_grouped_equals_separate_gemms_bit_for_bit(mnkg, variant, dtype, device):
    """Each group's columns: the bits of its own skinny_gemm with the same config, within tolerance of
    an FP32 reference; x a row-strided view, out a column slice whose neighbours stay untouched."""
    m, n, k, g = mnkg
    cfg = VARIANTS[variant] if variant else None
    gen = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(m, g * k + 9, generator=gen, device=device).to(dtype)[:, 4:4 + g * k]
    w = (torch.randn(g * n, k, generator=gen, device=device) / k ** 0.5).to(dtype)
    buf = poisoned((m, g * n + 7), dtype, device)
    out = buf[:, 3:3 + g * n]
    assert grouped_gemm(x, w, g, out=out, config=cfg) is out
    assert buf[:, :3].isnan().all() and buf[:, 3 + g * n:].isnan().all(), "neighbours of out were written"
    for i in range(g):
        xs, ws, cols = x[:, i * k:(i + 1) * k], w[i * n:(i + 1) * n], slice(i * n, (i + 1) * n)
        assert_close(out[:, cols], ref(xs, ws), TOL[dtype], f"group {i}")
        sep = skinny_gemm(xs, ws, config=cfg or gemm.lookup(m, n, k))
        assert torch.equal(out[:, cols], sep), f"group {i} differs from its own GEMM"
    assert torch.equal(grouped_gemm(x, w, g, config=cfg), out), "allocated result differs from out="


def test_grouped_cublas_config_and_shape_checks(device):
    x, w = torch.randn(3, 80, device=device), torch.randn(96, 40, device=device)
    y = grouped_gemm(x, w, 2, config=gemm.heuristic(3, 48, 40) | {"kernel": "torch"})
    assert_close(y, torch.cat([ref(x[:, :40], w[:48]), ref(x[:, 40:], w[48:])], 1), TOL[torch.float32])
    with pytest.raises(AssertionError, match="straddle"):
        grouped_gemm(x, w, 2, config=VARIANTS["plain_dot"])  # BLOCK_N 32 does not divide 48
    with pytest.raises(AssertionError, match="groups"):
        grouped_gemm(x, w, 3)


def test_grouped_bench_parses_and_runs_on_cpu(monkeypatch, device):
    """`kernels_gemm --grouped` parses on CPU; its row (tiny widths, fake clock) times both forms on the
    same bits and counts the stacked weight, x and y once."""
    from peregrine.bench import kernels_gemm as kg
    a = kg.parser().parse_args(["--grouped", "--pdl"])
    assert a.grouped and a.pdl and a.ms is None and kg.GROUPED_MS == (1, 2, 4, 8)
    if device != "cpu":
        pytest.skip("the GPU pass runs the real benchmark")
    for name, val in dict(DEVICE="cpu", DTYPE=torch.float32, ROTATE_BYTES=1, REPS=1).items():
        monkeypatch.setattr(kg, name, val)
    monkeypatch.setattr(kg, "graph_time", lambda calls, iters: ([c() for c in calls], (2.0, [2.0]))[-1])
    (row,) = kg.run_grouped(1000.0, ms=(3,), n=48, k=40, g=2)
    assert row["identical"] and row["time_ms"] == row["separate_ms"] == 2.0
    assert row["bytes"] == (2 * 48 * 40 + 3 * 80 + 3 * 96) * 4 and row["pct_of_copy"] == row["bytes"] / 2.0 / 1e6 / 1000.0


@pytest.mark.parametrize("variant", ["plain_fma", "splitk_dot", "inline_fma"])
def test_stream_tiles_reads_every_weight_once_with_the_configs_tiling(variant, device):
    """kernels_gemm --stream's read-only kernel: with each config's grid and tiles the programs' maxima cover
    the whole weight exactly (the overall max, and per N tile the max of its rows), ragged N and K included."""
    from peregrine.bench import kernels_gemm as kg
    w = torch.randn(37, 1000, generator=torch.Generator().manual_seed(3)).to(device)
    cfg = VARIANTS[variant]
    got = kg.stream_tiles(w, cfg)
    assert got.max() == w.max()
    bn = cfg["BLOCK_N"]
    want = torch.stack([w[i:i + bn].max() for i in range(0, 37, bn)])
    assert torch.equal(got.max(0).values, want), variant


def test_stream_option_adds_the_reads_alone_to_each_row(monkeypatch, device):
    from peregrine.bench import kernels_gemm as kg
    assert kg.parser().parse_args(["--stream"]).stream
    if device != "cpu":
        pytest.skip("the GPU pass runs the real benchmark")
    for name, val in dict(DEVICE="cpu", DTYPE=torch.float32, ROTATE_BYTES=1, REPS=1).items():
        monkeypatch.setattr(kg, name, val)
    monkeypatch.setattr(kg, "graph_time", lambda calls, iters: ([c() for c in calls], (2.0, [2.0]))[-1])
    plan = {gemm.plan_key(2, 40, 64): VARIANTS["plain_fma"], gemm.plan_key(2, 48, 64): VARIANTS["plain_fma"] | {"kernel": "torch"}}
    rows = kg.run(1000.0, plan=plan, ms=(2,), shapes=[(40, 64), (48, 64)], stream=True)
    assert rows[0]["stream_ms"] == 2.0 and rows[0]["stream_pct_of_copy"] == 40 * 64 * 4 / 2.0 / 1e6 / 1000.0
    assert "stream_ms" not in rows[1], "cuBLAS rows have no tiling to stream"
    assert "reads alone" in kg.table(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mnk", [(17, 100, 257), (40, 64, 300), (64, 33, 128), (70, 40, 96)])
def test_verify_rows_in_one_wide_tile(mnk, dtype, device, monkeypatch):
    """17..64 rows (a verify step's B x T) take one M tile of 32 or 64 (each weight tile read once: the grid has
    a single M program); past 64, 64-row tiles. Poisoned output, FP32 reference, the dot and split-K paths."""
    m = mnk[0]
    seen, kernel = [], gemm._gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            seen.append(grid)
            return kernel[grid]
    monkeypatch.setattr(gemm, "_gemm_kernel", Spy())
    for variant in ("plain_dot", "splitk_dot"):
        x, w = _inputs(*mnk, dtype, device)
        out = poisoned((m, mnk[1]), dtype, device)
        skinny_gemm(x, w, out=out, config=VARIANTS[variant])
        assert_close(out, ref(x, w), TOL[dtype])
        assert seen[-1][2] == -(-m // 64), (variant, seen[-1])  # M programs: one up to 64 rows
    assert gemm.tiling(m, mnk[1], mnk[2], VARIANTS["plain_dot"])[2]["BLOCK_M"] == (32 if m <= 32 else 64)


def test_verify_gemm_switch(monkeypatch):
    """_mm sends 17..64 rows to the skinny kernel only with PEREGRINE_VERIFY_GEMM=triton (cuBLAS until measured)."""
    from peregrine.decode import specialized as sp
    calls = []
    monkeypatch.setattr(sp, "skinny_gemm", lambda x, w, out=None: calls.append(x.shape[0]) or x @ w.T)
    x, w = torch.randn(40, 8), torch.randn(6, 8)
    monkeypatch.delenv(sp.VERIFY_GEMM_ENV, raising=False)
    sp._mm(x, w)
    sp._mm(x[:16], w)
    assert calls == [16]
    monkeypatch.setenv(sp.VERIFY_GEMM_ENV, "triton")
    sp._mm(x, w)
    sp._mm(torch.randn(65, 8), w)
    assert calls == [16, 40]


def test_wide_verify_tile_compiles_for_sm90_without_spills():
    """The 64-row tile (BLOCK_N 32 and 64, BLOCK_K 128, tensor cores, BF16) compiled ahead of time for sm_90a:
    the interpreter cannot catch a compile error or register spills."""
    from conftest import run_aot
    rows = run_aot("""
import json
from peregrine.bench.kernels_moe import compile_sm90
from peregrine.kernels import gemm
p, n, c = (lambda t: (t, 0)), (lambda v: ("i32", v)), (lambda v: ("constexpr", v))
out = []
for bn in (32, 64):
    args = dict(x_ptr=p("*bf16"), w_ptr=p("*bf16"), y_ptr=p("*bf16"), M=n(40), N=n(4096), K=n(2304), stride_xm=n(2304),
                stride_wn=n(2304), stride_ym=n(4096), stride_ys=n(0), k_per_split=n(2304), out_ptr=p("*bf16"),
                stride_om=n(0), count_ptr=p("*i32"), group_n=n(0), BLOCK_M=c(64), BLOCK_N=c(bn), BLOCK_K=c(128),
                USE_DOT=c(True), IEEE=c(False), EVEN_K=c(True), INLINE_REDUCE=c(False), PREFETCH=c(False))
    out.append(dict(compile_sm90(gemm._gemm_kernel, args, 4, 2), BLOCK_N=bn))
print(json.dumps(out))
""")
    assert len(rows) == 2
    for row in rows:
        assert "error" not in row and row["spill"] == 0 and 0 < row["regs"] <= 255, row
