"""A request's output text, built token by token: incremental detokenizing and stop strings.

The engine works on token ids; stop strings live in the text. Each accepted token's text is
appended (a character split over tokens waits for its last byte), every stop string is searched
for where it could end in the new text, and the text that could still be the start of a stop
string is held back from the stream. At a match the text is cut before the stop string and the
request finishes with reason "stop", at the token that completed it, however the string was split
over tokens. A stop string only counts once `min_tokens` tokens have been produced (as an end id).
"""
from __future__ import annotations

import codecs

REPLACEMENT = "\ufffd"  # a split character decodes to it until its last byte arrives (text-only tokenizers)


class Detokenizer:
    """Token ids -> text, one token at a time. Tokenizers with token_bytes decode exactly through an
    incremental UTF-8 decoder; others re-decode the whole output and hold back a trailing U+FFFD."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.bytes_of = getattr(tokenizer, "token_bytes", None)
        if self.bytes_of is not None:
            self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            self.ids: list[int] = []
            self.sent = ""

    def push(self, tok: int) -> str:
        if self.bytes_of is not None:
            return self.utf8.decode(self.bytes_of(tok))
        self.ids.append(tok)
        text = self.tok.decode(self.ids).rstrip(REPLACEMENT)
        if not text.startswith(self.sent):  # the decoder changed its mind on earlier text: wait
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def flush(self) -> str:
        if self.bytes_of is not None:
            return self.utf8.decode(b"", final=True)
        text = self.tok.decode(self.ids)
        return text[len(self.sent):] if text.startswith(self.sent) else ""


class TextState:
    """Output text of one sequence: `take()` hands out the text that is final so far."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.detok = Detokenizer(tokenizer)
        self.stops = tuple(stop)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""          # everything decoded so far (cut at the stop string once matched)
        self.released = 0       # chars of `text` that are final (handed out or ready to be)
        self.taken = 0          # chars handed out by take()
        self.stop_str: str | None = None
        self.done = False

    def add(self, tok: int, may_stop: bool = True) -> bool:
        """Append a token's text; True when it completed a stop string (text is then cut before it)."""
        if self.done:
            return self.stop_str is not None
        old = len(self.text)
        self.text += self.detok.push(tok)
        if may_stop and self.stops and len(self.text) > old:
            hit = self._match(old)
            if hit is not None:
                at, self.stop_str = hit
                self.text, self.released, self.done = self.text[:at], at, True
                return True
        self.released = len(self.text) - self._held()
        return False

    def _match(self, old: int) -> tuple[int, str] | None:
        """The earliest stop string ending in text[old:] -> (its start, the string)."""
        lo = max(0, old - self.longest + 1)
        best = None
        for s in self.stops:
            at = self.text.find(s, lo)
            while at != -1 and at + len(s) <= old:  # ended in text already checked: look further on
                at = self.text.find(s, at + 1)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        return best

    def _held(self) -> int:
        """Length of the longest tail of the text that begins some stop string: it may yet become one."""
        t = self.text
        for n in range(min(self.longest - 1, len(t)), 0, -1):
            tail = t[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def finish(self) -> None:
        """The sequence ended without a stop string (end id, length, abort): all text is final."""
        if not self.done:
            self.text += self.detok.flush()
            self.released, self.done = len(self.text), True

    def take(self) -> str:
        """The final text not handed out yet."""
        out = self.text[self.taken:self.released]
        self.taken = self.released
        return out
