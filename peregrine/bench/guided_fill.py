"""The host's cost of structured output per token (engine/guided.py): xgrammar's next-token bitmask fill and its
accept, over a Kimi-sized vocabulary, for the grammars a request brings (a JSON schema, any JSON object, a regex),
walked through a valid answer token by token. It runs on the host between two decode steps, so it is judged
against the step: the 48B's B = 1 step is ~2.9 ms on an H100 (results/2026-12-06-session32), and #66 wants a
constrained step within 1.05x of it, i.e. ~145 us of host work a token if none of it hides behind the step.

The vocabulary: without Kimi's real tiktoken file here, VOCAB byte strings shaped like a byte-level BPE's (the 256
bytes, then random printable and UTF-8 pieces of 2-12 bytes, some with a leading space), seeded.
    python -m peregrine.bench.guided_fill [--vocab 163840] [--results-dir results]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

VOCAB = 163_840  # Kimi-Linear's and K3's vocabulary
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "city": {"type": "string"}, "days": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
    "required": ["name", "city", "days", "tags", "ok"], "additionalProperties": False}
ANSWER = {"name": "peregrine falcon", "city": "Paris", "days": 14, "tags": ["fast", "raptor", "coding agent"], "ok": True}
PATTERN = r"\d{4}-\d{2}-\d{2} [A-Z][a-z]+ [a-z ]{3,40}\."
PATTERN_ANSWER = "2026-12-06 Falcons fly over the river today."


def vocabulary(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.,:;\"'{}[]()<>=+-*/ \n\t"
    out, seen = [bytes([b]) for b in range(256)], set()
    while len(out) < n:
        k = rng.randint(2, 12)
        s = ("" if rng.random() < 0.6 else " ") + "".join(rng.choice(alphabet) for _ in range(k))
        if rng.random() < 0.05:
            s += rng.choice("éüßçñøåж中文字")
        b = s.encode()
        if b not in seen:
            seen.add(b)
            out.append(b)
    return out


def greedy_tokens(text: str, vocab: list[bytes]) -> list[int]:
    """The text as the longest vocabulary pieces, left to right (a tokenization the grammar walk can follow)."""
    index = {b: i for i, b in enumerate(vocab)}
    data, out, at = text.encode(), [], 0
    longest = max(len(b) for b in vocab)
    while at < len(data):
        for k in range(min(longest, len(data) - at), 0, -1):
            i = index.get(data[at:at + k])
            if i is not None:
                out.append(i)
                at += k
                break
    return out


def walk(xgr, compiled, tokens: list[int], vocab_size: int) -> dict:
    """Fill and accept along the answer: per-token microseconds of each."""
    import torch
    m = xgr.GrammarMatcher(compiled)
    mask = torch.empty(1, (vocab_size + 31) // 32, dtype=torch.int32)
    fill, accept = [], []
    for t in tokens:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask, 0)
        t1 = time.perf_counter()
        ok = m.accept_token(t)
        t2 = time.perf_counter()
        assert ok, f"token {t} refused: the answer must be in the grammar"
        fill.append((t1 - t0) * 1e6)
        accept.append((t2 - t1) * 1e6)
    return {"tokens": len(tokens), "fill_us": summary(fill), "accept_us": summary(accept), "fill_samples_us": fill}


def summary(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"p50": statistics.median(s), "p90": s[int(0.9 * (len(s) - 1))], "max": s[-1], "mean": statistics.fmean(s)}


def run(vocab_size: int) -> dict:
    import xgrammar as xgr
    vocab = vocabulary(vocab_size)
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[vocab_size - 1])
    compiler = xgr.GrammarCompiler(info)
    t_info = time.perf_counter() - t0
    rows = {}
    for name, make, text in (
            ("json_schema", lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True,
                                                                  max_whitespace_cnt=64), json.dumps(ANSWER)),
            ("json_object", lambda: compiler.compile_json_schema('{"type": "object"}', any_whitespace=True,
                                                                  max_whitespace_cnt=64), json.dumps(ANSWER)),
            ("regex", lambda: compiler.compile_regex(PATTERN), PATTERN_ANSWER)):
        t0 = time.perf_counter()
        compiled = make()
        rows[name] = {"compile_ms": (time.perf_counter() - t0) * 1e3} | walk(xgr, compiled, greedy_tokens(text, vocab),
                                                                              vocab_size)
    return {"vocab_size": vocab_size, "tokenizer_info_s": t_info, "grammars": rows}


def main(argv=None) -> int:
    import os
    import platform
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args(argv)
    from .gpu import git_commit, write_result
    from pathlib import Path
    out = run(a.vocab)
    out["meta"] = {"command": "python -m peregrine.bench.guided_fill " + " ".join(argv or []), "commit": git_commit(),
                   "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                   "xgrammar": __import__("importlib.metadata").metadata.version("xgrammar")}
    for name, r in out["grammars"].items():
        print(f"{name:>12}: compile {r['compile_ms']:.1f} ms; per token fill p50 {r['fill_us']['p50']:.1f} us "
              f"(p90 {r['fill_us']['p90']:.1f}, max {r['fill_us']['max']:.1f}), accept p50 {r['accept_us']['p50']:.1f} us "
              f"over {r['tokens']} tokens")
    path = write_result(Path(a.results_dir) / f"{time.strftime('%Y-%m-%d')}-cpu-guided-fill.json", out)
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
