"""Replay: drafters measured on recorded, agent-shaped text at the engine's real cost (#43 item 4).

With dummy weights the model's own output is noise, so no drafter is accepted. In replay the engine still runs
every step, plain or verify, but the token each request emits is forced to the next token of a recorded
session (engine.forced). A drafter's acceptance on that text and the verify steps' real cost are then measured
together.

The sessions are coding-agent shaped and built from this package's own source. A system prompt comes first.
Each turn appends a file and a tool's output to the context. The reply quotes a function of that file with one
identifier renamed, then a short summary, as an agent's edit does. The context grows turn by turn, so input
lengths grow to --replay-context tokens.
"""
from __future__ import annotations

import keyword
import random
import re
import time
from pathlib import Path

SYSTEM = ("You are a coding agent working in the peregrine repository. Read the files you are given, answer with "
          "the edited code in full, then one line saying what changed.\n")
PKG = Path(__file__).resolve().parents[1]


def _functions(text: str) -> list[str]:
    """Top-level and method definitions of a Python file, each with its body (by indentation)."""
    lines, out = text.splitlines(), []
    for i, ln in enumerate(lines):
        m = re.match(r"(\s*)def \w+\(", ln)
        if not m:
            continue
        ind, body = len(m.group(1)), [ln]
        for nxt in lines[i + 1:]:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= ind:
                break
            body.append(nxt)
        if 4 <= len(body) <= 40:
            out.append("\n".join(body).rstrip() + "\n")
    return out


# GPT-2-style pre-tokenisation (letters, up to 3 digits, other symbols, whitespace; a leading space kept)
PIECE = re.compile(r"""'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")
FIRST_PIECE_ID = 1024  # piece ids start past the byte range and run upward, far below a large vocabulary's specials


class PieceTokenizer:
    """The replay's tokens for a model folder without its tokenizer (dummy weights: a byte-level stand-in, whose
    tokens are 3-4x finer than a real BPE's on code, so acceptance and lengths would be off by that much). Each
    pre-tokenised piece is one token (a large-vocabulary BPE's granularity on common words; rare identifiers would
    split further), ids given in order of first appearance: deterministic for the same text."""
    kind = "pieces"

    def __init__(self, vocab_size: int):
        self.vocab_size, self.ids = vocab_size, {}

    def encode(self, text: str) -> list[int]:
        out = []
        for p in PIECE.findall(text):
            i = self.ids.get(p)
            if i is None:
                i = self.ids[p] = FIRST_PIECE_ID + len(self.ids)
                if i >= self.vocab_size // 2:
                    raise ValueError(f"the replay's text has more distinct pieces than half of the vocabulary "
                                     f"({self.vocab_size}): lower --replay-context")
            out.append(i)
        return out


def replay_encoder(tok, vocab_size: int):
    """The model's own tokenizer, or pieces where it is only the byte-level stand-in of a large vocabulary."""
    return PieceTokenizer(vocab_size) if tok.kind == "byte-level" and vocab_size > 4 * FIRST_PIECE_ID else tok


def agent_sessions(n_sessions: int, turns: int, seed: int = 0, max_chars: int = 120_000) -> list[list[tuple[str, str]]]:
    """n_sessions sessions of `turns` (context, reply) text pairs; each context holds the whole session so far."""
    rng = random.Random(seed)
    files = sorted(p for p in PKG.rglob("*.py") if p.stat().st_size > 2000)
    sessions = []
    for _ in range(n_sessions):
        ctx, pairs = SYSTEM, []
        for _t in range(turns):
            for _try in range(100):  # a file whose shown part holds a whole function
                f = rng.choice(files)
                text = f.read_text()[:max_chars // max(turns, 1)]  # what the context shows: the reply quotes it
                funcs = _functions(text)
                if funcs:
                    break
            else:
                raise ValueError(f"no file shows a whole function within {max_chars // max(turns, 1)} characters")
            fn = rng.choice(funcs)
            names = sorted(n for n in set(re.findall(r"\b[a-z_][a-z0-9_]{3,}\b", fn))
                           if not keyword.iskeyword(n) and n != "self")
            old = rng.choice(names) if names else "x"
            reply = (f"Here is `{fn.split('(')[0].split()[-1]}` with `{old}` renamed:\n```python\n"
                     + re.sub(rf"\b{old}\b", old + "_v2", fn) + f"```\nRenamed `{old}` to `{old}_v2`; nothing else changed.\n")
            ctx += f"\n$ cat {f.relative_to(PKG.parent)}\n{text}\n$ python -m pytest -q -x\n" \
                   f"{rng.randrange(40, 400)} passed in {rng.uniform(2, 90):.1f}s\nUser: rename `{old}` in that function.\n"
            pairs.append((ctx, reply))
            ctx += reply
        sessions.append(pairs)
    return sessions


def replay(engine, sessions, encode, label: str, log=print, sampling: dict | None = None) -> dict:
    """Run every session's turns one request at a time (B = 1) with each reply forced; -> per-turn records and
    the totals: tokens, seconds, tok/s/user, drafts and accepted tokens. sampling: SamplingParams fields the
    requests take (temperature, top_p; default greedy)."""
    from ..engine.request import SamplingParams
    turns, sp = [], engine.spec
    for si, pairs in enumerate(sessions):
        for ti, (ctx, reply) in enumerate(pairs):
            prompt, forced = encode(ctx), encode(reply)
            rid = f"replay-{label}-{si}-{ti}"
            engine.forced[rid] = forced
            d0 = (sp.stats["num_drafts"], sp.stats["num_accepted_tokens"]) if sp else (0, 0)
            w0 = list(sp.stats["width_steps"]) if sp else []
            first = []
            t0 = time.perf_counter()

            def cb(o, first=first):
                if not first and o.new_token_ids:
                    first.append(time.perf_counter())
            params = SamplingParams(max_tokens=len(forced), ignore_eos=True, seed=si * 1000 + ti, **(sampling or {}))
            engine.add_request(prompt, params, request_id=rid, on_token=cb)
            while engine.has_unfinished():
                engine.step()
            t_end = time.perf_counter()
            engine.forced.pop(rid, None)
            t_first = first[0] if first else t_end
            decode_s = t_end - t_first  # after the first token: the part speculation can speed up
            drafts, acc = ((sp.stats["num_drafts"] - d0[0], sp.stats["num_accepted_tokens"] - d0[1]) if sp else (0, 0))
            turns.append({"session": si, "turn": ti, "input_tokens": len(prompt), "output_tokens": len(forced),
                          "ttft_s": t_first - t0, "decode_s": decode_s,
                          "tok_s_user": (len(forced) - 1) / decode_s if decode_s > 0 else None,
                          "drafts": drafts, "accepted": acc,
                          "acceptance_length": 1 + acc / drafts if drafts else None,
                          # decode steps by the verify width the chooser took (0: plain); all 0 without a cost table (full width)
                          "width_steps": [b - a for a, b in zip(w0, sp.stats["width_steps"])] if sp else []})
    dec = sum(t["decode_s"] for t in turns)
    out = sum(t["output_tokens"] - 1 for t in turns)
    drafts, acc = sum(t["drafts"] for t in turns), sum(t["accepted"] for t in turns)
    res = {"label": label, "turns": turns, "tok_s_user": out / dec if dec > 0 else None,
           "acceptance_length": 1 + acc / drafts if drafts else None, "drafts": drafts, "accepted": acc}
    log(f"  replay {label:>10}: {res['tok_s_user'] or 0:.1f} tok/s/user after the first token"
        + (f", acceptance length {res['acceptance_length']:.2f}" if drafts else ""))
    return res
