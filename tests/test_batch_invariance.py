"""Batch-invariant mode (--batch-invariant, docs/correctness.md §5): a request's tokens and logprobs are bitwise the
same alone and beside other requests, in BF16, on the fused kernels (Triton's interpreter on the CPU) and on the
standard path with a prefix hit, a chunked prompt, prefill pieces beside decodes and speculation on. The reference
of each request is the same request served alone by the same engine configuration.

Without the mode the latency_specialized case and the MLA kernel case fail: MLA decode sizes its splits by the
batch, so a row's attention sums in another order beside others. (The standard path on the CPU is invariant
without the mode too: that test keeps it so.)
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import DEVICE, dummy_model_dir
from peregrine import kernels
from peregrine.config import PRESET_DIR, ConfigError, EngineConfig
from peregrine.engine import SamplingParams
from peregrine.engine.build import build_engine
from peregrine.kernels.mla import mla_decode

pytestmark = pytest.mark.gpu

MICRO = {  # tiny-kimi-linear narrowed (as tests/test_specialized.py): the interpreter's cost scales with it
    "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 300, "intermediate_size": 96,
    "linear_attn_config": {"full_attn_layers": [2, 4], "kda_layers": [1, 3], "head_dim": 16, "num_heads": 2,
                           "short_conv_kernel_size": 4},
    "num_attention_heads": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 32,
}
TOKENS = 8  # generated per request: enough decode steps for the batch around the probe to change


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    raw = json.loads((PRESET_DIR / "tiny-kimi-linear.json").read_text())
    raw.update(MICRO)
    return dummy_model_dir(tmp_path_factory, raw, "model", seed=3)


@pytest.fixture(autouse=True)
def _mode_off_after():
    yield
    kernels.set_batch_invariant(False)


def engine(model_dir, **kw):
    kw = {"max_num_seqs": 8, "max_model_len": 512, "block_size": 64, "dtype": "bfloat16", **kw}
    ecfg = EngineConfig(batch_invariant=True, **kw)
    return build_engine(model_dir, ecfg, log=lambda m: None)[0]


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 290) for _ in range(n)]


def serve(e, reqs: list[tuple[list[int], float, int]], logprobs: int | None = 2, tokens: int = TOKENS) -> list[tuple]:
    """Each (prompt, temperature, seed)'s (tokens, logprobs with their top-2) from one engine run, every request
    added before the first step."""
    done = {}
    for i, (p, temperature, seed) in enumerate(reqs):
        sp = SamplingParams(temperature=temperature, max_tokens=tokens, seed=seed, logprobs=logprobs, ignore_eos=True)
        e.add_request(p, sp, on_token=lambda o, i=i: done.__setitem__(i, o) if o.finished else None)
    while e.has_unfinished():
        e.step()
    return [(done[i].output_token_ids, [repr(lp) for lp in done[i].logprobs or ()]) for i in range(len(reqs))]


def test_fused_decode_is_batch_invariant(model_dir):
    """latency_specialized: two probes (one greedy, one sampled) each alone, then both beside 3 others of random
    lengths, at other places in the batch: the same tokens and logprobs, bit for bit."""
    e = engine(model_dir, decode_backend="latency_specialized")
    rng = random.Random(11)
    probes = [(prompt(rng, 37), 0.0, 5), (prompt(rng, 21), 1.0, 6)]
    alone = [serve(e, [p])[0] for p in probes]
    for others in (3,):  # (1 and 4 too when written; each batch costs ~40 s in the interpreter)
        rest = [(prompt(rng, rng.randrange(5, 90)), float(i % 2), 100 + i) for i in range(others)]
        batch = rest[:1] + [probes[0]] + rest[1:] + [probes[1]]
        out = serve(e, batch)
        assert [out[batch.index(p)] for p in probes] == alone, f"beside {others} others a probe's answer changed"
    assert e.stats["steps_by_path"]["latency_specialized"] > 0


def standard_cases(model_dir, dtype: str, rng: random.Random) -> dict[str, list]:
    """One greedy and one sampled probe (200-token prompts: the KDA layers' chunk form) served by the standard path in
    the mode: alone, in batches of 3, 5 and 16 of random lengths (the greedy one at a random place), after prompts
    that share their first 150 tokens (a 128-token prefix hit), in 100-token budgets (chunks of 64), in pieces beside
    a decoding request -> {case: answers}."""
    probes = [(prompt(rng, 200), 0.0, 1), (prompt(rng, 200), 1.0, 2)]
    out = {"alone": [serve(engine(model_dir, dtype=dtype), [p])[0] for p in probes]}
    for others in (1, 3, 14):
        rest = [(prompt(rng, rng.randrange(5, 150)), float(i % 2), 10 + i) for i in range(others)]
        at = rng.randrange(others + 1)
        batch = rest[:at] + probes[:1] + rest[at:] + probes[1:]
        got = serve(engine(model_dir, dtype=dtype, max_num_seqs=16), batch)
        out[f"in a batch of {others + 2}"] = [got[batch.index(p)] for p in probes]
    e = engine(model_dir, dtype=dtype)
    serve(e, [(p[0][:150] + prompt(rng, 20), 0.0, 3) for p in probes])
    hits0 = e.prefix_cache.stats["hit_tokens"]
    out["after a prefix-cache hit"] = [serve(e, [p])[0] for p in probes]
    assert e.prefix_cache.stats["hit_tokens"] >= hits0 + 2 * 128, "the probes did not hit the cache"
    e = engine(model_dir, dtype=dtype, max_num_batched_tokens=100)
    out["in 100-token budgets"] = [serve(e, [p])[0] for p in probes]
    e = engine(model_dir, dtype=dtype, max_prefill_tokens_while_decoding=64)
    e.add_request(prompt(rng, 10), SamplingParams(max_tokens=60, ignore_eos=True))
    for _ in range(3):
        e.step()
    out["in pieces beside a decode"] = [serve(e, [p])[0] for p in probes]
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_standard_path_is_batch_invariant(model_dir, dtype):
    """The standard path in the mode (PyTorch's forms on the CPU): each probe's tokens and logprobs, bit for bit, in
    every case of standard_cases. FP32 shows any change of summation order (BF16 rounding hides most): without the
    mode's forms (chunk_kda's scan over a row's chunks, the batched decode attention, conv1d) it fails."""
    out = standard_cases(model_dir, dtype, random.Random(5))
    for case, got in out.items():
        assert got == out["alone"], f"{dtype}: {case}: a probe's answer changed"


def test_k3_standard_path_is_batch_invariant(tmp_path_factory):
    """tiny-k3 (AttnRes, SiTU, the MLA output gate, latent MoE with MXFP4 experts, the bounded KDA gate), FP32: the
    same cases. (In the mode it failed every one until AttnRes computed a token's weights along its own row and the
    MXFP4 experts took the mode's GEMM.)"""
    d = dummy_model_dir(tmp_path_factory, json.loads((PRESET_DIR / "tiny-k3.json").read_text()), "k3", seed=3)
    out = standard_cases(d, "float32", random.Random(5))
    for case, got in out.items():
        assert got == out["alone"], f"k3: {case}: a probe's answer changed"


def test_decoded_blocks_are_recomputed_and_speculation_gives_plain_tokens(model_dir):
    """A next turn (the last prompt + its 80 generated tokens + new ones) answers as on a cold engine: the blocks the
    decode steps wrote are not reused (their bits are the decode kernels', not a prefill's), and greedy n-gram
    speculation (verify rows computed as decode rows) gives plain decoding's tokens. FP32."""
    rng = random.Random(7)
    first = prompt(rng, 120)
    e = engine(model_dir, dtype="float32")
    toks = serve(e, [(first, 0.0, 1)], tokens=80)[0][0]
    turn2 = (first + toks + prompt(rng, 30), 0.0, 2)
    assert serve(e, [turn2])[0] == serve(engine(model_dir, dtype="float32"), [turn2])[0], "a reused decoded block"
    assert e.prefix_cache.stats["hit_tokens"] >= 64, "the first prompt's block was not reused"

    probe = (prompt(rng, 150), 0.0, 3)
    alone = serve(engine(model_dir, dtype="float32"), [probe], logprobs=None)[0][0]
    e = engine(model_dir, dtype="float32",
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert serve(e, [probe], logprobs=None)[0][0] == alone, "greedy speculation differs from plain decoding"
    assert e.stats["spec"]["verify_steps"] > 0, "nothing was verified: the comparison shows nothing"


def test_standard_path_kernel_forms_are_batch_invariant(model_dir):
    """The forms the GPU takes in the mode, here in Triton's interpreter (BF16): fixed-tile GEMMs for every
    projection, the router in FP32 and each used expert, the one-pass norms, the flash attention without KV splits.
    A probe alone and first of 3 prompts (its rows at the same places in each tile: the interpreter's dot is numpy's
    BLAS, whose bits, unlike the GPU's MMA, depend on a row's place in the tile): bit for bit."""
    from peregrine.models import layers
    rng = random.Random(9)
    probe = (prompt(rng, 40), 0.0, 1)  # (the interpreter's cost is per program: per row for the norms and the glue)
    rest = [(prompt(rng, n), 1.0, 5 + n) for n in (24, 9)]
    old, layers.INVARIANT_KERNELS = layers.INVARIANT_KERNELS, True
    try:
        alone = serve(engine(model_dir), [probe], tokens=2)[0]
        assert serve(engine(model_dir), [probe] + rest, tokens=2)[0] == alone, "beside 2 others"
    finally:
        layers.INVARIANT_KERNELS = old


def test_kernel_forms_rows_do_not_depend_on_the_step():
    """Kernel level: the fixed-tile GEMM gives each row the same bits at any row count; the flash attention's
    invariant config gives a query the same bits cold, after a prefix (warm) and in a chunk, and splits nothing
    (without it a long-context row of few queries takes KV splits, summed in another order)."""
    from peregrine.kernels.gemm import prefill_invariant_config, skinny_gemm
    from dataclasses import replace
    from peregrine.kernels.mla_prefill import invariant_config, mla_prefill
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 200, generator=g).bfloat16()
    w = torch.randn(136, 200, generator=g).bfloat16()
    full = skinny_gemm(x, w, config=prefill_invariant_config(136, 200))
    for a, b in [(0, 1), (0, 12), (64, 128), (128, 300)]:  # (tile-aligned starts: see the test above)
        assert torch.equal(skinny_gemm(x[a:b], w, config=prefill_invariant_config(136, 200)), full[a:b]), (a, b)
    H, Dn, Dr, Dv, L = 2, 32, 16, 32, 800  # FP32: a change of summation order shows
    q = torch.randn(L, H, Dn + Dr, generator=g)
    kn, kr, v = (torch.randn(*sh, generator=g) for sh in ((L, H, Dn), (L, Dr), (L, H, Dv)))
    cfg = invariant_config(Dn, Dr, Dv, torch.float32)
    cold = mla_prefill(q, kn, kr, v, 0.1, 0, config=cfg)
    for start, T in [(768, 32), (640, 160), (512, 64)]:  # (starts on the query tile, as above)
        part = mla_prefill(q[start:start + T], kn[:start + T], kr[:start + T], v[:start + T], 0.1, start, config=cfg)
        assert torch.equal(part, cold[start:start + T]), (start, T)
    split = mla_prefill(q[640:], kn, kr, v, 0.1, 640, config=replace(cfg, num_splits=4))  # what the mode avoids
    assert not torch.equal(split, cold[640:]), "KV splits changed nothing: the check above shows nothing"


@pytest.mark.skipif(DEVICE != "cuda", reason="the 48B's widths: compiled kernels and fla on a GPU")
def test_gpu_48b_widths_are_batch_invariant(tmp_path_factory):
    """Kimi-Linear-48B's widths (3 layers: dense, MLA + MoE, KDA + MoE; BF16, dummy weights) on the GPU, decode on
    latency_specialized: a greedy and a sampled 700-token probe alone, beside 5 others, after a 640-token prefix hit,
    in 200-token budgets and in pieces beside a decode: the same tokens and logprobs, bit for bit."""
    import gc
    raw = json.loads((PRESET_DIR / "kimi-linear-48b-a3b.json").read_text())
    raw["num_hidden_layers"] = 3
    raw["linear_attn_config"] = {**raw["linear_attn_config"], "kda_layers": [3], "full_attn_layers": [1, 2]}
    d = dummy_model_dir(tmp_path_factory, raw, "k48", seed=4)

    def run(reqs, **kw):
        e = engine(d, decode_backend="latency_specialized", max_model_len=2048, **kw)
        out = serve(e, reqs)
        del e
        gc.collect()
        torch.cuda.empty_cache()
        return out

    rng = random.Random(13)
    probes = [(prompt(rng, 700), 0.0, 1), (prompt(rng, 700), 1.0, 2)]
    alone = [run([p])[0] for p in probes]
    rest = [(prompt(rng, rng.randrange(5, 900)), float(i % 2), 10 + i) for i in range(5)]
    batch = rest[:2] + probes[:1] + rest[2:] + probes[1:]
    got = run(batch)
    assert [got[batch.index(p)] for p in probes] == alone, "beside 5 others"
    e = engine(d, decode_backend="latency_specialized", max_model_len=2048)
    serve(e, [(p[0][:650] + prompt(rng, 40), 0.0, 3) for p in probes])
    assert [serve(e, [p])[0] for p in probes] == alone, "after a prefix-cache hit"
    assert e.prefix_cache.stats["hit_tokens"] >= 2 * 640
    del e
    assert [run([p], max_num_batched_tokens=200)[0] for p in probes] == alone, "in 200-token budgets"
    e = engine(d, decode_backend="latency_specialized", max_model_len=2048, max_prefill_tokens_while_decoding=128)
    e.add_request(prompt(rng, 10), SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        e.step()
    assert serve(e, probes) == alone, "in pieces beside a decode"


def test_mla_decode_rows_do_not_depend_on_the_batch():
    """Kernel level: in the mode each sequence's attention equals its attention alone, whatever the batch's
    size and other lengths; a verify step's rows equal decode rows over the same prefixes. (Without the mode the
    split count follows the batch size.)"""
    from test_kernels_mla import SM_SCALE, TINY, make_case
    H, C, R = TINY
    lens = [1000, 3, 640, 130, 777, 1]
    q, lat, scale, bt, lens_t = make_case(lens, H, C, R, 16, torch.float32, seed=3)  # (BF16 output hides some)
    kernels.set_batch_invariant(True, bt.shape[1] * 16)
    batch = mla_decode(q, lat, scale, bt, lens_t, SM_SCALE, kv_lora_rank=C)
    for i in range(len(lens)):
        one = mla_decode(q[i:i + 1], lat, scale, bt[i:i + 1], lens_t[i:i + 1], SM_SCALE, kv_lora_rank=C)
        assert torch.equal(one[0], batch[i]), f"sequence {i} (length {lens[i]}) alone differs"
    T = 3  # verify: sequences 0 and 3, their last T positions as T query rows
    seqs = [0, 3]
    qv = torch.stack([q[s] for s in seqs for _ in range(T)])
    verify = mla_decode(qv, lat, scale, bt[seqs], lens_t[seqs], SM_SCALE, kv_lora_rank=C, tokens_per_seq=T)
    for j, s in enumerate(seqs):
        for r in range(T):
            n = torch.tensor([lens[s] - (T - 1) + r], dtype=torch.int32, device=lens_t.device)
            plain = mla_decode(qv[j * T + r:j * T + r + 1], lat, scale, bt[s:s + 1], n, SM_SCALE, kv_lora_rank=C)
            assert torch.equal(plain[0], verify[j * T + r]), f"verify row {r} of sequence {s}"


def test_the_switches():
    """--batch-invariant and VLLM_BATCH_INVARIANT=1 turn it on; a batch the fused path cannot take, a block size or budget
    that would split a prompt off the KDA chunk, and tensor parallelism are refused with a message naming them."""
    import os
    from peregrine.cli import build_parser
    from peregrine.engine_args import engine_config

    args = build_parser().parse_args(["generate", "--model", "tiny-kimi-linear", "--batch-invariant"])
    assert engine_config(args).batch_invariant
    args = build_parser().parse_args(["generate", "--model", "tiny-kimi-linear"])
    assert not engine_config(args).batch_invariant
    old = os.environ.get("VLLM_BATCH_INVARIANT")
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    try:
        assert engine_config(args).batch_invariant and EngineConfig().batch_invariant
    finally:
        os.environ.pop("VLLM_BATCH_INVARIANT") if old is None else os.environ.__setitem__("VLLM_BATCH_INVARIANT", old)
    with pytest.raises(ConfigError, match="max_decode_batch"):
        EngineConfig(batch_invariant=True, decode_backend="latency_specialized", max_num_seqs=12).validate()
    with pytest.raises(ConfigError, match="multiple of 64"):
        EngineConfig(batch_invariant=True, block_size=16).validate()
    with pytest.raises(ConfigError, match="at least 64 tokens"):
        EngineConfig(batch_invariant=True, max_num_batched_tokens=40).validate()
    with pytest.raises(ConfigError, match="tensor-parallel-size"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=2).validate()
    EngineConfig(batch_invariant=True, block_size=128, max_num_batched_tokens=64).validate()
