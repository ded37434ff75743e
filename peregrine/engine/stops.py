"""A request's output text, built token by token: incremental detokenizing and stop strings.

The engine works on token ids; stop strings live in the text. Each accepted token's text is
appended (a character split over tokens waits for its last byte), every stop string is searched
for where it could end in the new text, and the text that could still be the start of a stop
string is held back from the stream. At a match the text is cut before the stop string and the
request finishes with reason "stop", at the token that completed it, however the string was split
over tokens. A stop string only counts once `min_tokens` tokens have been produced (as an end id).
Work per token is bounded by the new text and the longest stop string, not the output so far.
"""
from __future__ import annotations

import codecs

REPLACEMENT = "\ufffd"  # what a character split over tokens decodes to until its last byte arrives


class Detokenizer:
    """Token ids -> text, one token at a time.

    Tokenizers whose tokens are exact byte strings (`exact_bytes`: byte-level, Kimi's tiktoken) go
    through an incremental UTF-8 decoder. Others (tokenizer.json: a token's text can depend on its
    neighbours, e.g. SentencePiece's leading space) decode a short window, the tokens since the last
    text, against the same window without the new token; a trailing U+FFFD waits for more tokens."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.exact = getattr(tokenizer, "exact_bytes", False)
        if self.exact:
            self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            self.ids: list[int] = []
            self.start = self.read = 0  # window start; tokens before `read` are already text

    def push(self, tok: int) -> str:
        if self.exact:
            return self.utf8.decode(self.tok.token_bytes(tok))
        self.ids.append(tok)
        return self._window(final=False)

    def _window(self, final: bool) -> str:
        prev = self.tok.decode(self.ids[self.start:self.read])
        cur = self.tok.decode(self.ids[self.start:])
        if (not final and cur.endswith(REPLACEMENT)) or not cur.startswith(prev):
            return ""  # an unfinished character, or the decoder changed its mind: wait
        self.start, self.read = self.read, len(self.ids)
        return cur[len(prev):]

    def flush(self) -> str:
        if self.exact:
            return self.utf8.decode(b"", final=True)
        return self._window(final=True) if self.read < len(self.ids) else ""


class TextState:
    """Output text of one sequence: `take()` hands out the text that is final so far."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.detok = Detokenizer(tokenizer)
        self.stops = tuple(stop)
        self.keep = max((len(s) for s in self.stops), default=1) - 1  # tail chars a stop string may start in
        self.firsts = frozenset(s[0] for s in self.stops)
        self.window = ""        # the last `keep` chars of the text: matches across token boundaries
        self.pending = ""       # text not handed out yet; its first `ready` chars are final
        self.ready = 0
        self.given: list[str] = []  # text handed out
        self.stop_str: str | None = None
        self.done = False

    def add(self, tok: int, may_stop: bool = True) -> bool:
        """Append a token's text; True when it completed a stop string (the text is cut before it)."""
        if self.done:
            return self.stop_str is not None
        delta = self.detok.push(tok)
        if not delta:
            return False
        if not self.stops:
            self.pending += delta
            self.ready = len(self.pending)
            return False
        w = self.window + delta
        hit = self._match(w) if may_stop else None
        if hit is not None:
            at, self.stop_str = hit
            # the cut starts inside held-back text (a stop string's start is never released early)
            self.pending = (self.pending + delta)[:len(self.pending) + len(delta) - (len(w) - at)]
            self.ready, self.done = len(self.pending), True
            return True
        self.pending += delta
        self.window = w[-self.keep:] if self.keep else ""
        self.ready = len(self.pending) - self._held()
        return False

    def _match(self, w: str) -> tuple[int, str] | None:
        """The earliest stop string that ends in the new text (past the window) -> (start in w, it)."""
        best = None
        for s in self.stops:
            at = w.find(s, max(0, len(self.window) - len(s) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        return best

    def _held(self) -> int:
        """Length of the longest tail of the text that begins some stop string: it may yet become one. Only
        tails starting with some stop string's first character are compared (a scan per character, not a
        comparison with every stop string)."""
        t = self.window
        for i in range(max(0, len(t) - self.keep), len(t)):
            if t[i] in self.firsts and any(s.startswith(t[i:]) for s in self.stops):
                return len(t) - i
        return 0

    def finish(self) -> None:
        """The sequence ended without a stop string (end id, length, abort): all text is final."""
        if not self.done:
            self.pending += self.detok.flush()
            self.ready, self.done = len(self.pending), True

    def take(self) -> str:
        """The final text not handed out yet."""
        out, self.pending = self.pending[:self.ready], self.pending[self.ready:]
        self.ready = 0
        self.given.append(out)
        return out

    @property
    def text(self) -> str:
        """Everything handed out so far (all of the text once finished and taken)."""
        return "".join(self.given)
