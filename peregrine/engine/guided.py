"""Structured output and logit_bias: a request's next token held to its grammar, its chosen logits biased.

A request with SamplingParams.guided (a JSON schema, any JSON object, a regex, a choice of strings, an EBNF
grammar) gets an xgrammar matcher when it is added (its grammar compiled then, once per distinct grammar: one that
does not compile is that request's 400). Before each draw of its token the matcher fills the row's token bitmask
(bit t of word t // 32: token t allowed) on the host; the draw then sees -inf wherever the bit is clear: on the
device (decode/head.py: after the step, or for a biased row inside its graph, a variant of its own, so unconstrained
batches keep theirs) or on the host where the host draws. Every accepted token advances the matcher;
a grammar that reached its end (the stop token accepted) ends the request. logit_bias (token -> bias) is added to
the logits before the mask, on the same two paths (StepInput.logit_bias: ids and values, padded to the batch's
longest). A step with a constrained row is launched with its draw deferred (StepInput.defer_draw): the host fills
the masks while the forward runs, then queues the draw, so decode lookahead holds (the step ahead's masks are filled
once this step's tokens reached the grammars). A constrained or biased row carries no drafts.
"""
from __future__ import annotations

import json
import logging

import torch

from .request import GuidedDecoding, RequestError

log = logging.getLogger(__name__)
MASK_BITS = 32  # tokens a bitmask word covers (xgrammar's int32 words)
# whitespace characters in a row a JSON schema's output may put between tokens: any amount is valid JSON, but a model
# whose top choice is a space then never ends (until max_tokens); 64 is past any pretty-printer's indentation
MAX_WHITESPACE = 64
ANY_OBJECT = '{"type": "object"}'  # response_format json_object


def words(vocab_size: int) -> int:
    return (vocab_size + MASK_BITS - 1) // MASK_BITS


class Guides:
    """The engine's grammar compiler over its tokenizer's vocabulary (xgrammar), and the per-row tensors."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        try:
            import xgrammar as xgr
        except ImportError:
            raise RequestError("structured output needs the xgrammar package (pip install xgrammar)",
                               "structured_outputs") from None
        self.xgr, self.V = xgr, vocab_size
        self.info = _tokenizer_info(xgr, tokenizer, vocab_size, sorted(stop_ids))
        self.compiler = xgr.GrammarCompiler(self.info)
        self._compiled: dict[str, object] = {}
        self.batch = None  # xgrammar's threaded filler, made at the first step with two grammars

    def matcher(self, g: GuidedDecoding):
        """A fresh matcher of g's grammar (compiled on first use); RequestError naming g.field if it cannot be."""
        key = json.dumps([g.kind, g.spec], sort_keys=True, default=str)
        compiled = self._compiled.get(key)
        if compiled is None:
            try:
                compiled = self._compile(g)
            except RequestError:
                raise
            except Exception as e:  # xgrammar's own errors: the schema, pattern or grammar it could not take
                raise RequestError(f"{g.field}: cannot be compiled into a grammar: {e}", g.field) from None
            self._compiled[key] = compiled
        return self.xgr.GrammarMatcher(compiled)

    def _compile(self, g: GuidedDecoding):
        c = self.compiler
        if g.kind in ("json", "json_object"):  # JSON mode: an object (OpenAI's promise; xgrammar's builtin takes any value)
            schema = ANY_OBJECT if g.kind == "json_object" else g.spec if isinstance(g.spec, str) else json.dumps(g.spec)
            return c.compile_json_schema(schema, any_whitespace=True, strict_mode=True, max_whitespace_cnt=MAX_WHITESPACE)
        if g.kind == "regex":
            if not isinstance(g.spec, str):
                raise RequestError(f"{g.field}: a regex must be a string", g.field)
            return c.compile_regex(g.spec)
        if g.kind == "choice":
            if not isinstance(g.spec, (list, tuple)) or not g.spec or not all(isinstance(s, str) for s in g.spec):
                raise RequestError(f"{g.field}: choice must be a non-empty list of strings", g.field)
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in g.spec))  # EBNF string literals
        if not isinstance(g.spec, str):
            raise RequestError(f"{g.field}: a grammar must be an EBNF string", g.field)
        return c.compile_grammar(g.spec)

    def fill(self, matchers: list, out: torch.Tensor) -> None:
        """out [R, words] int32 (CPU): row i := matchers[i]'s allowed next tokens, or every token (None). Several
        grammars are filled together on xgrammar's threads (one row's fill: 0.4-1.2 ms at Kimi's vocabulary)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        for i, m in enumerate(matchers):
            if m is None:
                out[i].fill_(-1)
        if len(rows) == 1:
            matchers[rows[0]].fill_next_token_bitmask(out, rows[0])
        elif rows:
            if self.batch is None:
                self.batch = self.xgr.BatchGrammarMatcher()
            self.batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], out, rows)


def _tokenizer_info(xgr, tokenizer, vocab_size: int, stop_ids: list[int]):
    """xgrammar's view of the vocabulary: each token's bytes (special tokens but the stop ones match no text)."""
    hf = getattr(tokenizer, "tok", None)
    if getattr(tokenizer, "kind", None) == "tokenizer.json" and hf is not None:  # a token's text depends on its
        from transformers import PreTrainedTokenizerFast  # neighbours (SentencePiece's space): xgrammar reads the
        return xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=hf),  # vocabulary's own form
                                                  vocab_size=vocab_size, stop_token_ids=stop_ids)
    special = getattr(tokenizer, "special_ids", frozenset())
    stops = set(stop_ids)
    vocab = [b"" if i in special and i not in stops else tokenizer.token_bytes(i) for i in range(vocab_size)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_ids)


def bias_tensors(biases: list[dict | None], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logit_bias (None: none) as (ids [R, n] int64, values [R, n] FP32), padded with token 0 at +0."""
    n = max(1, max((len(b) for b in biases if b), default=0))
    ids = torch.zeros(len(biases), n, dtype=torch.long)
    vals = torch.zeros(len(biases), n, dtype=torch.float32)
    for i, b in enumerate(biases):
        if b:
            ids[i, :len(b)] = torch.tensor(list(b.keys()), dtype=torch.long)
            vals[i, :len(b)] = torch.tensor(list(b.values()), dtype=torch.float32)
    return ids.to(device, non_blocking=True), vals.to(device, non_blocking=True)


def apply(logits: torch.Tensor, mask: torch.Tensor | None, bias: tuple | None) -> torch.Tensor:
    """[R, V] logits with each row's bias added and the tokens its bitmask clears at -inf (a new tensor; the raw
    logits stay for logprobs). Tensor ops only, no sync: captured in the decode graphs."""
    x = logits.float().clone()
    if bias is not None:
        x.scatter_add_(1, bias[0], bias[1])
    if mask is not None:
        V = x.shape[1]
        col = torch.arange(V, device=x.device)
        allowed = (mask[:, col // MASK_BITS] >> (col % MASK_BITS)) & 1
        x.masked_fill_(allowed == 0, float("-inf"))
    return x
