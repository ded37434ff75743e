"""Programmatic Dependent Launch (kernels/pdl.py): the switch, the engine key, and every PDL-capable
kernel giving bit-identical results with it on and off.

Under the interpreter the PDL code path runs with no-op gdc calls, and programs run one at a time.
`run_deferred` uses that: the activations / caches / ids a kernel may only touch after its wait are
scrambled until the first program reaches griddepcontrol.wait, and the outputs are re-poisoned there,
so a read of anything but weights before the wait (or a write before it) changes the result.
"""
import pytest
import torch

from conftest import DEVICE, run_aot
from peregrine.config import ConfigError, EngineConfig
from peregrine.kernels import moe as moe_kernels
from peregrine.kernels import pdl as P
from peregrine.kernels.gemm import grouped_gemm, skinny_gemm
from peregrine.kernels.kda import KdaConfig, kda_decode
from peregrine.kernels.mla import mla_decode
from peregrine.kernels.mla_prologue import mla_prologue
from peregrine.kernels.moe import moe_experts, moe_route
from peregrine.kernels.norm import add_rms_norm, rms_norm
from peregrine.kernels.sampling import argmax
from peregrine.testing import poisoned

pytestmark = pytest.mark.gpu
BF16, F32 = torch.bfloat16, torch.float32


def rnd(*shape, dtype=F32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEVICE)


def scrambled(t):
    """A wrong value of the same dtype: NaN for floats, a shifted (still in-range) index for ints."""
    if t.dtype.is_floating_point:
        return torch.full_like(t, float("nan"))
    return t.roll(1, 0) if t.numel() > 1 and not torch.equal(t.roll(1, 0), t) else torch.zeros_like(t) + 1 - t.clamp(max=1)


def run_deferred(monkeypatch, call, deferred, outputs):
    """call() with PDL off, then on with `deferred` tensors wrong until the first wait; `outputs`
    (may overlap `deferred`: in-place state) must come out bit-identical."""
    start = {id(t): t.clone() for t in deferred + outputs}
    call()
    off = [t.clone() for t in outputs]
    for t in deferred + outputs:
        t.copy_(start[id(t)])
    real = [(t, t.clone()) for t in deferred]
    for t in deferred:
        t.copy_(scrambled(t))
    waits = []

    def wait():
        if not waits:
            for t, v in real:
                t.copy_(v)
            for t in outputs:
                if all(t is not d for d in deferred):
                    t.copy_(poisoned(t.shape, t.dtype, t.device) if t.dtype.is_floating_point else scrambled(t))
        waits.append(1)

    monkeypatch.setattr(P, "_gdc_wait", wait)
    with P.pdl(True):
        call()
    assert waits, "the PDL path never waited: launch_kwargs did not reach the kernel"
    for a, b in zip(off, outputs):
        assert torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8)), "PDL changed the result"


needs_interpreter = pytest.mark.skipif(DEVICE != "cpu", reason="the deferred-input trick needs the interpreter")


def test_switch_and_launch_kwargs():
    assert not P.pdl_enabled() and P.launch_kwargs(DEVICE) == {}
    with P.pdl(True):
        assert P.pdl_enabled()
        expect = {"USE_PDL": True} if DEVICE == "cpu" else (
            {"USE_PDL": True, "launch_pdl": True} if P.supported("cuda", None) else {})
        assert P.launch_kwargs(DEVICE) == expect
        with P.pdl(False):
            assert P.launch_kwargs(DEVICE) == {}
        assert P.pdl_enabled()
    assert not P.pdl_enabled()
    assert not P.supported("cpu", None)


def test_engine_key():
    e = EngineConfig()
    assert e.pdl is True  # on by default since the H200 decode bench measured it faster
    e.apply_additional_config('{"pdl": false, "decode_backend": "latency_specialized"}')
    assert e.pdl is False
    for bad in ('{"pdl": 1}', '{"pdl": "yes"}', '{"pdl": null}'):
        with pytest.raises(ConfigError, match="pdl must be true or false"):
            EngineConfig().apply_additional_config(bad)


GEMM_CFGS = {
    "plain_dot": dict(kernel="plain", BLOCK_N=32, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=2, dot=True),
    "plain_fma": dict(kernel="plain", BLOCK_N=16, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=2, dot=False),
    "splitk_dot": dict(kernel="splitk", BLOCK_N=32, BLOCK_K=64, SPLIT_K=4, num_warps=4, num_stages=2, dot=True),
    "splitk_fma": dict(kernel="splitk", BLOCK_N=16, BLOCK_K=64, SPLIT_K=3, num_warps=4, num_stages=2, dot=False),
    "one_tile": dict(kernel="plain", BLOCK_N=16, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=2, dot=False),
    "prefetch_fma": dict(kernel="plain", BLOCK_N=16, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=2, dot=False,
                         prefetch=True),
    "prefetch_splitk_dot": dict(kernel="splitk", BLOCK_N=32, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=2,
                                dot=True, prefetch=True),
}


@needs_interpreter
@pytest.mark.parametrize("variant", list(GEMM_CFGS))
@pytest.mark.parametrize("mnk,dtype", [((1, 100, 257), BF16), ((7, 33, 1000), F32), ((16, 40, 256), BF16)])
def test_gemm(monkeypatch, variant, mnk, dtype):
    m, n, k = mnk
    x, w = rnd(m, k, dtype=dtype, seed=1), rnd(n, k, dtype=dtype, seed=2, scale=k ** -0.5)
    y = poisoned((m, n), dtype, DEVICE)
    run_deferred(monkeypatch, lambda: skinny_gemm(x, w, out=y, config=GEMM_CFGS[variant]), [x], [y])
    assert torch.isfinite(y).all()


@needs_interpreter
@pytest.mark.parametrize("variant", ["plain_fma", "splitk_dot"])
def test_grouped_gemm(monkeypatch, variant):
    x, w = rnd(3, 2 * 130, dtype=BF16, seed=1), rnd(2 * 48, 130, dtype=BF16, seed=2, scale=130 ** -0.5)
    y = poisoned((3, 96), BF16, DEVICE)
    run_deferred(monkeypatch, lambda: grouped_gemm(x, w, 2, out=y, config=GEMM_CFGS[variant] | {"BLOCK_N": 16}), [x], [y])
    assert torch.isfinite(y).all()


@needs_interpreter
@pytest.mark.parametrize("D", [100, 8200])  # one pass in registers; two passes (D > norm.MAX_BLOCK)
def test_norms(monkeypatch, D):
    x, r, w = rnd(3, D, dtype=BF16, seed=1), rnd(3, D, dtype=BF16, seed=2), rnd(D, dtype=BF16, seed=3)
    y = poisoned((3, D), BF16, DEVICE)
    run_deferred(monkeypatch, lambda: rms_norm(x, w, 1e-5, out=y), [x], [y])
    run_deferred(monkeypatch, lambda: add_rms_norm(x, r, w, 1e-5, out=y), [x, r], [y, r])


@needs_interpreter
def test_argmax(monkeypatch):
    logits = rnd(3, 9000, seed=4)
    out = {}
    run_deferred(monkeypatch, lambda: out.__setitem__("t", argmax(logits)), [logits], [])
    with P.pdl(True):
        assert torch.equal(argmax(logits), logits.argmax(-1))


ROUTER_CFGS = {
    "dot_chunk32": dict(variant="dot", BLOCK_E=16, BLOCK_K=16, CHUNK=32, num_warps=4, num_stages=2),
    "fma": dict(variant="fma", BLOCK_E=4, BLOCK_K=32, CHUNK=64, num_warps=4, num_stages=2),
    "fma_one_tile": dict(variant="fma", BLOCK_E=2, BLOCK_K=128, CHUNK=128, num_warps=2, num_stages=2),
}


@needs_interpreter
@pytest.mark.parametrize("fused", ["1", "0"], ids=["one_launch", "two_launches"])
@pytest.mark.parametrize("variant", list(ROUTER_CFGS))
def test_router(monkeypatch, variant, fused):
    B, E, D, k = 3, 20, 100, 4
    x, gw, bias = rnd(B, D, seed=1), rnd(E, D, seed=2, scale=0.1), rnd(E, seed=3, scale=0.01)
    res = {}

    cfg = ROUTER_CFGS[variant] | ({"num_warps": moe_kernels.TOPK_WARPS} if fused == "1" else {})
    assert moe_kernels.fuses_topk(cfg, B) == (fused == "1")

    def call():
        res["ids"], res["w"] = moe_route(x, gw, bias, k, config=cfg, logits_out=logits)
        ids.copy_(res["ids"])
        tw.copy_(res["w"])
    logits = poisoned((B, E), F32, DEVICE)
    ids, tw = torch.zeros(B, k, dtype=torch.int32, device=DEVICE), poisoned((B, k), F32, DEVICE)
    run_deferred(monkeypatch, call, [x], [logits, ids, tw])


@needs_interpreter
@pytest.mark.parametrize("cfg", [
    dict(variant="split", UP_BLOCK_I=16, UP_BLOCK_D=32, up_warps=4, up_stages=2, DOWN_BLOCK_D=16, DOWN_BLOCK_I=32,
         SWAP=False, down_warps=4, down_stages=2),
    dict(variant="fused", BLOCK_I=16, BLOCK_D=32, BLOCK_DO=32, num_warps=4, num_stages=2)], ids=["split", "fused"])
def test_experts(monkeypatch, cfg):
    B, E, D, I, k = 3, 6, 100, 48, 2
    w13, w2 = rnd(E, 2 * I, D, seed=1, scale=D ** -0.5), rnd(E, D, I, seed=2, scale=I ** -0.5)
    x, add = rnd(B, D, seed=3), rnd(B, D, seed=4)
    ids = torch.tensor([[0, 3], [3, 5], [1, 0]], dtype=torch.int32, device=DEVICE)
    tw = torch.rand(B, k, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out = poisoned((B, D), F32, DEVICE)
    run_deferred(monkeypatch, lambda: moe_experts(x, w13, w2, ids, tw, out=out, add=add, config=cfg),
                 [x, ids, tw, add], [out])


@needs_interpreter
@pytest.mark.parametrize("config", [KdaConfig(split=1), KdaConfig(split=4, finish="last"),
                                    KdaConfig(split=4, finish="launch")], ids=["split1", "last", "launch"])
def test_kda(monkeypatch, config):
    from test_kernels_kda import make_case
    inp, state, conv, idx = make_case(2, 32, [5, 2], 2, seed=7)
    out = poisoned((2, 2, 2 * 32), F32, DEVICE)
    acts = [inp[n] for n in ("qkv", "f", "b", "r")]
    run_deferred(monkeypatch, lambda: kda_decode(**inp, state=state, conv_state=conv, slots=idx, out=out,
                                                 config=config), acts + [state, conv, idx], [out, state, conv])


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla(monkeypatch, num_splits):
    from test_kernels_mla import SM_SCALE, SPLIT_TILING, make_case
    q, lat, scale, bt, lens = make_case([40, 7, 100], 4, 128, 32, 16, F32)
    out = poisoned((3, 4, 128), F32, DEVICE)
    run_deferred(monkeypatch, lambda: mla_decode(q, lat, scale, bt, lens, SM_SCALE, kv_lora_rank=128, out=out,
                                                 num_splits=num_splits, tiling=SPLIT_TILING),
                 [q, lat, bt, lens], [out])


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_combine_uv(monkeypatch, num_splits):
    """The fused combine + W_UV alone (its W_UV tile loaded before the wait): the split kernel's partials,
    lengths (and with one split its output) are wrong until the wait."""
    from test_kernels_mla import SM_SCALE, SPLIT_TILING, make_case
    from peregrine.kernels.mla import UvTiling, combine_uv, mla_partials
    q, lat, scale, bt, lens = make_case([40, 7, 100], 3, 40, 8, 16, F32)
    w = rnd(3, 24, 40, seed=9, scale=40 ** -0.5)
    p = mla_partials(q, lat, scale, bt, lens, SM_SCALE, kv_lora_rank=40, num_splits=num_splits, tiling=SPLIT_TILING)
    out = poisoned((3, 3 * 24), F32, DEVICE)
    acts = [t for t in (p.part, p.lse, p.direct) if t is not None] + [lens]
    run_deferred(monkeypatch, lambda: combine_uv(p, w, out=out, uv_tiling=UvTiling(block_c=16, block_b=2)), acts, [out])


@needs_interpreter
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("N", [3, 19])  # one row chunk; a verify step's B·T rows over two
def test_mla_prologue(monkeypatch, fp8, N):
    from test_kernels_mla_prologue import ODD, make_case
    q, kva, w_uk, kv_norm, lat, scale, slots = make_case(N, **ODD, dtype=BF16,
                                                         cache_dtype=torch.float8_e4m3fn if fp8 else BF16)
    out = poisoned((N, ODD["H"], ODD["r"] + ODD["rope"]), BF16, DEVICE)
    outs = [out, lat] + ([scale] if fp8 else [])
    run_deferred(monkeypatch, lambda: mla_prologue(q, kva, w_uk, kv_norm, 1e-6, lat, scale, slots, out=out),
                 [q, kva, slots] + outs[1:], outs)


@needs_interpreter
def test_bench_chain_on_cpu():
    """The benchmark's chain (tiny dims) runs and gives the same bits with PDL on and off."""
    from peregrine.bench.pdl import Chain
    outs = []
    for on in (False, True):
        for mode in ("plan", "triton"):
            c = Chain(2, DEVICE, layers=2, hidden=64, up_n=96, down_k=80, mode=mode)
            with P.pdl(on):
                outs.append(c.step().clone())
    assert torch.isfinite(outs[0]).all()
    assert all(torch.equal(outs[0], o) for o in outs[1:])


AOT_SCRIPT = r"""
import json, os, re
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from peregrine.kernels import gemm, norm, moe, mla, mla_prologue as mp
jobs = {
    "gemm": (gemm._gemm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "out_ptr": "*bf16",
                                 "count_ptr": "*i32"},
             dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, USE_DOT=True, IEEE=False, EVEN_K=True, INLINE_REDUCE=False,
                  PREFETCH=False)),
    "gemm_inline": (gemm._gemm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*fp32", "out_ptr": "*bf16",
                                        "count_ptr": "*i32"},
                    dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, USE_DOT=False, IEEE=False, EVEN_K=True, INLINE_REDUCE=True,
                         PREFETCH=False)),
    "gemm_prefetch": (gemm._gemm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "out_ptr": "*bf16",
                                          "count_ptr": "*i32"},
                      dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, USE_DOT=False, IEEE=False, EVEN_K=False, INLINE_REDUCE=False,
                           PREFETCH=True)),
    # grouped_gemm's launch: the KDA gates' plan tile (M = 1, FMA, BLOCK_N 8, K 128) with group_n a runtime arg
    "gemm_grouped": (gemm._gemm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "out_ptr": "*bf16",
                                         "count_ptr": "*i32", "group_n": "i32"},
                     dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=128, USE_DOT=False, IEEE=False, EVEN_K=True, INLINE_REDUCE=False,
                          PREFETCH=False)),
    "norm": (norm._rms_norm_kernel, {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16",
                                     "eps": "fp32"}, dict(HAS_RES=True, BLOCK=4096, SINGLE=True)),
    "router_fused": (moe._router_logits_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "part_ptr": "*fp32",
                                                 "bias_ptr": "*fp32", "ids_ptr": "*i32", "tw_ptr": "*fp32",
                                                 "logits_ptr": "*fp32", "count_ptr": "*i32", "scaling": "fp32"},
                     dict(B_PAD=16, BLOCK_E=16, BLOCK_K=128, DOT=True, TOPK=True, TOPK_ROWS=1, TOP_K=8, K_PAD=8,
                          E_PAD=256, RENORM=True, HAS_BIAS=True, STORE_LOGITS=False, SHARED=True)),
    "topk": (moe._router_topk_kernel, {"part_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i32", "w_ptr": "*fp32",
                                       "logits_ptr": "*fp32", "scaling": "fp32"},
             dict(SPLIT=9, TOP_K=8, K_PAD=8, E_PAD=256, RENORM=True, HAS_BIAS=True, STORE_LOGITS=False, SHARED=True)),
    "combine": (moe._combine_kernel, {"part_ptr": "*fp32", "tw_ptr": "*fp32", "add_ptr": "*bf16", "out_ptr": "*bf16"},
                dict(TOP_K=8, K_PAD=8, BLOCK_D=256, HAS_ADD=True)),
    **{f"mla_prologue_{c}": (mp._mla_prologue_kernel,
                             {"q_ptr": "*bf16", "kva_ptr": "*bf16", "wuk_ptr": "*bf16", "kvw_ptr": "*bf16",
                              "qh_ptr": "*bf16", "lat_ptr": "*fp8e4nv" if c == "fp8" else "*bf16",
                              "scale_ptr": "*fp32", "slot_ptr": "*i64", "eps": "fp32"},
                             dict(H=32, NOPE=128, R=512, ROPE=64, NRB=8, BLOCK_B=16, BLOCK_K=128, BLOCK_R=64,
                                  BLOCK_RR=512, BLOCK_ROPE=64, FP8=c == "fp8", EXACT=False, CDT=tl.bfloat16,
                                  PREC="tf32")) for c in ("bf16", "fp8")},
    # combine_uv at 48B's B = 1, 8K context (128 splits): 16 channel slices and the last-arrival sum
    "mla_uv": (mla._mla_uv_kernel, {"part_ptr": "*fp32", "lse_ptr": "*fp32", "len_ptr": "*i32", "w_ptr": "*bf16",
                                    "ws_ptr": "*fp32", "count_ptr": "*i32", "out_ptr": "*bf16"},
               dict(C=512, BLOCK_S=128, BLOCK_SS=128, BLOCK_V=128, BLOCK_C=32, BLOCK_B=1, NC=16, BLOCK_NC=16,
                    BLOCK_N=64, MIN_CHUNK=64, DIRECT=False)),
}
res = {}
for name, (fn, ptr, ce) in jobs.items():
    for on in (False, True):
        c = dict(ce, USE_PDL=on)
        sig = {n: "constexpr" if n in c else ptr.get(n, "i32") for n in fn.arg_names}
        k = triton.compile(ASTSource(fn, sig, c, {}), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        ptx = k.asm["ptx"]
        res[f"{name},{on}"] = [ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents"),
                               k.metadata.launch_pdl,
                               ptx.find("griddepcontrol.launch_dependents") < ptx.find("griddepcontrol.wait")]
print(json.dumps(res))
"""


def test_pdl_variants_compile_for_sm90_with_griddepcontrol():
    """Ahead-of-time sm_90a compile (no GPU needed): USE_PDL kernels carry griddepcontrol.wait and
    .launch_dependents in their PTX, the default ones none."""
    for key, (wait, trig, _, trigger_first) in run_aot(AOT_SCRIPT).items():
        on = key.endswith("True")
        assert (wait >= 1 and trig >= 1) if on else (wait == 0 and trig == 0), f"{key}: wait {wait}, trigger {trig}"
        if on:  # pdl_wait waits, then triggers
            assert not trigger_first, f"{key}: trigger before wait"
