"""Kimi's tokenizer: byte-level BPE over `tiktoken.model` (mergeable ranks) with Kimi's
Han-aware pre-tokenisation and the special tokens of `tokenizer_config.json`.

The published Kimi folders ship no tokenizer.json: `tiktoken.model` holds one
"<base64 token bytes> <rank>" line per mergeable token (ranks are the ids), and the special
tokens (`[BOS]`, `<|im_end|>`, `<|im_user|>`, ... from id 163584 up) are named in
tokenizer_config.json's `added_tokens_decoder`. Ids past the mergeable ranks that it does not
name are reserved tokens, spelled `<|reserved_token_{id}|>` as Kimi's own tokenizer spells them.
Special-token text in the input encodes to the special id (Kimi's tokenizer does the same; the
chat template relies on it).
"""
from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path

from .config import ConfigError

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG = "tokenizer_config.json"

# Kimi's pre-tokenisation: runs of Han characters are pieces of their own; other letters split
# into case-aware words (with English contractions), digits in groups of up to 3, punctuation
# runs, newline runs and whitespace. `&&` is character-class intersection (tiktoken's regex engine).
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# tiktoken's Rust core panics on very long inputs and is quadratic on long runs without a split
# point (openai/tiktoken#195): text goes in slices of at most this many characters, and runs of
# whitespace or of non-whitespace are cut at this length (the limits Kimi's tokenizer uses).
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000


def read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken.model -> {token bytes: rank}; a malformed line is an error naming it."""
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected '<base64 token> <rank>'")
            tok, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error) as e:
            raise ConfigError(f"{path}: line {n} is not a tiktoken rank line ({e})") from None
        if tok in ranks:
            raise ConfigError(f"{path}: line {n} repeats the token of rank {ranks[tok]}")
        ranks[tok] = rank
    if not ranks:
        raise ConfigError(f"{path}: no mergeable ranks in the file")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ConfigError(f"{path}: ranks must be the ids 0..{len(ranks) - 1}, each once")
    return ranks


def token_content(v) -> str | None:
    """A token entry of tokenizer_config.json: a string, or an AddedToken dict with 'content'."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def read_tokenizer_config(folder: Path) -> dict:
    p = folder / TOKENIZER_CONFIG
    try:
        tc = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{folder} has {TIKTOKEN_FILE} but no {TOKENIZER_CONFIG}: its special tokens "
                          "(added_tokens_decoder) are defined there") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {p}: {e}") from None
    if not isinstance(tc, dict):
        raise ConfigError(f"{p}: expected a JSON object")
    return tc


def _pieces(text: str):
    """Slices tiktoken can take: at most MAX_ENCODE_CHARS, no whitespace or non-whitespace run
    longer than MAX_RUN_CHARS (cut where a run reaches the limit; the regex splits there anyway
    for whitespace, and very long non-whitespace runs have no natural split)."""
    for a in range(0, len(text), MAX_ENCODE_CHARS):
        s = text[a:a + MAX_ENCODE_CHARS]
        start, run, space = 0, 0, None
        for i, ch in enumerate(s):
            sp = ch.isspace()
            run = run + 1 if sp == space else 1
            space = sp
            if run > MAX_RUN_CHARS:
                yield s[start:i]
                start, run = i, 1
        yield s[start:]


class KimiTokenizer:
    kind = "tiktoken"
    exact_bytes = True  # every token, special ones too, is a byte string

    def __init__(self, folder: str | Path, vocab_size: int):
        try:
            import tiktoken
        except ImportError:
            raise ConfigError(f"{folder} holds a tiktoken tokenizer ({TIKTOKEN_FILE}): "
                              "install the tiktoken package (pip install tiktoken)") from None
        folder = Path(folder)
        ranks = read_ranks(folder / TIKTOKEN_FILE)
        tc = read_tokenizer_config(folder)
        nbase = len(ranks)
        if nbase > vocab_size:
            raise ConfigError(f"{folder / TIKTOKEN_FILE} has {nbase} tokens but the model's vocab_size is {vocab_size}")
        named: dict[int, str] = {}
        atd = tc.get("added_tokens_decoder") or {}
        if not isinstance(atd, dict):
            raise ConfigError(f"{folder / TOKENIZER_CONFIG}: 'added_tokens_decoder' must be an object of id -> token")
        for k, v in atd.items():
            content = token_content(v)
            if not str(k).isdigit() or content is None:
                raise ConfigError(f"{folder / TOKENIZER_CONFIG}: added_tokens_decoder entry {k!r} must map an id to "
                                  "{'content': str, ...}")
            i = int(k)
            if i < nbase:
                raise ConfigError(f"{folder / TOKENIZER_CONFIG}: special token {content!r} has id {i}, inside the "
                                  f"{nbase} mergeable ranks of {TIKTOKEN_FILE}")
            named[i] = content
        # every id the model can produce decodes to something: unnamed ones are reserved tokens
        top = max(vocab_size, max(named, default=0) + 1)
        self.special_tokens = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(nbase, top)}
        if len(self.special_tokens) != top - nbase:
            raise ConfigError(f"{folder / TOKENIZER_CONFIG}: two special tokens share one spelling")
        self.enc = tiktoken.Encoding(folder.name or "kimi", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                     special_tokens=self.special_tokens)
        self.num_base = nbase
        self.n_vocab = top
        self.special_ids = frozenset(self.special_tokens.values())
        self.config = tc
        self.bos_token = token_content(tc.get("bos_token"))
        self.eos_token = token_content(tc.get("eos_token"))

    def token_id(self, text: str) -> int | None:
        """The id of a special token's spelling (e.g. '<|im_end|>'), or None."""
        return self.special_tokens.get(text)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in _pieces(text):
            out += self.enc.encode(piece, allowed_special="all")
        return out

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(list(ids), errors="replace")

    def token_bytes(self, i: int) -> bytes:
        return self.enc.decode_single_token_bytes(i)
