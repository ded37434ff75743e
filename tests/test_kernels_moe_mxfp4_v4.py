"""MXFP4 experts v4 (kernels/moe_mxfp4_v4.py) over the load-time repack (kernels/mxfp4_repack.py): the repack's
round trip, DECODE_ASM emulated instruction by instruction for every code in every slot under every scale, the
portable form (interpreter) and the Gluon kernels (Hopper) against the FP32 dequantize-then-matmul reference, and
an ahead-of-time sm_90a compile that shows the design's instructions (wgmma from two shared-memory descriptors,
16-byte shared stores of the decoded tile, cp.async copies, no spills)."""
import re

import pytest
import torch

from conftest import DEVICE, run_aot
from peregrine.kernels import available
from peregrine.kernels import mxfp4_format as fmt
from peregrine.kernels import mxfp4_repack as rp
from peregrine.testing import SENTINEL, rel_rmse
from test_kernels_moe_mxfp4 import e2m1, experts, one_hot_w2, routing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not available(DEVICE), reason="triton kernels unavailable")]

if available(DEVICE):
    from peregrine.kernels import moe_mxfp4_v4 as v4
    from peregrine.kernels.moe_mxfp4 import moe_mxfp4_experts_ref

HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9
PAD = 5  # sentinel columns right of the output


def test_repack_round_trip_every_byte():
    """repack -> unpack gives the checkpoint's bytes back, for every byte value in every position of a word."""
    g = torch.Generator().manual_seed(1)
    q = torch.stack([torch.roll(torch.arange(256, dtype=torch.uint8), 3 * r) for r in range(8)])  # [8, 256]
    q = torch.cat([q, torch.randint(0, 256, (8, 64), generator=g, dtype=torch.int32).to(torch.uint8)], 1)
    s = torch.randint(0, 256, (8, q.shape[1] * 2 // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    rq, rs = rp.repack(q[None], s[None])
    assert rq.shape == q[None].shape and rs.shape == (1, s.shape[1], 8) and rs.is_contiguous()
    uq, us = rp.unpack(rq, rs)
    assert torch.equal(uq[0], q) and torch.equal(us[0], s)
    assert not torch.equal(rq[0], q)  # it does move nibbles


def test_repacked_word_holds_element_pairs_16_bits_apart():
    """The layout the decode relies on, read from the repacked bytes with the checkpoint's element values:
    element 2j at bits 4j..4j+3 and element 2j+1 at bits 16+4j.. of each little-endian word."""
    q = torch.randint(0, 256, (3, 40), dtype=torch.int32).to(torch.uint8)
    codes = fmt.unpack_codes(q)                                       # [3, 80] element order
    words = rp.repack_codes(q).view(torch.int32)                      # [3, 10]
    for j in range(4):
        assert torch.equal((words >> (4 * j)) & 0xF, codes[:, 2 * j::8].int())
        assert torch.equal((words >> (16 + 4 * j)) & 0xF, codes[:, 2 * j + 1::8].int())


# ---- DECODE_ASM, executed by a small emulator of the five PTX instructions it uses
def _bf16_bits_to_float(b: torch.Tensor) -> torch.Tensor:
    return (b.to(torch.int32) << 16).view(torch.float32)


def _float_to_bf16_bits(f: torch.Tensor) -> torch.Tensor:
    return f.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF


def run_decode_asm(asm: str, word: torch.Tensor, scale2: torch.Tensor) -> list[torch.Tensor]:
    """Execute DECODE_ASM on int64 tensors holding 32-bit values ($4 = word, $5 = scale pair); returns $0..$3."""
    regs = {"$4": word & 0xFFFFFFFF, "$5": scale2 & 0xFFFFFFFF}
    val = lambda o: regs[o] if o in regs else torch.full_like(word, int(o, 0))  # noqa: E731

    def bf16x2_mul(a, b):
        out = 0
        for sh in (0, 16):
            x = _bf16_bits_to_float((a >> sh) & 0xFFFF) * _bf16_bits_to_float((b >> sh) & 0xFFFF)  # exact in FP32
            out = out | (_float_to_bf16_bits(x).to(torch.int64) << sh)                             # RNE to BF16
        return out
    ops = {"shr.b32": lambda a, b: a >> b, "and.b32": lambda a, b: a & b,
           "mul.lo.u32": lambda a, b: (a * b) & 0xFFFFFFFF, "mul.rn.bf16x2": bf16x2_mul}
    for line in asm.strip("{}\n").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        if op == "mov.b32":
            regs[a[0]] = val(a[1])
        else:
            assert op in ops, f"unemulated instruction {op}"
            regs[a[0]] = ops[op](val(a[1]), val(a[2]) if a[2] in regs else (int(a[2], 0) if a[2][0].isdigit() else val(a[2])))
    return [regs[f"${j}"] for j in range(4)]


def test_decode_asm_every_code_every_slot_every_scale():
    """Every E2M1 code in every nibble slot of a word (the other slots random), under all 256 E8M0 scales: each
    output lane is the code's value times 2^(s-127) exactly in BF16 (infinite past the FP32 range), NaN for 255, 0
    for 0 (v3's convention)."""
    g = torch.Generator().manual_seed(5)
    code = torch.arange(16).repeat_interleave(8)                     # [128]: code c in slot p
    slot = torch.arange(8).repeat(16)
    rnd = torch.randint(0, 2 ** 31, (128,), generator=g, dtype=torch.int64)
    word = (rnd & ~(0xF << (4 * slot))) | (code << (4 * slot))
    scale = torch.arange(256)
    sbits = torch.where(scale == 255, 0x7FC0, scale << 7)            # as _decode_half builds it
    W, S = word[:, None].expand(128, 256), (sbits | (sbits << 16))[None, :].expand(128, 256)
    outs = run_decode_asm(v4.DECODE_ASM, W.reshape(-1), S.reshape(-1))
    lut = torch.tensor([e2m1(c) for c in range(16)], dtype=torch.float64)
    want = lut[code][:, None] * torch.pow(2.0, scale.double() - 127)[None, :]
    want = torch.where(scale[None, :] == 0, 0.0 * want, want)
    want = torch.where(scale[None, :] == 255, float("nan"), want).float().double()  # past 2^128: inf, as FP32
    j, lane = slot % 4, slot // 4                                     # slot p holds element 2(p%4) + p//4
    got = torch.stack([((outs[int(jj)].view(128, 256)[i] >> (16 * int(ll))) & 0xFFFF)
                       for i, (jj, ll) in enumerate(zip(j, lane))])
    gotf = _bf16_bits_to_float(got).double()
    assert torch.equal(gotf.isnan(), want.isnan())
    assert torch.equal(gotf.nan_to_num(), want.nan_to_num())


def test_folded_decode_asm_every_code_every_slot_and_foldable_scale():
    """DECODE_ASM_FOLDED with the scale register 2^(s-1) (what _decode builds under FOLD): exact for every code in
    every slot and every scale fold_scales admits (0..128, and the NaN code), as the unfolded decode."""
    g = torch.Generator().manual_seed(6)
    code = torch.arange(16).repeat_interleave(8)
    slot = torch.arange(8).repeat(16)
    rnd = torch.randint(0, 2 ** 31, (128,), generator=g, dtype=torch.int64)
    word = (rnd & ~(0xF << (4 * slot))) | (code << (4 * slot))
    scale = torch.cat([torch.arange(v4.FOLD_MAX_SCALE + 1), torch.tensor([255])])
    sbits = torch.where(scale == 255, 0x7FC0, torch.where(scale == 0, 0, (scale + 126) << 7))
    n = len(scale)
    W, S = word[:, None].expand(128, n), (sbits | (sbits << 16))[None, :].expand(128, n)
    outs = run_decode_asm(v4.DECODE_ASM_FOLDED, W.reshape(-1), S.reshape(-1))
    lut = torch.tensor([e2m1(c) for c in range(16)], dtype=torch.float64)
    want = lut[code][:, None] * torch.pow(2.0, scale.double() - 127)[None, :]
    want = torch.where(scale[None, :] == 0, 0.0 * want, want)
    want = torch.where(scale[None, :] == 255, float("nan"), want)
    j, lane = slot % 4, slot // 4
    got = torch.stack([((outs[int(jj)].view(128, n)[i] >> (16 * int(ll))) & 0xFFFF)
                       for i, (jj, ll) in enumerate(zip(j, lane))])
    gotf = _bf16_bits_to_float(got).double()
    assert torch.equal(gotf.isnan(), want.isnan())
    assert torch.equal(gotf.nan_to_num(), want.nan_to_num())
    assert v4.fold_scales(torch.tensor([0, 128, 255], dtype=torch.uint8))
    assert not v4.fold_scales(torch.tensor([0, 129], dtype=torch.uint8))


# ---- the kernels against the FP32 reference
CASES = [  # B, E, k, I, Dz, activation, x dtype, all tokens share experts
    (1, 4, 2, 64, 64, "situ", torch.float32, False),
    (3, 6, 3, 96, 160, "swiglu", torch.float32, False),   # 3 / 5 scale groups, rows not a multiple of a tile
    (5, 8, 4, 64, 128, "situ", torch.bfloat16, True),
    (16, 8, 2, 128, 64, "swiglu", torch.bfloat16, False),
]
GPU_CASES = [  # whole K steps (64 values), up to 64 tokens
    (1, 8, 4, 128, 192, "situ", torch.bfloat16, False),
    (3, 8, 3, 192, 256, "swiglu", torch.bfloat16, False),
    (8, 16, 4, 256, 128, "situ", torch.bfloat16, True),
    (64, 12, 4, 128, 256, "situ", torch.bfloat16, False),
    (37, 6, 2, 64, 320, "swiglu", torch.bfloat16, False),
]


def _run(B, E, k, I, Dz, act, xdt, shared, config=None, fold=False):
    g = torch.Generator().manual_seed(B * 131 + I + Dz)
    q13, s13, q2, s2 = experts(E, I, Dz, g)
    ids, w = routing(B, E, k, g, shared)
    x = torch.randn(B, Dz, generator=g).to(xdt)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    ref = moe_mxfp4_experts_ref(dev(x), *map(dev, (q13, s13, q2, s2, ids, w)), act)
    packed = [dev(t) for t in (*rp.repack(q13, s13), *rp.repack(q2, s2))]
    buf = torch.full((B, Dz + PAD), SENTINEL, dtype=xdt, device=DEVICE)
    buf[:, :Dz] = float("nan")  # poisoned: every output element must be written
    assert not fold or v4.fold_scales(s13, s2)
    y = v4.moe_mxfp4_experts_v4(dev(x), *packed, dev(ids), dev(w), activation=act, out=buf[:, :Dz], config=config,
                                fold=fold)
    assert (buf[:, Dz:].cpu() == SENTINEL).all(), "wrote past the output columns"
    return y, ref


@pytest.mark.parametrize("B,E,k,I,Dz,act,xdt,shared", CASES)
def test_portable_matches_reference(B, E, k, I, Dz, act, xdt, shared):
    if HOPPER and xdt == torch.bfloat16:
        pytest.skip("BF16 on Hopper runs the Gluon kernels (test_gluon_matches_reference)")
    y, ref = _run(B, E, k, I, Dz, act, xdt, shared)
    assert rel_rmse(y, ref) < (1e-5 if xdt == torch.float32 else 2e-2)


def test_portable_down_every_byte_every_position_and_scale():
    """One-hot activations read W2 back through the portable down kernel: every byte value in every byte position
    of a word, scales 2^-20 .. 2^20, E8M0 0 (reads as 0) and a NaN group; exact."""
    packed, s2, h, want = one_hot_w2(roll=5, nan_row=9)
    B, Dz = h.shape[0], packed.shape[0]
    q, st = rp.repack(packed[None].contiguous(), s2[None].contiguous())
    ids = torch.zeros(B, 1, dtype=torch.int32)
    part = torch.full((B, 1, Dz), float("nan"), device=DEVICE)
    meta = dict(TOP_K=1, T_PAD=B, K_PAD=1, N_PAD=B, BLOCK_R=v4.PORTABLE_BLOCK_R)
    v4._portable_kernel[(B, triton_cdiv(Dz, v4.PORTABLE_BLOCK_R))](
        h.to(DEVICE), q.to(DEVICE), st.to(DEVICE), ids.to(DEVICE), part, B, Dz, h.shape[2] // 32, Dz, 0, h.shape[2],
        GATHER_SLOT=True, **meta)
    got = part[:, 0].cpu().double()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def triton_cdiv(a, b):
    return -(-a // b)


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("config,fold", [(None, False), (None, True), ({"BK": 64, "STAGES": 6}, True),
                                         ({"BK": 128, "STAGES": 4}, True), ({"BLOCK_D": 64}, True),
                                         ({"BLOCK_I": 128, "BLOCK_D": 256, "WARPS": 8, "STAGES": 4}, True)])
@pytest.mark.parametrize("B,E,k,I,Dz,act,xdt,shared", GPU_CASES)
def test_gluon_matches_reference(B, E, k, I, Dz, act, xdt, shared, config, fold):
    x = torch.zeros(B, Dz, dtype=xdt, device=DEVICE)
    if not v4.supports(x, Dz, I, B, config):
        pytest.skip("widths not in whole K steps of this config")
    y, ref = _run(B, E, k, I, Dz, act, xdt, shared, config, fold)
    assert rel_rmse(y, ref) < 2e-2


def test_one_warpgroup_refuses_a_gate_up_tile_it_cannot_split():
    """BLOCK_I 32 on 4 warps failed to compile on the H100 (one value a thread for the gate / up split): it is a
    clear error, and each B's default config is one that compiles."""
    with pytest.raises(ValueError, match="BLOCK_I=32 with one warpgroup"):
        v4._config({"BLOCK_I": 32, "BLOCK_D": 64}, 4)
    for B in (1, 2, 8, 16):
        c = v4._config(None, B)
        assert c["WARPS"] == 8 or c["BLOCK_I"] >= v4.MIN_BLOCK_I


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels need a Hopper GPU")
def test_gluon_down_every_byte_every_position_and_scale():
    """The one-hot read-back through the Gluon down kernel (BF16 h holds the one-hot rows exactly)."""
    packed, s2, h, want = one_hot_w2(roll=5, nan_row=9)
    B, Dz = h.shape[0], packed.shape[0]
    q, st = rp.repack(packed[None].contiguous(), s2[None].contiguous())
    ids = torch.zeros(B, 1, dtype=torch.int32, device=DEVICE)
    part = torch.full((B, 1, Dz), float("nan"), device=DEVICE)
    v4.launch_down(h.to(DEVICE, torch.bfloat16), q.to(DEVICE), st.to(DEVICE), ids, part, {"BLOCK_D": 64})
    got = part[:, 0].cpu().double()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernels need a Hopper GPU")
def test_gluon_batch_invariant_and_repeatable():
    g = torch.Generator().manual_seed(7)
    E, I, Dz, k = 8, 128, 192, 3
    q13, s13, q2, s2 = experts(E, I, Dz, g)
    w4 = [t.to(DEVICE) for t in (*rp.repack(q13, s13), *rp.repack(q2, s2))]
    ids, w = (t.to(DEVICE) for t in routing(4, E, k, g))
    x = torch.randn(4, Dz, generator=g).to(DEVICE, torch.bfloat16)
    full = v4.moe_mxfp4_experts_v4(x, *w4, ids, w, activation="situ")
    again = v4.moe_mxfp4_experts_v4(x, *w4, ids, w, activation="situ")
    alone = v4.moe_mxfp4_experts_v4(x[2:3], *w4, ids[2:3].contiguous(), w[2:3], activation="situ")
    assert torch.equal(full, again) and torch.equal(full[2:3], alone)


AOT_SCRIPT = r"""
import inspect, json, os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from peregrine.kernels import moe_mxfp4_v4 as v4
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
res = {}
for up, B, fold in ((True, 1, False), (True, 64, False), (False, 1, False), (False, 64, False), (True, 1, True),
                    (False, 8, True)):
    c = v4._config(None, B)
    ce = dict(v4._common(c, B, 16, fold), HM=c["BLOCK_I"] if up else c["BLOCK_D"], HALVES=2 if up else 1, UP=up,
              ACT=1 if up else 0)
    ptr = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*u8", "ids_ptr": "*i32", "out_ptr": "*bf16" if up else "*fp32"}
    names = list(inspect.signature(v4._mx4_kernel.fn).parameters)
    sig = {n: "constexpr" if n in ce else ptr.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")
             or n in ("R", "KG", "N_OUT", "x_row_stride")}
    k = triton.compile(GluonASTSource(v4._mx4_kernel, sig, ce, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": c["WARPS"]})
    ptx = k.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True).stderr
    res[f"{'up' if up else 'down'}-B{B}{'-fold' if fold else ''}"] = {
        "wgmma_ss": len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd\d+, %rd\d+", ptx)),
        "wgmma_rs": len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16 \{[^}]*\}, \{", ptx)),
        "st_shared_v4": len(re.findall(r"st\.shared\.v4\.b32", ptx)),
        "st_shared_16bit": len(re.findall(r"st\.shared(\.v\d)?\.b16", ptx)),
        "cp_async_16": len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)),
        "spills": int(re.search(r"(\d+) bytes spill stores", info).group(1)),
        "wgmma_serialized": "C7515" in info}
print(json.dumps(res))
"""


def test_gluon_kernels_compile_for_sm90_with_the_designed_instructions():
    """Ahead of time for sm_90a (no GPU): wgmma reads both operands from shared-memory descriptors (none from
    registers) and ptxas keeps them asynchronous (no C7515 serialization: a branch around the ring's copies caused
    it), the decoded tile goes out in 16-byte stores (no 2-byte ones), codes and activations arrive by 16-byte
    cp.async, and nothing spills; for up and down, at 1 and 64 tokens, and with the folded scale."""
    res = run_aot(AOT_SCRIPT)
    assert set(res) == {"up-B1", "up-B64", "down-B1", "down-B64", "up-B1-fold", "down-B8-fold"}
    for name, r in res.items():
        assert r["wgmma_ss"] > 0 and r["wgmma_rs"] == 0, (name, r)
        assert r["st_shared_v4"] >= 4 and r["st_shared_16bit"] == 0, (name, r)
        assert r["cp_async_16"] > 0 and r["spills"] == 0, (name, r)
        assert not r["wgmma_serialized"], (name, r)  # ptxas would wait after every wgmma (its warning C7515)
