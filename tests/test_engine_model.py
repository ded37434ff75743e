"""The engine over the real tiny model: batch invariance, cache pressure, tokenizer.json folders."""
import json

import pytest
import torch

from peregrine.cli import main
from peregrine.config import PRESET_DIR, EngineConfig
from peregrine.engine import SamplingParams
from peregrine.engine.build import build_engine


def tiny_engine(**kw):
    e, tok = build_engine("tiny-kimi-linear", EngineConfig(**kw), dummy_weights=True, log=lambda m: None)
    return e, tok


def test_batch_invariance_eight_prompts_of_different_lengths():
    """A request's greedy tokens are the same alone and inside a batch of 8 prompts (mixed prefill/decode steps)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 3, 7, 12, 20, 33, 5, 64)]
    eng, _ = tiny_engine(max_num_seqs=8, max_num_batched_tokens=40, block_size=16)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    together = eng.generate(prompts, params)
    assert eng.stats["steps_by_path"]["standard"] > 0
    for i in (0, 3, 7):
        alone, _ = tiny_engine(max_num_seqs=1, block_size=16)
        assert alone.generate([prompts[i]], params)[0] == together[i], f"prompt {i} depends on its batch"


def test_cache_pressure_all_requests_complete_and_resources_return():
    """Few cache blocks and slots, many requests: everything finishes, nothing is lost, caches are freed."""
    eng, _ = tiny_engine(max_num_seqs=3, num_cache_blocks=6, block_size=16, max_model_len=64)
    free0, slots0 = eng.prefix_cache.num_free, eng.cache.num_free_slots
    prompts = [[i + 1] * (5 + 3 * i) for i in range(9)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [len(o) for o in outs] == [12] * 9
    assert eng.stats["finished_requests"] == 9
    assert eng.prefix_cache.num_free == free0 and eng.cache.num_free_slots == slots0


def test_model_folder_with_tokenizer_json(tmp_path, capsys):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from peregrine.models.kimi import KimiModel
    from peregrine.models.loader import init_dummy_weights, save_weights
    from peregrine.config import ModelConfig

    words = ["[unk]", "hello", "world", "peregrine", "falcon", "fast"]
    tk = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[unk]"))
    tk.pre_tokenizer = Whitespace()
    tk.save(str(tmp_path / "tokenizer.json"))
    raw = json.loads((PRESET_DIR / "tiny-kimi-linear.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw))
    m = KimiModel(ModelConfig.from_dict(raw), torch.float32)
    init_dummy_weights(m, 0)
    save_weights(m, tmp_path)
    eng, tok = build_engine(str(tmp_path), EngineConfig(), log=lambda m: None)
    assert tok.kind == "tokenizer.json" and tok.encode("hello peregrine world") == [1, 3, 2]
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hello falcon", "--max-tokens", "3", "--quiet"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == tok.decode(eng.generate([[1, 4]], SamplingParams(max_tokens=3))[0])


@pytest.mark.parametrize("bad,msg", [
    (dict(prompt_ids=[]), "empty"),
    (dict(prompt_ids=[1] * 70), "max_model_len"),
    (dict(prompt_ids=[999]), r"prompt token ids must be ints in \[0, 320\)"),
    (dict(prompt_ids=[1], temperature=-1.0), "temperature"),
    (dict(prompt_ids=[1], top_p=0.0), "top_p"),
    (dict(prompt_ids=[1], max_tokens=0), "max_tokens"),
])
def test_bad_requests_get_clear_errors(bad, msg):
    from peregrine.engine import RequestError
    eng, _ = tiny_engine(max_model_len=64)
    ids = bad.pop("prompt_ids")
    with pytest.raises(RequestError, match=msg):
        eng.add_request(ids, SamplingParams(**bad))
    assert not eng.has_unfinished()
