"""MXFP4 expert kernels (kernels/moe_mxfp4.py's moe_mxfp4_experts, kernels/moe_mxfp4_v3.py's kernels) against the
FP32 reference over dequantized weights (kernels/mxfp4_format.py's table path, itself checked bit by bit in
test_k3.py), and the
register dequantization against an independent bit-field decode for every byte and many scales."""
import pytest
import torch

from conftest import DEVICE, FULL_SHAPES, run_aot
from peregrine.kernels import available
from peregrine.testing import SENTINEL, rel_rmse

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not available(DEVICE), reason="triton kernels unavailable")]

if available(DEVICE):
    from peregrine.kernels.moe_mxfp4 import moe_mxfp4_experts, moe_mxfp4_experts_ref, mxfp4_gemv

PAD = 5  # sentinel columns right of the output: must stay bit-identical


def e2m1(code: int) -> float:
    """Independent decode from the bit fields: sign | 2-bit exponent | 1-bit mantissa."""
    sign, e, m = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
    return sign * (0.5 * m if e == 0 else 2.0 ** (e - 1) * (1 + 0.5 * m))


def experts(E, I, Dz, g, lo=118, hi=126):
    u8 = lambda *s, a=0, b=256: torch.randint(a, b, s, generator=g, dtype=torch.int32).to(torch.uint8)  # noqa: E731
    return (u8(E, 2 * I, Dz // 2), u8(E, 2 * I, Dz // 32, a=lo, b=hi), u8(E, Dz, I // 2), u8(E, Dz, I // 32, a=lo, b=hi))


def routing(B, E, k, g, shared=False):
    if shared:  # every token picks the same experts: one weight read serves all of them
        ids = torch.randperm(E, generator=g)[:k].repeat(B, 1)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(B)])
    return ids.to(torch.int32), torch.rand(B, k, generator=g) + 0.1


CASES = [  # B, E, k, I, Dz, activation, x dtype, all tokens share experts
    (1, 4, 2, 32, 64, "situ", torch.float32, False),
    (3, 6, 3, 96, 96, "swiglu", torch.float32, False),   # 3 scale groups: partial last K block
    (5, 8, 4, 64, 32, "situ", torch.bfloat16, True),
    (8, 16, 4, 32, 64, "situ", torch.float32, False),
]
if FULL_SHAPES:  # K3's latent expert widths; 20 experts keep the reference's FP32 copies small
    CASES += [(1, 20, 16, 3072, 3584, "situ", torch.bfloat16, False), (8, 20, 16, 3072, 3584, "situ", torch.bfloat16, False),
              (16, 20, 8, 3072, 3584, "swiglu", torch.bfloat16, False)]


CASES_V3 = [  # v3 tiles at least 16 rows and 16 packed bytes: shapes below one tile and with partial tiles
    (2, 5, 2, 96, 160, "situ", torch.float32, False),     # 160 = 2.5 up-KB tiles of 64 bytes
    (16, 8, 2, 64, 64, "swiglu", torch.bfloat16, False),  # B = 16: every padded token is real
    (3, 6, 3, 128, 256, "situ", torch.float32, False),    # whole tiles at B <= 4's 32-byte steps: no masks
    (1, 4, 2, 64, 96, "swiglu", torch.bfloat16, True),    # 3 groups a row: a partial last step
]
# the decodes: the interpreter runs the portable one, the GPU all three
DECODES = ["plain"] + (["asm", "dot_scaled"] if DEVICE == "cuda" else [])
DECODE_CASES = [c + (d,) for c in CASES + CASES_V3 for d in DECODES]


@pytest.mark.parametrize("B,E,k,I,Dz,act,xdt,shared,decode", DECODE_CASES)
def test_experts_match_reference(B, E, k, I, Dz, act, xdt, shared, decode):
    g = torch.Generator().manual_seed(B * 131 + I + Dz)
    q13, s13, q2, s2 = (t.to(DEVICE) for t in experts(E, I, Dz, g))
    ids, w = (t.to(DEVICE) for t in routing(B, E, k, g, shared))
    x = torch.randn(B, Dz, generator=g).to(xdt).to(DEVICE)
    ref = moe_mxfp4_experts_ref(x, q13, s13, q2, s2, ids, w, act)
    buf = torch.full((B, Dz + PAD), SENTINEL, dtype=xdt, device=DEVICE)
    buf[:, :Dz] = float("nan")  # poisoned: every output element must be written
    y = moe_mxfp4_experts(x, q13, s13, q2, s2, ids, w, activation=act, out=buf[:, :Dz], config={"DECODE": decode})
    tol = 1e-5 if xdt == torch.float32 and DEVICE == "cpu" else 2e-2  # BF16 operands/outputs on the GPU
    assert rel_rmse(y, ref) < tol
    assert (buf[:, Dz:].cpu() == SENTINEL).all(), "wrote past the output columns"


@pytest.mark.parametrize("decode", DECODES)
def test_batch_invariant_and_repeatable(decode):
    """A token's output does not depend on the other tokens of the batch, and reruns are bitwise equal."""
    g = torch.Generator().manual_seed(7)
    E, I, Dz, k = 8, 32, 64, 3
    w4 = [t.to(DEVICE) for t in experts(E, I, Dz, g)]
    ids, w = routing(4, E, k, g)
    x = torch.randn(4, Dz, generator=g).to(DEVICE)
    ids, w = ids.to(DEVICE), w.to(DEVICE)
    kw = dict(config={"DECODE": decode})
    full = moe_mxfp4_experts(x, *w4, ids, w, activation="situ", **kw)
    again = moe_mxfp4_experts(x, *w4, ids, w, activation="situ", **kw)
    alone = moe_mxfp4_experts(x[2:3], *w4, ids[2:3].contiguous(), w[2:3], activation="situ", **kw)
    assert torch.equal(full, again) and torch.equal(full[2:3], alone)


def test_register_dequant_every_byte_and_scale():
    """One-hot activations read the weight matrix back column by column: every byte value, in both
    nibbles, under scales from 2^-20 to 2^20, must come out exactly as the bit-field decode says."""
    C = 512  # 256 packed bytes per row = every byte value once; 16 scale groups per row
    scales = torch.tensor([107, 112, 120, 126, 127, 128, 131, 140, 147], dtype=torch.uint8)
    R = len(scales)
    packed = torch.stack([torch.roll(torch.arange(256, dtype=torch.uint8), 17 * r) for r in range(R)])
    scale = scales[:, None].repeat(1, C // 32)
    lut = torch.tensor([e2m1(c) for c in range(16)], dtype=torch.float64)
    want = torch.empty(R, C, dtype=torch.float64)
    want[:, 0::2], want[:, 1::2] = lut[packed.long() & 15], lut[packed.long() >> 4]
    want *= torch.pow(2.0, scale.double() - 127).repeat_interleave(32, 1)
    cols = torch.arange(0, C, 7)  # a spread of columns (even and odd), one activation row each
    x = torch.zeros(len(cols), C)
    x[torch.arange(len(cols)), cols] = 1.0
    out = torch.full((len(cols), R), float("nan"), device=DEVICE)
    y = mxfp4_gemv(x.to(DEVICE), packed.to(DEVICE), scale.to(DEVICE), out=out).cpu().double()
    assert torch.equal(y, want[:, cols].T)


@pytest.mark.parametrize("decode", DECODES)
def test_nan_scale_poisons_only_its_group(decode):
    g = torch.Generator().manual_seed(3)
    q13, s13, q2, s2 = experts(2, 32, 64, g)
    s13[1, 5, 1] = 255  # E8M0 NaN in expert 1, gate row 5, second group
    x = torch.randn(2, 64, generator=g)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    ids = torch.tensor([[0], [1]], dtype=torch.int32)
    y = moe_mxfp4_experts(dev(x), dev(q13), dev(s13), dev(q2), dev(s2), dev(ids), dev(torch.ones(2, 1)),
                          config={"DECODE": decode})
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()  # gate row 5 feeds every W2 row


def one_hot_w2(roll: int, nan_row: int | None = None):
    """A W2 [Dz = 64, I = 512] whose rows hold every byte value once (rolled by `roll` per row, so each
    value sits in every byte position of a word), scales 2^-20 .. 2^20 and E8M0 0 (reads as 0), optionally
    an E8M0 NaN group in row nan_row; 16 one-hot activation rows h [16, 1, I] (every position of a word,
    many groups). Returns packed [Dz, 256], scales [Dz, 16], h, and the exact want [16, Dz] (FP64)."""
    Dz, I = 64, 512
    packed = torch.stack([torch.roll(torch.arange(256, dtype=torch.uint8), roll * r) for r in range(Dz)])
    scales = torch.tensor([107, 118, 126, 127, 128, 140, 147, 0], dtype=torch.uint8)
    s2 = scales[(torch.arange(Dz)[:, None] + torch.arange(I // 32)[None, :]) % len(scales)]
    lut = torch.tensor([e2m1(c) for c in range(16)], dtype=torch.float64)
    want = torch.empty(Dz, I, dtype=torch.float64)
    want[:, 0::2], want[:, 1::2] = lut[packed.long() & 15], lut[packed.long() >> 4]
    want *= torch.where(s2 == 0, 0.0, torch.pow(2.0, s2.double() - 127)).repeat_interleave(32, 1)
    if nan_row is not None:
        s2[nan_row, 3] = 255       # E8M0 NaN: 0 · NaN is NaN, so every dot product of that row
        want[nan_row] = float("nan")
    cols = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 13, 38, 101, 200, 255, 256, 400, 511])
    h = torch.zeros(len(cols), 1, I)
    h[torch.arange(len(cols)), 0, cols] = 1.0
    return packed, s2, h, want[:, cols].T


@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("code", [0, 255])
def test_edge_scale_codes(code, decode):
    """E8M0 0 reads as 0 and 255 as NaN, in one group only; the other groups carry extreme
    exponents (2^-100, 2^+60) next to ordinary ones and must still match the reference."""
    g = torch.Generator().manual_seed(11 + code)
    E, I, Dz, B, k = 3, 64, 96, 2, 1
    q13, s13, q2, s2 = experts(E, I, Dz, g)
    s13[:, :, 0], s2[:, :, 1] = 27, 187    # 2^-100, 2^60: products stay in FP32 range
    s13[1, 3, 2] = code                    # gate row 3 of expert 1, third group
    ids = torch.tensor([[0], [1]], dtype=torch.int32)
    x = torch.randn(B, Dz, generator=g)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    args = [dev(t) for t in (x, q13, s13, q2, s2, ids, torch.ones(B, 1))]
    y = moe_mxfp4_experts(*args, activation="situ", config={"DECODE": decode}).cpu()
    s13[1, 3, 2] = 127 - 126               # what the reference computes for code 0: 2^-126 · codes, about 0
    ref = moe_mxfp4_experts_ref(x, q13, s13, q2, s2, ids, torch.ones(B, 1), "situ")
    tol = 1e-5 if DEVICE == "cpu" else 2e-2  # BF16 operands on the GPU
    assert rel_rmse(y[0], ref[0]) < tol
    if code == 255:
        assert torch.isnan(y[1]).all()     # gate row 3 feeds every W2 row
    else:
        assert rel_rmse(y[1], ref[1]) < tol


@pytest.mark.parametrize("decode", DECODES)
def test_v3_down_every_byte_every_position_and_scale(decode):
    """One-hot activations read W2 back column by column through v3's down kernel: every byte value in
    every byte position of a word (rows are rolled), scales 2^-20 .. 2^20, E8M0 0 (reads as 0) and a
    NaN group; 16 one-hot tokens fill the MMA's token tile. Results must be exact."""
    import triton.language as tl
    from peregrine.kernels import moe_mxfp4_v3 as v3
    packed, s2, h, want = one_hot_w2(roll=5, nan_row=9)
    B, Dz = h.shape[0], packed.shape[0]
    ids = torch.zeros(B, 1, dtype=torch.int32)  # every token chose expert 0: program 0 serves them all
    part = torch.full((B, 1, Dz), float("nan"), device=DEVICE)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    v3.launch_down(dev(h), dev(packed[None].contiguous()), dev(s2[None].contiguous()), dev(ids), part, tl.float32,
                   {"DECODE": decode, "DOWN_BLOCK_KB": 64}, x_dtype=torch.float32)
    got = part[:, 0].cpu().double()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


AOT_SCRIPT = r"""
import inspect, json, os, re, subprocess, tempfile
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from peregrine.kernels import moe_mxfp4_v3 as v3
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
ptr = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*u8", "ids_ptr": "*i32", "h_ptr": "*fp32", "tw_ptr": "*fp32",
       "part_ptr": "*fp32"}
base = dict(TOP_K=16, B_PAD=16, K_PAD=16, N_PAD=128, BPG=v3.BPG, DOT_T=tl.bfloat16, PREC="tf32")
res = {}
for fn, ce, warps in ((v3._mx3_up_kernel, dict(base, BLOCK_I=v3.DEFAULTS["UP_BLOCK_I"], BLOCK_KB=v3.DEFAULTS["UP_BLOCK_KB"],
                                               ACT=1, BETA=4.0, BETA_L=25.0, DECODE="asm", STAGES=3, EVEN=True),
                       v3.DEFAULTS["UP_WARPS"]),
                      (v3._mx3_down_kernel, dict(base, BLOCK_D=v3.DEFAULTS["DOWN_BLOCK_D"], BLOCK_KB=v3.DEFAULTS["DOWN_BLOCK_KB"],
                                                 ACT_T=tl.bfloat16, DECODE="asm", STAGES=3, EVEN=True),
                       v3.DEFAULTS["DOWN_WARPS"])):
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in ce else ptr.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*")}
    k = triton.compile(ASTSource(fn, sig, ce, attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(k.asm["ptx"])
        f.flush()
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True).stderr
    res[fn.__name__] = int(re.search(r"(\d+) bytes spill stores", info).group(1))
print(json.dumps(res))
"""


def test_default_tiles_compile_for_sm90_without_spills():
    """Ahead-of-time sm_90a compile of the expert kernels at K3's top-16, B = 8 (no GPU needed; ptxas also
    assembles the inline PTX decode)."""
    assert run_aot(AOT_SCRIPT) == {"_mx3_up_kernel": 0, "_mx3_down_kernel": 0}


def test_v3_decode_choice_names_a_bad_value(monkeypatch):
    """PEREGRINE_MXFP4_V3_DECODE (GPU A/B runs) and a config's DECODE must be a known decode, the environment's a
    real one (not a probe): the error names it."""
    from peregrine.kernels import moe_mxfp4_v3 as v3
    with pytest.raises(ValueError, match="'bogus'"):
        v3._setup(1, 2, torch.bfloat16, {"DECODE": "bogus"}, is_cuda=False)
    monkeypatch.setenv(v3.DECODE_ENV, "nope")
    with pytest.raises(ValueError, match=f"{v3.DECODE_ENV}='nope'"):
        v3._setup(1, 2, torch.bfloat16, None, is_cuda=True)
    monkeypatch.setenv(v3.DECODE_ENV, "probe")  # wrong values by design: the bench's, never the environment's
    with pytest.raises(ValueError, match="'probe'"):
        v3._setup(1, 2, torch.bfloat16, None, is_cuda=True)
    monkeypatch.setenv(v3.DECODE_ENV, "dot_scaled")
    assert v3._setup(1, 2, torch.bfloat16, None, is_cuda=True)[1]["DECODE"] == "dot_scaled"
    assert v3._setup(1, 2, torch.bfloat16, None, is_cuda=False)[1]["DECODE"] == "plain"  # the interpreter's
