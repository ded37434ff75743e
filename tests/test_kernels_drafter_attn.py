"""kernels/drafter_attn.py: the drafter block's attention over its paged context against an FP64 reference over
the gathered context (real and odd shapes, one to many splits, empty and one-token contexts), NaN in every slot
and table entry the sequences do not own, the paged buffer left untouched; and the sm_90a compile."""
import pytest
import torch

from conftest import FULL_SHAPES
from peregrine.kernels.drafter_attn import block_attention, block_attention_ref, splits_for

pytestmark = pytest.mark.gpu

# (B, Bk, kv heads, g, hd, block size, lens): the shipped tiny drafter; odd lengths; the 48B drafter's heads
CASES = [(2, 8, 2, 2, 64, 16, [37, 1]), (3, 5, 1, 3, 32, 4, [0, 70, 9]), (1, 16, 8, 4, 128, 16, [300])]
if FULL_SHAPES:
    CASES += [(8, 16, 8, 4, 128, 16, [4096, 1, 33, 2048, 17, 999, 64, 5000])]


def _case(B, Bk, KVH, G, HD, bs, lens, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    layers = 2
    need = [-(-n // bs) for n in lens]
    nblocks = sum(need) + 3
    kv = torch.full((layers, 2, nblocks * bs, KVH, HD), float("nan"))  # every slot no sequence owns stays NaN
    perm = torch.randperm(nblocks, generator=g).tolist()
    width = max(need + [1]) + 2
    tables = torch.full((B, width), nblocks - 1, dtype=torch.long)  # padding points at a NaN block...
    free = perm[-1]
    perm = [p for p in perm if p != nblocks - 1 and p != free]
    i = 0
    for b, n in enumerate(lens):
        blocks = perm[i:i + need[b]]
        i += need[b]
        tables[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        for p in range(n):
            s = blocks[p // bs] * bs + p % bs
            kv[:, :, s] = torch.randn(layers, 2, KVH, HD, generator=g)
    # ... and a fed block's tail past the length holds NaN too: the kernel must stop at the length
    q = torch.randn(B, Bk, KVH, G, HD, generator=g)
    k_own, v_own = torch.randn(B, Bk, KVH, HD, generator=g), torch.randn(B, Bk, KVH, HD, generator=g)
    t = lambda x: x.to(device)  # noqa: E731
    return t(q), t(k_own), t(v_own), t(kv.to(dtype)), t(tables), t(torch.tensor(lens, dtype=torch.long))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-Bk{c[1]}-kvh{c[2]}-g{c[3]}-hd{c[4]}")
@pytest.mark.parametrize("splits", [1, 3, None])
def test_block_attention_equals_the_gathered_fp64_reference(case, splits, device):
    B, Bk, KVH, G, HD, bs, lens = case
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
        if dtype == torch.float32 and device == "cuda":
            tol = 5e-3  # tl.dot in TF32 on the GPU
        q, ko, vo, kv, tables, ln = _case(B, Bk, KVH, G, HD, bs, lens, dtype, device)
        before = kv.clone()
        for layer in (0, 1):
            got = block_attention(q, ko, vo, kv, layer, tables, ln, bs, splits=splits)
            want = block_attention_ref(q, ko, vo, kv, layer, tables, ln, bs)
            assert got.shape == (B, Bk, KVH, G, HD) and torch.isfinite(got).all()
            err = (got.double().cpu() - want).abs().max().item()
            assert err < tol, (dtype, layer, err)
        assert torch.equal(kv.isnan(), before.isnan()) and torch.equal(kv.nan_to_num(), before.nan_to_num())


def test_a_context_mask_off_by_one_would_fail(device):
    """The reference is sensitive to the length: one more context position changes the result (so a kernel
    reading one slot past the length could not pass the test above)."""
    B, Bk, KVH, G, HD, bs, lens = CASES[0]
    q, ko, vo, kv, tables, ln = _case(B, Bk, KVH, G, HD, bs, lens, torch.float32, device)
    kv = kv.nan_to_num()
    a = block_attention_ref(q, ko, vo, kv, 0, tables, ln, bs)
    b = block_attention_ref(q, ko, vo, kv, 0, tables, ln + 1, bs)
    assert (a - b).abs().max() > 1e-3


def test_splits_fill_the_gpu_within_the_cap():
    assert splits_for(1, 8) == 33 and splits_for(8, 8) == 5 and splits_for(1, 1) == 64 and splits_for(64, 8) == 1
    assert all(1 <= splits_for(b, h) <= 64 for b in range(1, 20) for h in (1, 2, 8))


def test_drafter_attention_compiles_for_sm90():
    """The interpreter cannot catch compile errors: the kernel compiled for sm_90a at the 48B drafter's heads and
    the tiny drafter's, BF16 keys, no spills."""
    from conftest import run_aot
    rows = run_aot("import json; from peregrine.kernels import drafter_attn as k; print(json.dumps(k.compile_check()))")
    assert len(rows) == 2
    for row in rows:
        assert "error" not in row, row
        assert row["spill"] == 0 and 0 < row["regs"] <= 255, row
    assert rows[0]["wgmma"] > 0  # the 48B's 64-row tile multiplies on the Hopper tensor cores
