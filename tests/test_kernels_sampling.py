"""argmax / sample (peregrine/kernels/sampling.py) against references written here: the distribution a
sampler must draw from (ref_dist, by sorting in FP64), checked by chi-square over 20 000 draws, and the
kernel token for token against sample_ref (PyTorch, sorting, the same Philox bits)."""
import pytest
import torch

from conftest import FULL_SHAPES
from peregrine.kernels import sampling
from peregrine.kernels.sampling import CAND_CAP, argmax, filtered_probs_ref, sample, sample_ref, thresholds

pytestmark = pytest.mark.gpu

VOCAB = 163840  # Kimi vocab


# The interpreter costs ~25 ms per program whatever its size, so CPU runs keep program
# counts (rows x vocab chunks) small; the GPU pass runs the larger sample counts.
CPU = not FULL_SHAPES


@pytest.fixture
def small_chunks(monkeypatch):
    """Shrink the vocab chunk so a small vocab still spans several programs and stage 2 merges them."""
    monkeypatch.setattr(sampling, "BLOCK_V", 64)


def _logits(b, v, device, seed=0, dtype=torch.float32, scale=3.0):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(b, v, generator=g, device=device) * scale).to(dtype)


def ref_dist(row, t, k, p, min_p=0.0):
    """FP64 distribution after temperature, min-p, top-k, renormalisation and nucleus (vLLM's order)."""
    q = torch.softmax(row.double() / t, -1)
    q = q * (q >= min_p * q.max())
    qs, order = torch.sort(q, descending=True, stable=True)
    kk = k if k > 0 else q.numel()
    qs, order = qs[:kk], order[:kk]
    before = torch.cumsum(qs, 0) - qs
    keep = (before < p * qs.sum()) & (qs > 0) if p < 1 else torch.ones_like(qs, dtype=torch.bool)  # 1: no nucleus
    keep[0] = True
    out = torch.zeros_like(q)
    out[order[keep]] = qs[keep]
    return out / out.sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,v", [(1, VOCAB), (3, 100), (7, 4097), (16, 257)] + ([(8, VOCAB)] if FULL_SHAPES else []))
def test_argmax(b, v, dtype, device):
    x = _logits(b, v, device, dtype=dtype)
    top = x.float().max() + 1
    x[0, v - 1] = top  # a tie across chunks: the lower index must win
    x[0, v // 3] = top
    if b > 1:
        x[1] = float("-inf")  # all -inf: index 0 like torch
        x[1, v - 1] = top if b > 2 else x[1, v - 1]
    got = argmax(x)
    assert got.dtype == torch.int64 and got.shape == (b,)
    assert torch.equal(got, torch.argmax(x.float(), dim=-1))


def test_argmax_strided_rows(small_chunks, device):
    big = _logits(5, 150, device, seed=3)
    x = big[:, 20:120]
    assert torch.equal(argmax(x), torch.argmax(x, dim=-1))


def _params(b, device, temps, ks, ps, seed0=0, off=0, min_ps=(0.0,)):
    f = lambda vals, dt: torch.tensor([vals[i % len(vals)] for i in range(b)], dtype=dt, device=device)
    return (f(temps, torch.float32), f(ks, torch.int32), f(ps, torch.float32),
            torch.arange(seed0, seed0 + b, dtype=torch.int64, device=device),
            torch.full((b,), off, dtype=torch.int64, device=device), f(min_ps, torch.float32))


def test_greedy_rows_equal_argmax(device):
    x = _logits(7, 300, device, seed=4)
    t, k, p, s, o, _ = _params(7, device, [0.0, 1.0, 0.0, 0.8], [0, 5, 3, 0], [1.0, 0.9, 0.5, 0.3])
    got = sample(x, t, k, p, s, o)
    greedy = torch.argmax(x, dim=-1)
    assert torch.equal(got[t == 0], greedy[t == 0])
    one = _params(7, device, [1.0], [1], [1.0])  # top_k = 1 and top_p = 0 are greedy too
    assert torch.equal(sample(x, *one), greedy)
    zero_p = _params(7, device, [1.5], [0], [0.0])
    assert torch.equal(sample(x, *zero_p), greedy)


@pytest.mark.parametrize("v", [50, 1000])
def test_samples_stay_in_topk_topp(v, device):
    b = 24 if CPU else 96
    x = _logits(b, v, device, seed=5, scale=2.0)
    cfg = dict(temps=[0.5, 1.0, 1.7], ks=[0, 1, 7, 40], ps=[1.0, 0.9, 0.6, 0.2], min_ps=[0.0, 0.0, 0.1, 0.3, 0.02])
    allowed = []
    for i in range(b):
        t, k, p, mp = cfg["temps"][i % 3], cfg["ks"][i % 4], cfg["ps"][i % 4], cfg["min_ps"][i % 5]
        allowed.append(ref_dist(x[i].cpu(), t, k, p + 1e-6, mp * (1 - 1e-6)) > 0)  # slack for FP ties at the edge
    allowed = torch.stack(allowed)
    for off in range(2 if CPU else 8):
        got = sample(x, *_params(b, device, **cfg, off=off)).cpu()
        assert allowed[torch.arange(b), got].all(), f"offset {off}: sample outside the kept set"


SETTINGS = [(0.7, 5, 0.9, 0.0), (0.9, 7, 0.8, 0.03), (1.0, 0, 1.0, 0.0), (1.3, 0, 0.75, 0.0), (0.6, 0, 0.95, 0.0),
            (1.0, 0, 1.0, 0.08)]


# the interpreter takes ~15 s for 20 000 draws: CPU runs the kernel on two settings (sample_ref, equal to it token
# for token, on all); the GPU pass runs the kernel on all
@pytest.mark.parametrize("sampler,t,k,p,mp", [("kernel", *c) for c in (SETTINGS if FULL_SHAPES else SETTINGS[:2])]
                         + [("ref", *c) for c in SETTINGS])
def test_distribution_matches(sampler, t, k, p, mp, device):
    """20 000 draws of one row at 20 000 positions: chi-square against ref_dist (fixed seeds: deterministic)."""
    if sampler == "ref":
        device = "cpu"
    v, n = 12, 20000
    row = _logits(1, v, device, seed=6, scale=1.5)[0]
    want = ref_dist(row.cpu(), t, k, p, mp)
    x = row.expand(n, v)
    prm = _params(n, device, [t], [k], [p], seed0=1000, min_ps=[mp])
    prm[4].copy_(torch.arange(n, device=device) * 3 + 5)  # positions
    got = (sample if sampler == "kernel" else sample_ref)(x, *prm).cpu()
    counts = torch.bincount(got, minlength=v).double()
    assert counts[want == 0].sum() == 0
    exp = want[want > 0] * n
    chi2 = (((counts[want > 0] - exp) ** 2) / exp).sum().item()
    df = int((want > 0).sum()) - 1
    assert chi2 < df + 6 * (2 * df) ** 0.5 + 10, f"chi2 {chi2:.1f} with {df} dof"  # ~6 sigma


@pytest.mark.parametrize("b,v,dtype", [(37, 300, torch.float32), (5, 4097, torch.bfloat16), (9, 64, torch.float32)]
                         + ([(8, VOCAB, torch.bfloat16)] if FULL_SHAPES else [(2, VOCAB, torch.bfloat16)]))
def test_kernel_equals_reference_token_for_token(b, v, dtype, device):
    """Every row, every setting: the kernel's token is sample_ref's (same kept set, same random bits), written
    into a poisoned buffer whose other slots stay untouched; 64-bit seeds and positions past 2^32."""
    x = _logits(b, v, device, seed=9, dtype=dtype, scale=2.0)
    t, k, p, s, o, mp = _params(b, device, [0.0, 0.7, 1.0, 1.3], [0, 5, 40, 0, 1], [1.0, 0.9, 0.5, 0.95],
                                min_ps=[0.0, 0.05, 0.0])
    s = s * 7919 + 2**40
    o = torch.arange(b, device=device) + 2**33
    buf = torch.full((b + 3,), -7, dtype=torch.int64, device=device)
    got = sample(x, t, k, p, s, o, mp, out=buf[1:b + 1])
    assert got.data_ptr() == buf[1:].data_ptr()
    assert buf[0].item() == -7 and (buf[b + 1:] == -7).all()
    want = sample_ref(x.cpu(), t.cpu(), k.cpu(), p.cpu(), s.cpu(), o.cpu(), mp.cpu())
    assert torch.equal(got.cpu(), want)


def test_reference_distribution_helper_matches_the_tests_own():
    g = torch.Generator().manual_seed(2)
    for t, k, p, mp in [(1.0, 0, 1.0, 0.0), (0.7, 3, 0.9, 0.0), (1.3, 0, 0.6, 0.1), (0.5, 50, 0.95, 0.01)]:
        row = torch.randn(40, generator=g) * 2
        assert torch.allclose(filtered_probs_ref(row, t, k, p, mp), ref_dist(row, t, k, p, mp), atol=1e-12)


def test_same_seed_offset_same_token_whatever_the_batch(small_chunks, device):
    v = 200
    x = _logits(8, v, device, seed=7, scale=1.0)
    t, k, p, s, o, _ = _params(8, device, [1.0, 0.9, 0.0, 1.2], [0, 50, 0, 10], [1.0, 0.95, 1.0, 0.8], off=11)
    full = sample(x, t, k, p, s, o)
    for i in (0, 3, 5):
        alone = sample(x[i:i + 1], t[i:i + 1], k[i:i + 1], p[i:i + 1], s[i:i + 1], o[i:i + 1])
        assert alone.item() == full[i].item()
    perm = torch.tensor([5, 1, 7, 0, 3, 2, 6, 4], device=device)
    shuffled = sample(x[perm], t[perm], k[perm], p[perm], s[perm], o[perm])
    assert torch.equal(shuffled, full[perm])
    assert torch.equal(sample(x, t, k, p, s, o), full)
    # the offset is part of the key: a flat distribution must not repeat one token
    flat = torch.zeros(1, v, device=device)
    draws = {sample(flat, *_params(1, device, [1.0], [0], [1.0], seed0=3, off=j)).item() for j in range(12)}
    assert len(draws) > 6


def test_full_vocab_sample(device):
    x = _logits(2, VOCAB, device, seed=8)
    t, k, p, s, o, _ = _params(2, device, [1.0], [0, 20], [0.9, 1.0])
    got = sample(x, t, k, p, s, o)
    for i in range(2):
        assert ref_dist(x[i].cpu(), 1.0, int(k[i]), float(p[i]) + 1e-6)[got[i].item()] > 0


def test_sampling_kernels_compile_for_sm90_without_spills():
    """The interpreter cannot catch compile errors: compile the sampler's and the logprobs' kernels for sm_90a
    (ptxas included)."""
    from conftest import run_aot
    rows = run_aot("import json; from peregrine.bench import kernels_sampling as b; print(json.dumps(b.compile_check()))")
    assert len(rows) == 14  # threshold, race, race_stage2 x 2; chunk_max, collect, select; descend x 3; logprobs x 2
    for row in rows:
        assert "error" not in row, row
        assert row["spill"] == 0 and 0 < row["regs"] <= 255, row


def _key_ref(v):
    """float32 -> int32 keys in float order (the kernel's _key), written here from the IEEE layout."""
    bits = v.float().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _keeps_reference_set(x, t, k, p, mp, key, where):
    """The row's threshold key keeps exactly ref_dist's set (FP64, by sorting); FP32 sums may move a nucleus
    boundary by its one token only where the reference's mass before that token is within 1e-6 of top_p."""
    want = ref_dist(x, t, k, p, mp) > 0
    got = _key_ref(x / t) >= key
    if not torch.equal(got, want):
        q = torch.softmax(x.double() / t, -1)
        (j,) = torch.nonzero(got ^ want)[:, 0].tolist()  # one token only, at the boundary
        before = q[q > q[j]].sum() / q[got | want].sum()
        assert abs(before - p) < 1e-6, (where, float(before))


def _search_rows():
    """Rows every threshold search must get right: peaked heads, top-k, min-p, a nucleus in the tail, a flat row."""
    b, v = 10, 5000  # > SMALL_VOCAB: one row a program, two vocab chunks
    g = torch.Generator().manual_seed(11)
    x = torch.randn(b, v, generator=g) * 2 - 40
    x[:, :60] += 40 + torch.randn(b, 60, generator=g) * 3  # a peaked head of 60 tokens, the rest far below
    x[8] = torch.randn(v, generator=g) * 0.5  # flat: every token a candidate, the chunks overflow
    t = torch.tensor([0.7, 1.0, 0.6, 1.3, 0.9, 1.0, 1.0, 0.8, 1.0, 0.0])
    k = torch.tensor([0, 40, 0, 5, 100, 0, 0, 20, 0, 0])  # row 4: the 100th token is below the cut
    p = torch.tensor([0.95, 1.0, 0.9, 0.8, 1.0, 1.0, 0.999999, 0.95, 0.9, 1.0])  # row 6: the nucleus in the tail
    mp = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0])
    return x, t, k, p, mp


@pytest.mark.parametrize("search", ["candidates", "radix", "bisect"])
def test_threshold_searches_keep_the_reference_set(search, device):
    """Each search's threshold key keeps exactly the reference's set (ref_dist > 0, FP64, by sorting): rows the
    candidates settle (peaked heads) and rows they hand to the whole-row descent (a chunk over CAND_CAP
    candidates, a k-th token or nucleus below the cut, min-p below the cut). FP32 sums may move a nucleus
    boundary by its one token only where the reference's mass before that token is within 1e-6 of top_p."""
    x, t, k, p, mp = _search_rows()
    b = x.shape[0]
    dev = lambda z: z.to(device)  # noqa: E731
    keys, need = thresholds(dev(x), dev(t), dev(k), dev(p), dev(mp), 1, search)
    keys = keys.cpu()
    assert (need is None) == (search != "candidates")
    for i in range(b - 1):  # row 9 is greedy: no threshold
        _keeps_reference_set(x[i], float(t[i]), int(k[i]), float(p[i]), float(mp[i]), keys[i], (search, i))
    if search == "candidates":
        need = need.cpu().tolist()
        assert need[0] == need[2] == need[3] == need[7] == 0, need  # peaked rows settle on their candidates
        assert need[4] == 1 and need[8] == 1, need  # the 100th token below the cut; overflowing chunks
        assert 60 < CAND_CAP * 2  # (the peaked rows fit: 60 candidates in two chunks)


@pytest.mark.parametrize("nb", [8, 64])
def test_descent_at_other_pivot_counts_keeps_the_reference_set(nb, device):
    """The descent at other pivots a level than the default (more or fewer levels; on the GPU each step a tile
    4096 / nb wide; kernels_sampling times them) keeps the reference's set on every row."""
    x, t, k, p, mp = _search_rows()
    dev = lambda z: z.to(device)  # noqa: E731
    keys, _ = thresholds(dev(x), dev(t), dev(k), dev(p), dev(mp), 1, "radix", nb=nb)
    for i in range(x.shape[0] - 1):  # the last row is greedy
        _keeps_reference_set(x[i], float(t[i]), int(k[i]), float(p[i]), float(mp[i]), keys.cpu()[i], (nb, i))


# the interpreter also reduces masked-off lanes (-inf - -inf in a 5 000 row's last slice); their results are unused
@pytest.mark.filterwarnings("ignore:invalid value encountered in reduce:RuntimeWarning")
def test_searches_draw_the_same_tokens(device):
    """The draw after each search: the same tokens (no row here has a boundary within FP32 rounding)."""
    x = _logits(6, 5000, device, seed=3, scale=2.0)
    t, k, p, mp = (torch.tensor(z, device=device) for z in ([0.7, 1.0, 0.0, 1.2, 0.9, 0.6], [0, 40, 0, 7, 0, 300],
                                                             [0.95, 0.9, 1.0, 1.0, 0.5, 0.99],
                                                             [0.0, 0.0, 0.0, 0.02, 0.0, 0.0]))
    seeds, pos = torch.arange(6, device=device), torch.full((6,), 7, device=device)
    got = {s: sample(x, t, k, p, seeds, pos, mp, search=s) for s in ("candidates", "radix", "bisect")}
    assert torch.equal(got["candidates"], got["bisect"]) and torch.equal(got["radix"], got["bisect"])
    assert torch.equal(got["radix"].cpu(), sample_ref(x.cpu(), t.cpu(), k.cpu(), p.cpu(), seeds.cpu(), pos.cpu(),
                                                      mp.cpu()))


@pytest.mark.parametrize("block", [512, 1024, 4096])
# the interpreter also reduces masked-off lanes (-inf - -inf in a 5 000 row's last slice); their results are unused
@pytest.mark.filterwarnings("ignore:invalid value encountered in reduce:RuntimeWarning")
def test_descent_without_top_k_levels_keeps_the_reference_set(block, device, monkeypatch):
    """Rows without top-k, searched by the descent that launches no top-k levels (top_k_any=False: top-p's first
    level starts from min-p's bound, or from the bottom key) keep the reference's set (FP64, by sorting), however
    much of the row one program weighs (512: 10 slices of the row, whose partials every pick sums; 4096: two),
    and draw the reference's tokens."""
    monkeypatch.setenv(sampling.DESCENT_BLOCK_ENV, str(block))
    b, v = 6, 5000
    g = torch.Generator().manual_seed(5)
    x = torch.randn(b, v, generator=g) * 1.5  # flat rows: wide nuclei, as dummy weights give
    t = torch.tensor([0.6, 1.0, 0.8, 1.0, 1.3, 0.0])
    p = torch.tensor([0.95, 1.0, 0.5, 1.0, 0.99, 1.0])  # row 1: temperature only; row 3: min-p alone
    mp = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.05, 0.0])
    k = torch.zeros(b, dtype=torch.int64)
    dev = lambda z: z.to(device)  # noqa: E731
    keys, _ = thresholds(dev(x), dev(t), dev(k), dev(p), dev(mp), 1, "radix", top_k_any=False)
    keys = keys.cpu()
    for i in range(b - 1):  # row 5 is greedy
        _keeps_reference_set(x[i], float(t[i]), 0, float(p[i]), float(mp[i]), keys[i], (block, i))
    seeds, pos = torch.arange(b) * 31, torch.full((b,), 9)
    for search in ("radix", "candidates"):
        got = sample(dev(x), dev(t), dev(k), dev(p), dev(seeds), dev(pos), dev(mp), search=search, top_k_any=False)
        assert torch.equal(got.cpu(), sample_ref(x, t, k, p, seeds, pos, mp)), search


def test_descent_block_fills_the_gpu_at_small_batch():
    """The slice a descent program weighs: 1024 (160 programs a row) at B = 1, growing with B while B x slices stay
    >= DESCENT_PROGRAMS, never past BLOCK_V; the override is rounded to a power of two."""
    V = 163840
    blocks = {B: sampling.descent_block(B, V) for B in (1, 2, 4, 8, 16)}
    assert blocks[1] == sampling.DESCENT_MIN_BLOCK and all(x <= sampling.BLOCK_V for x in blocks.values())
    assert all(blocks[a] <= blocks[b] for a, b in ((1, 2), (2, 4), (4, 8), (8, 16)))
    for B, blk in blocks.items():
        n = B * -(-V // blk)
        assert n >= sampling.DESCENT_PROGRAMS or blk == sampling.DESCENT_MIN_BLOCK, (B, blk, n)
        assert blk == sampling.BLOCK_V or B * -(-V // (2 * blk)) < sampling.DESCENT_PROGRAMS, (B, blk)


@pytest.mark.parametrize("nb", [4, 64])
def test_descent_levels_reach_one_key(nb):
    """The descent's level count narrows any bracket of the 2^32 keys to one key, nb-fold a level, and no fewer
    would (the count is written here from 32 / log2(nb) bits, rounded up)."""
    import math
    assert sampling.descent_levels(nb) == math.ceil(32 / math.log2(nb))


def test_search_env_is_checked(monkeypatch):
    from peregrine.kernels.sampling import SEARCH_ENV, search_mode
    for mode in ("bisect", "radix", "candidates"):
        monkeypatch.setenv(SEARCH_ENV, mode)
        assert search_mode() == mode
    monkeypatch.setenv(SEARCH_ENV, "sorted")
    with pytest.raises(ValueError, match=SEARCH_ENV):
        search_mode()
