"""Tokenizers, picked from what the model folder ships:

- `tokenizer.json`: HF `tokenizers`;
- `tiktoken.model` + `tokenizer_config.json`: Kimi's tiktoken tokenizer (kimi_tokenizer.py), the
  layout of the published Kimi checkpoints;
- neither: byte-level (ids 0..255 are the UTF-8 bytes), which only a byte-sized vocabulary (the
  tiny presets) or a run without real weights (a preset, --dummy-weights) may use. A real model
  folder with a large vocabulary and no tokenizer is an error: byte-level text in and out of a
  163 840-token model would be garbage.

Every tokenizer has encode, decode, token_bytes (one token's bytes, for logprobs; `exact_bytes`
when decode is exactly their concatenation, which lets stops.py detokenize byte by byte) and
`special_ids` (ids that are not text).
"""
from __future__ import annotations

from pathlib import Path

from .config import ConfigError
from .kimi_tokenizer import TIKTOKEN_FILE, KimiTokenizer

BYTE_VOCAB = 256
# largest vocabulary a byte-level tokenizer may serve without a tokenizer file: bytes plus a few
# specials (the tiny presets have 320); any real model's vocabulary is far larger
BYTE_LEVEL_MAX_VOCAB = 1024
TOKENIZER_JSON = "tokenizer.json"


class ByteTokenizer:
    kind = "byte-level"
    exact_bytes = True  # token_bytes are exactly what decode concatenates

    def __init__(self, vocab_size: int):
        if vocab_size < BYTE_VOCAB:
            raise ValueError(f"byte-level tokenizer needs a vocabulary of at least {BYTE_VOCAB}, model has {vocab_size}")
        self.special_ids = frozenset(range(BYTE_VOCAB, vocab_size))

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # ids past the byte range are special or unused tokens: shown, never silently dropped
        out, buf = [], bytearray()
        for i in ids:
            if 0 <= i < BYTE_VOCAB:
                buf.append(i)
            else:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append(f"<{i}>")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, i: int) -> bytes:
        return bytes([i]) if 0 <= i < BYTE_VOCAB else f"<{i}>".encode()


class HFTokenizer:
    kind = "tokenizer.json"
    exact_bytes = False  # a token's text may depend on its neighbours (SentencePiece's leading space)

    def __init__(self, path: Path):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(str(path))
        self.special_ids = frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self, i: int) -> bytes:
        # tokenizers has no byte view of a token: its text (a split character shows as U+FFFD)
        return self.decode([i]).encode("utf-8")


def load_tokenizer(vocab_size: int, folder: Path | None, dummy_weights: bool = False):
    """The folder's tokenizer; byte-level only where no real text goes through a large vocabulary."""
    if folder is not None:
        folder = Path(folder)
        if (folder / TOKENIZER_JSON).exists():
            return HFTokenizer(folder / TOKENIZER_JSON)
        if (folder / TIKTOKEN_FILE).exists():
            return KimiTokenizer(folder, vocab_size)
        if vocab_size > BYTE_LEVEL_MAX_VOCAB and not dummy_weights:
            raise ConfigError(f"model folder {folder} has no tokenizer for its {vocab_size}-token vocabulary: expected "
                              f"{TOKENIZER_JSON}, or {TIKTOKEN_FILE} with tokenizer_config.json (the Kimi layout)")
    return ByteTokenizer(vocab_size)
