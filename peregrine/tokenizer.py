"""Tokenizers: HF `tokenizers` when the model folder has tokenizer.json,
otherwise byte-level (ids 0..255 are the UTF-8 bytes; the tiny presets use it)."""
from __future__ import annotations

from pathlib import Path

BYTE_VOCAB = 256


class ByteTokenizer:
    kind = "byte-level"

    def __init__(self, vocab_size: int):
        if vocab_size < BYTE_VOCAB:
            raise ValueError(f"byte-level tokenizer needs a vocabulary of at least {BYTE_VOCAB}, model has {vocab_size}")

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


class HFTokenizer:
    kind = "tokenizer.json"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(vocab_size: int, folder: Path | None):
    if folder is not None and (Path(folder) / "tokenizer.json").exists():
        return HFTokenizer(Path(folder) / "tokenizer.json")
    return ByteTokenizer(vocab_size)
