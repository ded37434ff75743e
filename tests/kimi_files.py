"""A small Kimi-layout tokenizer the tests write themselves: tiktoken.model (mergeable ranks),
tokenizer_config.json (special tokens at Kimi's offsets past the ranks, a Kimi-shaped chat
template) and generation_config.json; plus an independent byte-level BPE to check encodings against.

The reference BPE shares nothing with peregrine or tiktoken: pre-tokenisation by the `regex`
module (its V1 mode reads `&&` as class intersection), then merging the adjacent pair whose bytes
have the lowest rank until none is left, a piece that is itself a token taken whole.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

import regex

# merges in rank order; every token is the concatenation of two earlier ones
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), (" ", "w"), ("o", "r"), (" w", "or"), ("l", "d"),
          (" wor", "ld"), ("'", "m"), ("1", "2"), ("12", "3"), ("H", "e"), ("He", "ll"), ("Hell", "o"), (" ", "H"),
          ("W", "or"), ("Wor", "ld"), ("\n", "\n"), ("a", "b"), ("ab", "c"),
          # Han characters are three UTF-8 bytes: 中 = e4 b8 ad, 文 = e6 96 87
          (b"\xe4", b"\xb8"), (b"\xe4\xb8", b"\xad"), (b"\xe6", b"\x96"), (b"\xe6\x96", b"\x87"), ("中", "文"),
          # a token across a Latin/Han boundary: Kimi's pattern never lets the two meet in one piece
          ("c", "中")]
# Kimi's special ids sit at these offsets past the mergeable ranks (163584 + k in the published files)
SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 10: "<|im_system|>",
            17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}
# Kimi-Linear / K2's tool-call markers (163595.. in the published files)
TOOL_SPECIALS = {11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
                 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>"}
# Kimi K3's specials: its XTML markup's brackets and its end of message (163584.. in K3's files)
K3_SPECIALS = {0: "[BOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>", 254: "[UNK]", 255: "[PAD]"}
NUM_RESERVED = 256  # ids past the ranks the model's vocabulary keeps for special tokens
# a chat template of Kimi's shape, written for these tests
TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ m['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")


def _b(x) -> bytes:
    return x if isinstance(x, bytes) else x.encode()


def ranks() -> dict[bytes, int]:
    r = {bytes([i]): i for i in range(256)}
    for a, b in MERGES:
        a, b = _b(a), _b(b)
        assert a in r and b in r, (a, b)
        r[a + b] = len(r)
    return r


def write_tokenizer(folder: Path, template: bool | str = True, generation_eos=None, specials: dict | None = None) -> dict:
    """-> {spelling: id} of the special tokens written. template: True (TEMPLATE), a template's text, or False;
    specials: {offset: spelling} (default SPECIALS; SPECIALS | TOOL_SPECIALS for Kimi-Linear's tool markers)."""
    specials = SPECIALS if specials is None else specials
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    r = ranks()
    (folder / "tiktoken.model").write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for t, i in r.items()))
    n = len(r)
    atd = {str(n + k): {"content": v, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": True} for k, v in specials.items()}
    tc = {"added_tokens_decoder": atd, "bos_token": "[BOS]", "eos_token": specials.get(1, specials.get(2)),
          "pad_token": "[PAD]", "unk_token": "[UNK]", "tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576}
    if template:
        tc["chat_template"] = TEMPLATE if template is True else template
    (folder / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
    if generation_eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos, "bos_token_id": n}))
    return {v: n + k for k, v in specials.items()}


def vocab_size() -> int:
    return len(ranks()) + NUM_RESERVED


# ---- the reference ----------------------------------------------------------
def _bpe(piece: bytes, r: dict[bytes, int]) -> list[int]:
    if piece in r:
        return [r[piece]]
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            rk = r.get(parts[i] + parts[i + 1])
            if rk is not None and (best is None or rk < best[0]):
                best = (rk, i)
        if best is None:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [r[p] for p in parts]


def reference_encode(text: str, pat_str: str, specials: dict[str, int]) -> list[int]:
    r = ranks()
    pat = regex.compile("(?V1)" + pat_str)
    split = regex.compile("(" + "|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")")
    out: list[int] = []
    for chunk in split.split(text):
        if chunk in specials:
            out.append(specials[chunk])
        elif chunk:
            for piece in pat.findall(chunk):
                out += _bpe(piece.encode(), r)
    return out
