"""Kimi's tiktoken tokenizer on a small tiktoken.model the tests write (kimi_files.py), against an
independent BPE; the folder rules (which tokenizer, and when a missing one is an error);
generation_config.json's end ids; the chat template from tokenizer_config.json."""
import json
import re

import pytest
import torch

from kimi_files import SPECIALS, ranks, reference_encode, vocab_size, write_tokenizer
from peregrine.config import PRESET_DIR, ConfigError, EngineConfig, resolve_model
from peregrine.kimi_tokenizer import KIMI_PAT_STR, MAX_RUN_CHARS, KimiTokenizer, _pieces
from peregrine.tokenizer import ByteTokenizer, load_tokenizer

TEXTS = [
    "hello world",
    "Hello world, I'm here!  12345 678\n\n  x\t",
    "HelloWorld HELLO hello",
    "中文abc中 中文 abc中文",
    "naïve café — ünïcödé ✓ 🦅",
    "<|im_user|>user<|im_middle|>hello<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "[BOS]hello[EOS] <|reserved_token_%d|>" % (len(ranks()) + 100),
    "   \n\n\n   trailing   ",
    "",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("kimi_tok")
    write_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(folder):
    return KimiTokenizer(folder, vocab_size())


def specials_of(tok):
    return dict(tok.special_tokens)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_reference_bpe_and_round_trips(tok, text):
    ids = tok.encode(text)
    assert ids == reference_encode(text, KIMI_PAT_STR, specials_of(tok))
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_pre_tokenisation_is_kimis(tok):
    """What the Han-aware pattern must do, written out by hand (independent of the pattern string)."""
    r = ranks()
    piece = lambda s: r[s.encode()]  # noqa: E731
    # Han runs are pieces of their own: the vocabulary's 'c中' token never forms across the boundary
    assert tok.encode("abc中") == [piece("abc"), piece("中")]
    assert piece("c中") not in tok.encode("xc中文")
    # digits go in groups of at most three; case changes split words; contractions stay attached
    assert tok.encode("12345") == [piece("123"), r[b"4"], r[b"5"]]
    assert tok.encode("HelloWorld") == [piece("Hello"), piece("World")]
    assert tok.encode("I'm")[-1] == piece("'m")


def test_special_tokens_and_reserved_ids(tok):
    n = len(ranks())
    for k, name in SPECIALS.items():
        assert tok.token_id(name) == n + k and tok.encode(name) == [n + k] and tok.decode([n + k]) == name
    assert tok.decode([n + 5]) == f"<|reserved_token_{n + 5}|>"  # unnamed: Kimi's reserved spelling
    assert tok.n_vocab == vocab_size() and tok.special_ids == frozenset(range(n, vocab_size()))
    assert (tok.bos_token, tok.eos_token) == ("[BOS]", "[EOS]")


def test_long_runs_are_cut_for_tiktoken(tok):
    text = "a" * (MAX_RUN_CHARS + 10) + " " * (MAX_RUN_CHARS + 5) + "b"
    pieces = list(_pieces(text))
    runs = [len(m.group()) for p in pieces for m in re.finditer(r"\s+|\S+", p)]
    assert "".join(pieces) == text and len(pieces) == 3 and max(runs) == MAX_RUN_CHARS
    assert tok.decode(tok.encode(text)) == text


def test_folder_rules(tmp_path, folder):
    raw = json.loads((PRESET_DIR / "kimi-linear-48b-a3b.json").read_text())
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"no tokenizer for its 163840-token vocabulary.*tiktoken\.model"):
        load_tokenizer(163840, big)
    from peregrine.engine.build import build_engine
    with pytest.raises(ConfigError, match="tiktoken.model"):  # before any weight is looked for
        build_engine(str(big), EngineConfig(), log=lambda m: None)
    assert isinstance(load_tokenizer(163840, big, dummy_weights=True), ByteTokenizer)  # no real text: ids only
    assert isinstance(load_tokenizer(163840, None), ByteTokenizer)  # a preset without weights
    assert isinstance(load_tokenizer(320, tmp_path), ByteTokenizer)  # a byte-sized vocabulary
    assert isinstance(load_tokenizer(vocab_size(), folder), KimiTokenizer)
    # a tiktoken.model without its special tokens, a broken line, a special id inside the ranks, too small a vocab
    half = tmp_path / "half"
    half.mkdir()
    (half / "tiktoken.model").write_bytes((folder / "tiktoken.model").read_bytes())
    with pytest.raises(ConfigError, match="no tokenizer_config.json"):
        load_tokenizer(vocab_size(), half)
    (half / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"5": {"content": "<x>"}}}))
    with pytest.raises(ConfigError, match="inside the"):
        load_tokenizer(vocab_size(), half)
    with pytest.raises(ConfigError, match="vocab_size is 100"):
        load_tokenizer(100, folder)
    (half / "tiktoken.model").write_bytes(b"aGk= 0\nnot-base64!! 1\n")
    with pytest.raises(ConfigError, match="line 2"):
        load_tokenizer(vocab_size(), half)


def test_generation_config_end_ids(tmp_path):
    raw = json.loads((PRESET_DIR / "tiny-kimi-linear.json").read_text())
    raw["eos_token_id"] = [257, 300]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [301, 257], "temperature": 0.6}))
    cfg, _ = resolve_model(str(tmp_path))
    assert cfg.eos_token_id == 257 and cfg.eos_token_ids == (257, 300, 301)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ConfigError, match="eos_token_id"):
        resolve_model(str(tmp_path))


def test_chat_template_from_tokenizer_config(folder, tmp_path):
    from peregrine.server.chat import ChatTemplate
    t = ChatTemplate(folder)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    want = ("<|im_system|>system<|im_middle|>be brief<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>")
    assert t.kind.startswith("model") and t.render(msgs) == want
    # chat_template.jinja (what transformers writes now) wins over tokenizer_config.json's
    (tmp_path / "tokenizer_config.json").write_text((folder / "tokenizer_config.json").read_text())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}{% endfor %}")
    assert ChatTemplate(tmp_path).render(msgs[1:] + [{"role": "user", "content": "<&>"}]) == '[user]"hi"[user]"<&>"'
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTemplate(tmp_path)


def test_kimi_folder_end_to_end_through_the_engine(tmp_path):
    """A folder in the published layout (config.json, safetensors, tiktoken.model, tokenizer_config.json,
    generation_config.json) builds with the Kimi tokenizer; text in and out goes through it."""
    from conftest import write_dummy_model
    from peregrine.engine import SamplingParams
    from peregrine.engine.build import build_engine
    raw = json.loads((PRESET_DIR / "tiny-kimi-linear.json").read_text())
    n = len(ranks())
    raw.update(vocab_size=vocab_size(), bos_token_id=n, eos_token_id=n + 2, pad_token_id=n + 255)
    write_dummy_model(tmp_path, raw, seed=3)
    write_tokenizer(tmp_path, generation_eos=[n + 2, n + 1])
    eng, tok = build_engine(str(tmp_path), EngineConfig(dtype="fp32", max_model_len=64), log=lambda m: None)
    assert tok.kind == "tiktoken" and eng.model_cfg.eos_token_ids == (n + 2, n + 1)
    ids = tok.encode("<|im_user|>user<|im_middle|>hello world<|im_end|>")
    assert ids[0] == n + 3 and ids[-1] == n + 2
    out = eng.generate([ids], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out) == 6 and all(0 <= t < vocab_size() for t in out)
    got = []
    eng.add_request(ids, SamplingParams(max_tokens=6, ignore_eos=True), "t", got.append)
    while eng.has_unfinished():
        eng.step()
    assert "".join(o.text_delta for o in got) == got[-1].text == tok.decode(out)
    assert torch.equal(torch.tensor(got[-1].output_token_ids), torch.tensor(out))
