"""Conformance with an implementation nobody here wrote: transformers' own KimiLinearForCausalLM.

transformers builds the model with random weights on two small configs, saves it the way it saves
every checkpoint (its names: the dense layer's MLP under block_sparse_moe.), and peregrine loads that
folder as a user would. FP32: the prefill logits at every prompt position and the logits of each
of 16 greedy decode steps agree within 1e-4 (relative RMSE), and the 16 greedy tokens are identical,
on the standard path and on the specialized path (Triton kernels, through the interpreter on CPU).
This is how vLLM tests its models against HF.

The MLA latent norms (kv_a_layernorm / q_a_layernorm) use eps 1e-6 in transformers (and Moonshot's
modeling_kimi.py) whatever rms_norm_eps says; peregrine follows that by default (config.MLA_NORM_EPS),
and config.json's "mla_norm_eps" overrides it. The configs here do not set the field, so the default is
what is compared. Config B has rms_norm_eps 1e-5 (the published value) and a latent whose mean square
is ~1e-5, where the eps shows: test_mla_norm_eps_is_the_difference checks that the override set to
rms_norm_eps makes config B miss transformers.
"""
from __future__ import annotations

import json

import pytest
import torch

from peregrine.config import MLA_NORM_EPS, EngineConfig
from peregrine.engine import SamplingParams
from peregrine.engine.build import build_engine
from peregrine.testing import rel_rmse

import transformers  # noqa: E402  test-only dependency, pinned in requirements-cpu.txt (>= 5.17 ships the model)


def _transformers_torch_path():
    """transformers' model on its own torch path: it binds fla's kernels at import where fla is installed
    (the GPU machine), which would make the reference share code with peregrine's prefill (and fail on CPU
    tensors). Hide fla while its modeling module is imported."""
    import sys
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
    sys.modules["fla"] = None  # an import of fla now raises ImportError: transformers keeps its torch functions
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear as mk
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)
    return transformers.KimiLinearConfig, mk.KimiLinearForCausalLM


KimiLinearConfig, KimiLinearForCausalLM = _transformers_torch_path()

TOL = 1e-4          # relative RMSE of FP32 logits
NEW_TOKENS = 16
HF_MLA_NORM_EPS = 1e-6  # transformers' KimiLinearRMSNorm default, used for kv_a_layernorm and q_a_layernorm
LM_HEAD_STD = 4.0   # x fan_in^-1/2: confident greedy choices (no near-ties between the two FP32 runs)

BASE = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 300,
    "mla_use_nope": True, "moe_layer_freq": 1, "moe_router_activation_func": "sigmoid", "hidden_act": "silu",
    "num_expert_group": 1, "topk_group": 1, "use_grouped_topk": True, "model_max_length": 4096,
    "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 299, "tie_word_embeddings": False,
}
CONFIGS = {
    # Kimi-Linear's shape: dense layer 0, KDA then MLA, q_proj (no q-LoRA), one shared expert
    "A": dict(BASE, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=16, rms_norm_eps=1e-6,
              linear_attn_config={"full_attn_layers": [3], "kda_layers": [1, 2], "head_dim": 16, "num_heads": 2,
                                  "short_conv_kernel_size": 4},
              first_k_dense_replace=1, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
              routed_scaling_factor=2.446, moe_renormalize=True),
    # the other corners: MLA first and last, two dense layers, q-LoRA, 3 heads, two shared experts,
    # no top-k renormalization, a tiny latent (kv_a weights scaled down, see KV_A_SCALE)
    "B": dict(BASE, hidden_size=96, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=4,
              num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=16, rms_norm_eps=1e-5,
              linear_attn_config={"full_attn_layers": [1, 4], "kda_layers": [2, 3], "head_dim": 16, "num_heads": 3,
                                  "short_conv_kernel_size": 4},
              first_k_dense_replace=2, num_experts=6, num_experts_per_token=3, num_shared_experts=2,
              routed_scaling_factor=1.0, moe_renormalize=False),
}
KV_A_SCALE = {"A": 1.0, "B": 3e-3}  # config B: latent mean square ~1e-5, where an eps of 1e-5 vs 1e-6 shows


def _hf_model(name: str, seed: int):
    raw = CONFIGS[name]
    torch.manual_seed(seed)
    m = KimiLinearForCausalLM(KimiLinearConfig(**raw)).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random weights everywhere (HF's init leaves norms at 1 and the router bias at 0)
        for n, p in m.named_parameters():
            if n.endswith(("A_log", "dt_bias")):
                continue  # HF's KDA init: decay rates and time steps in their usual ranges
            if "norm" in n:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                std = p.shape[-1] ** -0.5 * (LM_HEAD_STD if n == "lm_head.weight" else 1.0)
                if "kv_a_proj_with_mqa" in n:
                    std *= KV_A_SCALE[name]
                p.copy_(torch.randn(p.shape, generator=g) * std)
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return m


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_case(request, tmp_path_factory):
    """(config name, folder transformers saved, prompt, HF prefill logits [T, V], HF decode logits
    [16, V], HF greedy tokens)."""
    name = request.param
    m = _hf_model(name, seed=ord(name))
    d = tmp_path_factory.mktemp(f"hf_kimi_{name}")
    m.save_pretrained(str(d))
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 256, (11,), generator=g).tolist()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        prefill = m(ids).logits[0].float()
        out = m.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=BASE["pad_token_id"], output_logits=True,
                         return_dict_in_generate=True)
    toks = out.sequences[0, len(prompt):].tolist()
    steps = torch.stack([x[0].float() for x in out.logits])  # [16, V]: step i's logits chose token i
    return name, d, prompt, prefill, steps, toks


def _peregrine(folder, backend: str, prompt, extra: dict | None = None):
    """Greedy run with prompt logits at every position -> (prefill logits [T, V], per-step logits [16, V],
    tokens, engine)."""
    cfg = dict(decode_backend=backend, dtype="fp32", max_model_len=64, max_num_seqs=1, max_decode_batch=1)
    e, _ = build_engine(str(folder), EngineConfig(**cfg), log=lambda m: None)
    rows, fwd = [], e.runner.forward

    def record(step):
        out = fwd(step)
        rows.append(out.float().cpu())  # the GPU pass: compared on the CPU
        return out
    e.runner.forward = record
    toks = e.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0))[0]
    assert rows[0].shape[0] == len(prompt)  # the prefill returned every position (prompt_logprobs)
    return rows[0], torch.cat(rows[1:] + [torch.empty(0, rows[0].shape[1])]), toks, e


def _check(hf_case, backend):
    name, folder, prompt, prefill, steps, toks = hf_case
    p_prefill, p_steps, p_toks, e = _peregrine(folder, backend, prompt)
    assert rel_rmse(p_prefill, prefill) <= TOL, f"config {name}: prefill logits differ"
    # peregrine's step i (i >= 1) is HF's step i; step 0 is the prefill's last row
    assert rel_rmse(p_prefill[-1], steps[0]) <= TOL
    assert p_toks == toks, f"config {name} on {backend}: greedy tokens differ"
    assert p_steps.shape[0] == NEW_TOKENS - 1
    for i in range(1, NEW_TOKENS):
        assert rel_rmse(p_steps[i - 1], steps[i]) <= TOL, f"config {name} on {backend}: decode step {i} logits differ"
    return e


def test_checkpoint_is_transformers_own(hf_case):
    """The folder is what transformers wrote: its names (the dense MLP under block_sparse_moe.) and its config.json."""
    from safetensors import safe_open
    name, folder, *_ = hf_case
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in keys
    assert not any(k.startswith("model.layers.0.mlp.") for k in keys)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["transformers_version"] == transformers.__version__ and saved["layer_types"]


def test_standard_path_matches_transformers(hf_case):
    e = _check(hf_case, "standard")
    assert e.stats["steps_by_path"]["standard"] == NEW_TOKENS


def test_specialized_path_matches_transformers(hf_case):
    e = _check(hf_case, "latency_specialized")
    assert e.stats["steps_by_path"]["latency_specialized"] == NEW_TOKENS - 1  # every decode step
    assert set(e.stats["fallback_reasons"]) == {"prefill in batch"}


def test_mla_norm_eps_is_the_difference(hf_case, tmp_path):
    """The override set to rms_norm_eps (1e-5, what peregrine used by default before): transformers'
    MLA norms use 1e-6, and on B's small latent the logits part."""
    name, folder, prompt, prefill, *_ = hf_case
    if name != "B":
        pytest.skip("config B carries the small latent")
    import shutil
    shutil.copytree(folder, tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    assert "mla_norm_eps" not in raw and raw["rms_norm_eps"] == 1e-5
    assert MLA_NORM_EPS == HF_MLA_NORM_EPS  # the default the other tests compared
    raw["mla_norm_eps"] = raw["rms_norm_eps"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    p_prefill, *_ = _peregrine(tmp_path / "m", "standard", prompt)
    assert rel_rmse(p_prefill, prefill) > 10 * TOL
