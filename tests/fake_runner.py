"""A deterministic stand-in model that really goes through the caches.

Each step it writes every input token into the MLA latent cache at slot_mapping and
folds it into a running hash kept in the KDA state slot; the next-token logits then
come from the tokens read back through block_tables/context_lens together with that
state. A scheduling, slot or cache-mapping bug therefore changes the output.
`ref_logits` is the same model computed straight from a token list, without any cache.
"""
from __future__ import annotations

import torch

from peregrine.cache import ModelCache
from peregrine.decode.batch import StepInput
from peregrine.engine.penalties import apply_device
from peregrine.kernels.logprobs import token_logprobs
from peregrine.kernels.sampling import sample_ref

HASH_MOD = 65521       # prime < 2**16: the running hash stays exact in the FP32 KDA state
LOGIT_SCALE = 4.0      # peaky enough that greedy is a clear choice, flat enough to sample
FAKE_PIECES = 3        # advances per prefill chunk run in pieces


def fold(h: int, tokens) -> int:
    for t in tokens:
        h = (h * 31 + int(t) + 1) % HASH_MOD
    return h


def device_tokens(runner, step: StepInput, logits: torch.Tensor) -> torch.Tensor:
    """A decode step's tokens as the specialized runner's head makes them: penalties (StepInput.penalties) and a
    draw (StepInput.sampling) or the argmax; logprobs of the raw logits (StepInput.logprobs) left on the runner.
    Counts on runner.{sampled,penalty,logprob}_steps."""
    runner.device_logprobs = None
    x = logits
    if step.logit_bias is not None or step.logit_mask is not None:  # xgrammar's own masking, not peregrine's
        import xgrammar
        runner.constrained_steps += 1
        x = logits.clone()
        if step.logit_bias is not None:
            for i, (ids, vals) in enumerate(zip(*step.logit_bias)):
                for t, v in zip(ids.tolist(), vals.tolist()):
                    x[i, t] += v
        if step.logit_mask is not None:
            xgrammar.apply_token_bitmask_inplace(x, step.logit_mask, backend="torch_native")
    if step.sampling is not None:
        t, k, p, mp, seeds = step.sampling
        runner.sampled_steps += 1
        if step.penalties is not None:
            runner.penalty_steps += 1
            x = apply_device(x, *step.penalties, step.context_lens_t)
        toks = sample_ref(x, t, k, p, seeds, step.context_lens_t.long(), mp)
    else:
        toks = x.argmax(-1)
    if step.logprobs:
        runner.logprob_steps += 1
        runner.device_logprobs = token_logprobs(logits, toks)
    return toks


def _logits_for(h: int, n: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(h * 1_000_003 + n)
    return torch.randn(vocab, generator=g) * LOGIT_SCALE


def ref_logits(tokens: list[int], vocab: int) -> torch.Tensor:
    return _logits_for(fold(0, tokens), len(tokens), vocab)


class FakeRunner:
    def __init__(self, cache: ModelCache, vocab: int, greedy: bool = False):
        """greedy: act like the specialized runner, whose decode steps also return their argmax
        (greedy_tokens) and whose next step may take it as input ids (decode lookahead). Like a
        CUDA graph's static output, the argmax buffer of a batch size is overwritten by every step."""
        self.cache, self.vocab = cache, vocab
        self.lookahead = self.device_sampler = greedy
        self.greedy_tokens = None
        self._greedy_out: dict[int, torch.Tensor] = {}
        self.layer = cache.cfg.mla_layers[0]
        self.last_path = "standard"
        self.fallback_reasons: dict[str, int] = {}
        self.steps: list[list[int]] = []   # q_lens of every step
        self.mismatches = 0                # state hash disagreed with the cache read-back
        self.prompts: list[tuple[int, ...]] = []  # rows of unfinished prompts come back NaN
        self.events: list[str] = []        # "piece" per prefill-piece advance (tests add their own)
        self.sampled_steps = 0             # decode steps that drew their sampled rows "on the device"
        self.logprob_steps = 0             # decode steps that took their logprobs "on the device"
        self.penalty_steps = 0             # decode steps that applied penalties "on the device"
        self.constrained_steps = 0         # decode steps that applied a grammar mask or logit_bias "on the device"
        self.deferred_steps = 0            # decode steps whose draw the engine made after them (StepInput.defer_draw)
        self.device_logprobs = None

    def forward(self, step: StepInput) -> torch.Tensor:
        c = self.cache
        self.steps.append(list(step.q_lens))
        lat = c.latent[c.mla_index[self.layer]].view(-1, c.cfg.latent_dim)
        lat[step.slot_mapping, 0] = step.input_ids.float()
        out = torch.full((step.num_seqs, self.vocab), float("nan"))  # poisoned: unwritten rows stay NaN
        ids, pos, off = step.input_ids.tolist(), step.positions.tolist(), 0
        for i, q in enumerate(step.q_lens):
            n = step.context_lens[i]
            assert pos[off:off + q] == list(range(n - q, n)), "positions do not follow the context"
            slot = int(step.kda_slots[i])
            st = c.state[0, slot, 0, 0, 0]
            s, done = int(st.item()), 0
            for cut, snap in sorted((step.kda_snapshots or {}).get(i, [])):  # prefix caching: state part way
                s, done = fold(s, ids[off + done:off + cut]), cut
                c.snap_state[0, snap, 0, 0, 0] = float(s)
            s = fold(s, ids[off + done:off + q])
            st.fill_(float(s))
            off += q
            hist = c.gather_latent(self.layer, step.block_tables[i], n)[:, 0].round().long().tolist()
            h = fold(0, hist)
            if h != s:
                self.mismatches += 1
            if any(len(p) > n and list(p[:n]) == hist for p in self.prompts):
                continue  # mid-prompt: the engine must not sample this row
            out[i] = _logits_for(h if h == s else h + s + 1, n, self.vocab)
        decode = step.is_decode
        self.last_path = "latency_specialized" if decode else "standard"
        self.greedy_tokens = self.device_logprobs = None
        self.deferred_steps += bool(step.defer_draw)
        if decode and self.lookahead and not step.defer_draw:  # (a deferred draw is the engine's, after the step)
            buf = self._greedy_out.setdefault(step.num_seqs, torch.empty(step.num_seqs, dtype=torch.long))
            self.greedy_tokens = buf.copy_(device_tokens(self, step, out))
        if not decode:
            self.fallback_reasons["prefill in batch"] = self.fallback_reasons.get("prefill in batch", 0) + 1
        return out


class PiecedFakeRunner(FakeRunner):
    """A FakeRunner that can also run a prefill chunk in pieces (the engine then uses prefill pieces)."""

    def forward_pieces(self, step: StepInput, layers_per_piece: int):
        """A prefill chunk in FAKE_PIECES advances (the engine's protocol: None until the last, then the
        logits); each advance is recorded in `events`, and the chunk's forward leaves the decode's
        argmax buffer alone, as the standard path's pieces do the specialized path's."""
        n = [0]

        def advance():
            n[0] += 1
            self.events.append("piece")
            if n[0] < FAKE_PIECES:
                return None
            greedy, path = self.greedy_tokens, self.last_path
            out = self.forward(step)
            self.greedy_tokens, self.last_path = greedy, path
            return out
        return advance
