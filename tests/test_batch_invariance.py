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

from conftest import dummy_model_dir
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
    ecfg = EngineConfig(max_num_seqs=8, max_model_len=512, block_size=16, dtype="bfloat16", batch_invariant=True, **kw)
    return build_engine(model_dir, ecfg, log=lambda m: None)[0]


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 290) for _ in range(n)]


def serve(e, reqs: list[tuple[list[int], float, int]], logprobs: int | None = 2) -> list[tuple]:
    """Each (prompt, temperature, seed)'s (tokens, logprobs with their top-2) from one engine run, every request
    added before the first step."""
    done = {}
    for i, (p, temperature, seed) in enumerate(reqs):
        sp = SamplingParams(temperature=temperature, max_tokens=TOKENS, seed=seed, logprobs=logprobs, ignore_eos=True)
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


def test_standard_path_is_batch_invariant_across_cache_chunks_pieces_and_speculation(model_dir):
    """The standard path: one probe alone against the same probe after a request that shares its first 96 tokens
    (a prefix-cache hit), with its prompt in chunks of 40 tokens, prefilled in pieces while another request
    decodes, and with n-gram speculation on (greedy: speculative decoding gives plain decoding's tokens, its verify
    rows computed T at a time)."""
    rng = random.Random(5)
    probe = (prompt(rng, 150), 0.0, 1)
    alone = serve(engine(model_dir), [probe])[0]

    e = engine(model_dir)
    serve(e, [(probe[0][:100] + prompt(rng, 20), 0.0, 2)])
    hits0 = e.prefix_cache.stats["hit_tokens"]
    assert serve(e, [probe])[0] == alone, "after a prefix-cache hit"
    assert e.prefix_cache.stats["hit_tokens"] >= hits0 + 96, "the probe did not hit the cache"

    assert serve(engine(model_dir, max_num_batched_tokens=40), [probe])[0] == alone, "in 40-token chunks"

    e = engine(model_dir, max_prefill_tokens_while_decoding=24)
    e.add_request(prompt(rng, 10), SamplingParams(max_tokens=60, ignore_eos=True))
    for _ in range(3):
        e.step()
    assert serve(e, [probe])[0] == alone, "prefilled in pieces beside a decoding request"

    # a row asking for logprobs gets no drafts (speculative/decoder.py): tokens only, against plain decoding's
    e = engine(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert serve(e, [probe], logprobs=None)[0][0] == alone[0], "greedy speculation differs from plain decoding"
    assert e.stats["spec"]["verify_steps"] > 0, "nothing was verified: the comparison shows nothing"


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
    """--batch-invariant and VLLM_BATCH_INVARIANT=1 turn it on; a batch the fused path cannot take is refused."""
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
