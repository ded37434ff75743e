"""Checkpoint loading/saving with HF names, config parsing, and their error messages."""
import json

import pytest
import torch
from safetensors.torch import save_file

from peregrine.cli import main
from peregrine.config import PRESET_DIR, ConfigError, EngineConfig, ModelConfig, resolve_model
from peregrine.models.kimi import KimiModel
from peregrine.models.loader import WeightError, init_dummy_weights, load_weights, save_weights

TINY = json.loads((PRESET_DIR / "tiny-kimi-linear.json").read_text())


def model(seed):
    m = KimiModel(ModelConfig.from_dict(TINY, name="tiny"), torch.float32)
    init_dummy_weights(m, seed)
    return m


def same_params(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("shard_bytes", [1 << 40, 1 << 20])
def test_save_load_round_trip(tmp_path, shard_bytes):
    a, b = model(1), model(2)
    assert not same_params(a, b)
    paths = save_weights(a, tmp_path, max_shard_bytes=shard_bytes)
    if shard_bytes < 1 << 30:
        assert len(paths) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    load_weights(b, tmp_path)
    assert same_params(a, b)


def test_checkpoint_uses_hf_names(tmp_path):
    save_weights(model(1), tmp_path)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.1.self_attn.A_log").get_shape() == [1, 1, 4, 1]
    for k in ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate_proj.weight",
              "model.layers.1.self_attn.q_conv1d.weight", "model.layers.2.self_attn.kv_b_proj.weight",
              "model.layers.3.block_sparse_moe.experts.15.w3.weight",
              "model.layers.3.block_sparse_moe.shared_experts.down_proj.weight",
              "model.layers.4.self_attn.kv_a_proj_with_mqa.weight"]:
        assert k in keys, k


def _tamper(tmp_path, fn):
    save_weights(model(1), tmp_path)
    from safetensors.torch import load_file
    d = load_file(str(tmp_path / "model.safetensors"))
    fn(d)
    save_file(d, str(tmp_path / "model.safetensors"))


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    _tamper(tmp_path, lambda d: d.__setitem__("model.layers.2.self_attn.kv_b_proj.weight", torch.zeros(10, 128)))
    with pytest.raises(WeightError, match=r"model\.layers\.2\.self_attn\.kv_b_proj\.weight.*\(10, 128\).*\(512, 128\)"):
        load_weights(model(2), tmp_path)


def test_unexpected_and_missing_tensors(tmp_path):
    _tamper(tmp_path, lambda d: d.__setitem__("model.layers.9.bogus.weight", torch.zeros(2)))
    with pytest.raises(WeightError, match=r"unexpected tensor 'model\.layers\.9\.bogus\.weight'"):
        load_weights(model(2), tmp_path)
    _tamper(tmp_path, lambda d: d.pop("model.norm.weight"))
    with pytest.raises(WeightError, match=r"lacks tensor\(s\) model\.norm\.weight"):
        load_weights(model(2), tmp_path)


def test_no_weights_in_folder(tmp_path):
    with pytest.raises(WeightError, match="no \\*.safetensors"):
        load_weights(model(1), tmp_path)


@pytest.mark.parametrize("field,value,msg", [
    ("hidden_size", None, "missing required field 'hidden_size'"),
    ("hidden_size", "big", "field 'hidden_size' must be int"),
    ("num_experts", 0, "field 'num_experts' must be > 0"),
    ("model_type", "llama", "field 'model_type' must be 'kimi_linear' or 'kimi_k3'"),
    ("num_experts_per_token", 99, "'num_experts_per_token' \\(99\\) exceeds 'num_experts'"),
])
def test_config_errors_name_the_field(field, value, msg):
    raw = dict(TINY)
    if value is None:
        raw.pop(field)
    else:
        raw[field] = value
    with pytest.raises(ConfigError, match=msg):
        ModelConfig.from_dict(raw)


def test_layer_lists_validated():
    raw = json.loads(json.dumps(TINY))
    raw["linear_attn_config"]["kda_layers"] = [1, 2]
    with pytest.raises(ConfigError, match=r"layers \[4\] are in neither"):
        ModelConfig.from_dict(raw)


def test_presets_parse():
    k3, _ = resolve_model("kimi-k3")
    assert (k3.hidden_size, k3.num_experts, k3.num_experts_per_token, k3.q_lora_rank, k3.expert_quant) == (7168, 896, 16, 1536, "mxfp4")
    assert len(k3.mla_layers) == 24 and len(k3.kda_layers) == 69
    kl, _ = resolve_model("kimi-linear-48b-a3b")
    assert kl.mla_layers == (3, 7, 11, 15, 19, 23, 26) and kl.latent_dim == 576 and kl.routed_scaling_factor == 2.446


def test_resolve_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown model 'nope'.*presets: .*tiny-kimi-linear"):
        resolve_model("nope")
    with pytest.raises(ConfigError, match="model folder not found"):
        resolve_model(str(tmp_path / "missing") + "/")
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        resolve_model(str(tmp_path))


def test_additional_config_validation():
    e = EngineConfig()
    e.apply_additional_config('{"decode_backend": "latency_specialized"}')
    assert e.decode_backend == "latency_specialized"
    with pytest.raises(ConfigError, match="unknown key 'foo'.*valid keys: decode_backend"):
        e.apply_additional_config('{"foo": 1}')
    with pytest.raises(ConfigError, match="decode_backend must be one of standard, latency_specialized"):
        e.apply_additional_config('{"decode_backend": "fast"}')
    with pytest.raises(ConfigError, match="not valid JSON"):
        e.apply_additional_config("{")


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["generate", "--model", "nope", "--dummy-weights"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown model 'nope'") and "Traceback" not in err
    assert main(["generate", "--model", "tiny-kimi-linear"]) == 2  # no weights shipped, no --dummy-weights
    assert "pass --dummy-weights" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny-kimi-linear", "--dummy-weights", "--prompt", ""]) == 2
    assert "empty" in capsys.readouterr().err.lower()


def test_cli_generates_from_saved_checkpoint(tmp_path, capsys):
    """A model folder (config.json + safetensors) generates, and matches the same weights in memory."""
    save_weights(model(0), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2,3", "--max-tokens", "4", "--quiet"]) == 0
    folder_out = capsys.readouterr().out
    assert main(["generate", "--model", "tiny-kimi-linear", "--dummy-weights", "--prompt-ids", "1,2,3", "--max-tokens", "4", "--quiet"]) == 0
    assert capsys.readouterr().out == folder_out


def test_cli_prefill_budget_reaches_the_scheduler():
    """--max-num-batched-tokens bounds the prompt tokens of one step: a 10-token prompt with a
    budget of 4 takes 3 prefill steps (4 + 4 + 2)."""
    from peregrine.cli import build_parser
    from peregrine.engine_args import engine_config
    from peregrine.engine import SamplingParams
    from peregrine.engine.build import build_engine
    a = build_parser().parse_args(["generate", "--model", "tiny-kimi-linear", "--dummy-weights",
                                   "--max-num-batched-tokens", "4", "--prompt", "x"])
    ecfg = engine_config(a)
    assert ecfg.max_num_batched_tokens == 4
    e, _ = build_engine("tiny-kimi-linear", ecfg, dummy_weights=True, log=lambda m: None)
    prefill_tokens = []
    e.add_request(list(range(10, 20)), SamplingParams(max_tokens=1))
    while e.has_unfinished():
        e.step()
        prefill_tokens.append(e.last_step.num_prefill_tokens)
    assert prefill_tokens == [4, 4, 2], prefill_tokens


def test_transformers_5_names_for_the_dense_mlp(tmp_path):
    """transformers 5 saves the dense layer's MLP as block_sparse_moe.{gate,up,down}_proj: same tensors."""
    from safetensors.torch import load_file
    a, b = model(1), model(2)
    save_weights(a, tmp_path)
    d = load_file(str(tmp_path / "model.safetensors"))
    for k in [k for k in d if k.startswith("model.layers.0.mlp.")]:
        d[k.replace(".mlp.", ".block_sparse_moe.")] = d.pop(k)
    save_file(d, str(tmp_path / "model.safetensors"))
    load_weights(b, tmp_path)
    assert same_params(a, b)
    d["model.layers.0.mlp.up_proj.weight"] = d["model.layers.0.block_sparse_moe.up_proj.weight"].clone()  # both spellings
    save_file(d, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightError, match="already holds"):
        load_weights(model(2), tmp_path)
    d.pop("model.layers.0.mlp.up_proj.weight")
    d["model.layers.3.block_sparse_moe.gate_proj.weight"] = d["model.layers.0.block_sparse_moe.gate_proj.weight"].clone()
    save_file(d, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightError, match=r"unexpected tensor 'model\.layers\.3\.block_sparse_moe\.gate_proj"):
        load_weights(model(2), tmp_path)  # an MoE layer has no dense MLP under either name


def test_default_prefill_step_is_the_largest_whose_activations_fit_beside_the_caches():
    """No --max-num-batched-tokens: 32K tokens per step where its activations fit in the room the caches
    leave, else 16K, else 8K; a user's value is kept (with a warning when it may not fit); tensor parallel
    takes the smallest (every rank the same, whatever each has free)."""
    import torch
    from peregrine.config import PREFILL_STEP_TOKENS, EngineConfig, resolve_model
    from peregrine.engine.parts import pick_step_tokens, step_bytes
    cfg, _ = resolve_model("kimi-linear-48b-a3b")
    bf = torch.bfloat16
    L = 40000  # max_model_len
    need = {n: step_bytes(cfg, n, L, bf) for n in PREFILL_STEP_TOKENS}
    assert need[32768] > need[16384] > need[8192] > 0
    # 48B widths: ~160 KB a token (the MoE's 8 sorted rows of 2·2304 + 3·1024 BF16), 1.5x slack
    assert 6e9 < need[32768] < 10e9, need[32768]
    warned = []
    pick = lambda room, want=None, tp=1, L=L: pick_step_tokens(  # noqa: E731
        EngineConfig(max_model_len=L, max_num_batched_tokens=want), cfg, bf, room, tp, warned.append)
    assert pick(None) == 32768                      # CPU: no memory check
    assert pick(need[32768]) == 32768
    assert pick(need[32768] - 1) == 16384
    assert pick(need[16384] - 1) == 8192
    assert pick(0) == 8192                          # nothing fits: the smallest
    assert pick(10 * need[32768], tp=2) == 8192
    assert pick(None, L=20000) == 20000 and pick(None, L=4096) == 8192  # no step outgrows a prompt or the pack
    assert not warned
    assert pick(need[16384], want=32768) == 32768 and "--max-num-batched-tokens" in warned[0]
    assert pick(need[8192], want=8192) == 8192 and len(warned) == 1


def test_an_engine_built_with_the_default_budget_prefills_a_prompt_in_one_step():
    from peregrine.config import EngineConfig
    from peregrine.engine import SamplingParams
    from peregrine.engine.build import build_engine
    e, _ = build_engine("tiny-kimi-linear", EngineConfig(max_model_len=600), dummy_weights=True, log=lambda m: None)
    assert e.scheduler.max_num_batched_tokens == 8192  # max_model_len 600: no prompt needs more than the pack
    e.add_request([10 + i % 200 for i in range(500)], SamplingParams(max_tokens=1))
    e.step()
    assert e.last_step.num_prefill_tokens == 500


def test_default_max_model_len_is_what_one_gpus_memory_holds():
    """No --max-model-len on one GPU: the longest context (whole blocks) whose max_num_seqs sequences' MLA cache and a
    prefill's context fit the share of the free memory, capped by the model's limit, never below the old default; the
    CPU (no memory to size by) keeps min(limit, 4096) and says so at start."""
    import torch
    from peregrine.cache import ModelCache
    from peregrine.config import EngineConfig, resolve_model
    from peregrine.engine.build import build_engine
    from peregrine.engine.parts import CONTEXT_MEMORY_SHARE, DEFAULT_MAX_MODEL_LEN, default_context, step_bytes
    cfg, _ = resolve_model("kimi-linear-48b-a3b")
    bf, ec = torch.bfloat16, EngineConfig(max_num_seqs=8)
    cost = lambda L: ModelCache.bytes_per_token(cfg, "auto", bf) * 8 * L + step_bytes(cfg, 0, L, bf)  # noqa: E731
    budget = 45 * 2**30  # an H100 at 0.9 after the MXFP4 48B's weights
    L = default_context(cfg, cfg, ec, bf, budget)
    room = budget * CONTEXT_MEMORY_SHARE
    assert L % ec.block_size == 0 and cost(L) <= room < cost(L + ec.block_size)
    assert 100_000 < L < cfg.max_position_embeddings  # agent traces' 24K-150K fit; the 1M limit does not
    assert default_context(cfg, cfg, ec, bf, 10**15) == cfg.max_position_embeddings
    assert default_context(cfg, cfg, ec, bf, 10**6) == DEFAULT_MAX_MODEL_LEN
    said = []
    e, _ = build_engine("tiny-kimi-linear", EngineConfig(), dummy_weights=True, log=said.append)
    assert e.max_model_len == 4096 and any(m.startswith("max_model_len 4096 (default") for m in said)


def test_a_hugging_face_id_resolves_through_its_cache_or_says_how_to_fetch_it(tmp_path, monkeypatch):
    """--model owner/name: the Hugging Face cache's main snapshot (as huggingface_hub lays it out), else a download,
    else one error naming where it looked and the command that fetches it."""
    import shutil

    import pytest
    from peregrine.config import PRESET_DIR, ConfigError, resolve_model
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    entry = tmp_path / "models--someone--tiny-kimi"
    snap = entry / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    shutil.copy(PRESET_DIR / "tiny-kimi-linear.json", snap / "config.json")
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("abc123")
    cfg, folder = resolve_model("someone/tiny-kimi")
    assert folder == snap and cfg.hidden_size == resolve_model("tiny-kimi-linear")[0].hidden_size

    import huggingface_hub

    def offline(model_id):
        raise OSError("no network")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ConfigError) as e:
        resolve_model("someone/not-here")
    assert str(tmp_path) in str(e.value) and "hf download someone/not-here" in str(e.value) and "no network" in str(e.value)


def test_weights_out_of_memory_is_one_error_line(monkeypatch, capsys):
    """Weights larger than the card end in one `error:` line that says what to do, not torch's traceback."""
    import peregrine.engine.parts as parts

    def too_big(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 98.00 GiB")
    monkeypatch.setattr(parts, "KimiModel", too_big)
    assert main(["generate", "--model", "tiny-kimi-linear", "--dummy-weights", "--max-tokens", "1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the weights of tiny-kimi-linear do not fit on cpu"), err
    assert "--tensor-parallel-size" in err[-1] and "Traceback" not in "\n".join(err)
