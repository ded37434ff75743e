"""One speculative engine step: draft, verify k + 1 query tokens per sequence, accept, roll back.

Every row of a pure decode step with at least one draft becomes a verify row of T = 1 + k_step
tokens (its last sampled token, its drafts, then filler up to the longest draft of the step),
so the step is uniform and the specialized path serves it from one graph per (B, T). A step with a
prompt chunk is a plain one (the engine runs a chunk beside decodes in pieces; the steps between verify).
Greedy rows accept the longest prefix of drafts that equals the target's argmax and append the
target's token after it, so greedy output equals non-speculative greedy output. Sampled rows do the
same with the token each position draws (keyed by seed and position, as a plain step draws it): that is
speculative sampling for a deterministic drafter, and their tokens equal non-speculative sampling's.
Rows with logprobs or penalties get no drafts; they sample from their first position.

Where the runner draws on the device (engine.device_sampling: one GPU; the specialized runner) a pure verify
step whose rows all speculate carries StepInput.sampling with a row per token (each sequence's settings T
times): the runner draws every position's token inside the step (its graph), keyed by (seed, the input's
position + 1), and they come back in the one read of runner.greedy_tokens with the greedy rows' argmax. Any
other verify step with sampled rows (a logprobs or penalised row in the batch, the host sampler) draws them after the step from the logits (_draw_sampled): the same tokens.

Synthetic acceptance (config.py; benchmarking only): every row drafts its full room and accepts a count drawn
from the configured per-position rates with one uniform keyed by (the request's seed, its length), so a
request's draws do not depend on its batch; the token after the accepted drafts is the target's there, as in a
real verify. The drafter still proposes (its host time is a real step's), but the drafts verified are ids keyed
by (seed, length, position) (synthetic_drafts): on a MoE a verify step's cost follows the union of experts its
rows route to, and text routes like distinct tokens, while a drafter's proposals over a dummy model's looping
output repeat a few tokens (session 30, the 48B at B = 8, T = 2 and 4: 80 experts a layer where distinct rows read ~100 and ~163).

Verify width (width.py): with a cost table measured at start-up (measure_costs, on the GPU), each pure
decode step verifies only as many drafts a request as maximise expected tokens per millisecond, down to a
plain step; without one (the CPU, or PEREGRINE_SPEC_WIDTH=full) every draft is verified.

Rollback: the KDA layers write the state (and conv window) after each position into
checkpoint buffers; a row that accepted a < T-1 drafts gets the state after position a
copied back into its slot. The MLA cache is truncated: the sequence's length moves back to
the accepted position and the rejected entries are zeroed (attention never reads past the
length anyway). Filler positions past a sequence's reserved blocks are written to the
cache's scratch block, never into another sequence's.
"""
from __future__ import annotations

import os
from collections import deque

import torch

from ..decode.batch import StepInput
from ..engine import guided
from ..engine.penalties import needs_processing
from ..engine.sampling import sample as sample_tokens
from .config import SpeculativeConfig
from .drafters import NgramDrafter
from .width import AcceptanceTracker, choose_width

def speculates(p) -> bool:
    """Requests that get drafts: greedy or sampled (the draws are keyed by position, so speculation keeps a sampled
    request's tokens), constrained or biased too (every verified position masked and biased: _constraints), without
    logprobs or logits processing (penalties, min_tokens), which ride along undrafted."""
    return p.logprobs is None and not needs_processing(p)


SYNTHETIC_SEED = 0x5EED  # the synthetic acceptance draws' key, beside each request's seed and length
DRAFT_SALT = 0xD2AF7  # synthetic drafts' ids drawn apart from the acceptance draws
M64 = 2**64 - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a keyed uniform in a microsecond (a numpy Generator per row took ~13 us, per verify
    step on the host)."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


WIDTH_ENV = "PEREGRINE_SPEC_WIDTH"  # "auto" (default: chosen per step from measured costs) or "full" (every draft)
COST_ITERS = 20  # graph replays timed per (B, T) for the width chooser's table at start-up
# The host-side excess of a step over the table (drafting, accepting, syncing): the median of the last EXCESS_WINDOW
# pure decode steps of each kind, so that one slow step (a new turn's first propose, a collection) does not move it,
# and a verify step's is forgotten EXCESS_STALE steps later: once the chooser has kept to plain steps that long it
# judges verifies by the plain steps' excess again rather than by an old outlier (an EMA of both, one 0.3 s step
# had made verifies look 30 ms dearer, and plain steps never corrected it: 600 steps in a row on the replay).
EXCESS_WINDOW = 15
EXCESS_STALE = 64


def make_drafter(cfg: SpeculativeConfig, engine, log):
    if cfg.method == "ngram":
        return NgramDrafter(cfg.prompt_lookup_max, cfg.prompt_lookup_min)
    if cfg.method == "suffix":
        from .suffix import SuffixDrafter
        return SuffixDrafter(cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_cached_requests,
                             cfg.suffix_decoding_max_spec_factor, cfg.suffix_decoding_min_token_prob,
                             max_num_seqs=engine.engine_cfg.max_num_seqs)
    if cfg.method in ("dflash", "dspark"):
        from .dflash_drafter import DFlashDrafter
        return DFlashDrafter(cfg, engine, log)
    from .draft_model import DraftModelDrafter
    return DraftModelDrafter(cfg, engine, log)


class SpecDecoder:
    def __init__(self, engine, cfg: SpeculativeConfig, drafter=None, log=print):
        self.engine, self.cfg, self.k = engine, cfg, cfg.k
        c = engine.cache
        self.cache = c
        self.drafter = drafter if drafter is not None else make_drafter(cfg, engine, log)
        self.enabled = True  # benches switch speculation off and on over one engine
        ecfg = engine.engine_cfg
        rows, T = max(ecfg.max_num_seqs, ecfg.max_decode_batch), self.k + 1  # graphs capture up to max_decode_batch
        # state / conv window after each verify position, per KDA layer and step row
        self.ckpt = (torch.empty(c.state.shape[0], rows, T, *c.state.shape[2:], dtype=c.state.dtype, device=c.state.device),
                     torch.empty(c.conv.shape[0], rows, T, *c.conv.shape[2:], dtype=c.conv.dtype, device=c.conv.device))
        self.stats = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "verify_steps": 0,
                      "accepted_per_pos": [0] * self.k}
        self.stats["width_steps"] = [0] * (self.k + 1)  # pure decode steps by chosen width (0: plain, by choice)
        self.stats["width_explore_steps"] = 0  # plain steps taken to measure their excess again (plain_stale)
        self.tracker = AcceptanceTracker(self.k)
        self.costs: dict[int, dict[int, float]] = {}  # B -> {T: step ms}: the width chooser's table (empty: full)
        self.reset_excess()
        self.width_mode = os.environ.get(WIDTH_ENV, "auto")
        if self.width_mode not in ("auto", "full"):
            raise ValueError(f"{WIDTH_ENV} must be auto or full, got {self.width_mode!r}")
        self.rates = cfg.acceptance_rates() if cfg.synthetic else None
        if self.rates is not None:
            self.stats["synthetic_acceptance_length"] = 1.0 + sum(self.rates)
            log(self.synthetic_note)
        self.max_blocks = -(-(engine.max_model_len + self.k) // c.block_size)
        enable = getattr(engine.runner, "enable_speculation", None)
        if enable is not None:
            enable(self.k, self.ckpt, min(self.max_blocks, c.num_blocks + 1))

    # ---- metrics ----
    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified draft yields on average: 1 + accepted / drafts (vLLM's definition)."""
        n = self.stats["num_drafts"]
        return 1.0 + self.stats["num_accepted_tokens"] / n if n else 0.0

    def release(self, seq) -> None:
        self.drafter.release(seq)

    def prepare(self, seqs) -> None:
        """Sequences whose prefill the engine has just launched: a drafter's per-request setup (suffix: its trie)
        done while the GPU works, not in the first decode step."""
        prep = getattr(self.drafter, "prepare", None)
        seqs = [s for s in seqs if speculates(s.params)]
        if prep is not None and seqs and self.enabled:
            prep(seqs)

    def detach(self) -> None:
        """Speculation off or replaced: the drafter's hooks leave the target (its taps, its in-verify work)."""
        off = getattr(self.drafter, "detach", None)
        if off is not None:
            off(self.engine)

    @property
    def synthetic_note(self) -> str:
        return (f"WARNING: speculative decoding with synthetic acceptance (rates {self.rates}, mean acceptance length "
                f"{1 + sum(self.rates):.2f}): drafts are accepted by chance, not by the model, so outputs are not the "
                f"model's. For benchmarks only")

    def measure_costs(self, log=print, iters: int = COST_ITERS) -> dict:
        """The width chooser's table: each (B, T)'s step time from its CUDA graph (plain graphs for T = 1), replayed
        on scratch inputs with a different random token in every row, so that the MoE reads as many experts as a
        real step's rows route to (a verify's cost follows their union). Needs the runner's graphs (the
        specialized path on a GPU); else the table stays empty and every draft is verified."""
        rt = getattr(self.engine.runner, "graph_replay_time", None)
        if rt is None or self.width_mode == "full":
            return self.costs
        B_max = max(self.engine.engine_cfg.max_num_seqs, 1)
        for B in range(1, B_max + 1):
            try:
                row = {T: rt(B, iters, T=T, distinct=True) for T in range(1, self.k + 2)}
            except TypeError:  # a runner without verify graphs (standard): every draft is verified
                return self.costs
            if all(v is not None for v in row.values()):
                self.costs[B] = row
        if self.costs:
            log("speculative decoding: verify width chosen per step from these step ms (T = 1..k+1), " + "; ".join(
                f"B={B}: " + " ".join(f"{v:.2f}" for v in row.values()) for B, row in self.costs.items()))
        return self.costs

    def effective_costs(self, B: int) -> dict[int, float] | None:
        """B's table plus what pure decode steps were seen to cost beyond it on the host: a verify step drafts,
        reads its tokens back and rolls back; a plain one only reads back."""
        row = self.costs.get(B)
        if row is None:
            return None
        ex = self.excess
        return {T: ms + ex["plain" if T == 1 else "verify"] for T, ms in row.items()}

    def reset_excess(self) -> None:
        """Forget the observed steps: per kind, the last EXCESS_WINDOW (pure decode step number, wall ms minus
        the table's)."""
        self.excess_seen: dict[str, deque] = {k: deque(maxlen=EXCESS_WINDOW) for k in ("plain", "verify")}
        self.decode_steps = 0

    def _fresh(self, kind: str) -> list[float]:
        return [x for n, x in self.excess_seen[kind] if n > self.decode_steps - EXCESS_STALE]

    @property
    def excess(self) -> dict[str, float]:
        """Each kind's excess ms now: the median of its steps of the last EXCESS_STALE (plain ones: with none that
        recent, of the last EXCESS_WINDOW, and plain_stale() asks for a plain step to measure it anew; verify
        ones: with none that recent, the plain steps' excess); 0 before any."""
        def med(xs):
            xs = sorted(xs)
            return xs[len(xs) // 2] if xs else None
        plain = med(self._fresh("plain") or [x for _, x in self.excess_seen["plain"]])
        verify = med(self._fresh("verify"))
        plain = 0.0 if plain is None else plain
        return {"plain": plain, "verify": plain if verify is None else verify}

    def plain_stale(self) -> bool:
        """Plain steps were measured once but none in the last EXCESS_STALE: their excess may be an old outlier
        (eager steps, a burst of host work) that keeps the chooser verifying where plain steps pay, and verifying
        never measures them again; so the chooser takes one plain step."""
        return bool(self.excess_seen["plain"]) and not self._fresh("plain")

    def observe(self, B: int, T: int, wall_ms: float) -> None:
        """A pure decode step of B sequences at T tokens each (1: plain) took wall_ms: note its excess."""
        row = self.costs.get(B)
        if row is None or T not in row:
            return
        self.decode_steps += 1
        self.excess_seen["plain" if T == 1 else "verify"].append((self.decode_steps, wall_ms - row[T]))

    def _survival(self, seq, d: list[int]) -> list[float]:
        """P(drafts 0..j all accepted): the synthetic rates, the drafter's own confidences (suffix: its path
        probabilities), or each position's acceptance learnt from verifies."""
        if self.rates is not None:
            return self.rates[:len(d)]
        own = getattr(self.drafter, "survival", {}).get(id(seq))
        if own is not None and len(own) >= len(d):
            return own[:len(d)]
        return self.tracker.survival(len(d))

    def _draw_sampled(self, batch, step, drafts, T, logits) -> dict[int, list[int]]:
        """Sampled rows with drafts: the token each verify position draws, keyed by (seed, the position of the
        token drawn) as a plain step would draw it (engine/sampling.py). Accepting drafts while they equal these
        draws is speculative sampling for a deterministic drafter (q one-hot): draft x survives with probability
        p(x) = min(1, p(x) / q(x)), and a rejected position's draw is p without x, renormalised: the residual.
        The host path: a verify step whose runner drew these tokens itself takes them from it (_device_draws)."""
        rows, params, seeds, positions, who = [], [], [], [], []
        pos = 0
        for i, (seq, n) in enumerate(batch):
            d = drafts.get(i, [])
            if d and not seq.params.plain_greedy:  # sampled, or greedy over constrained or biased logits
                L = len(seq.token_ids)
                rows += range(pos, pos + len(d) + 1)
                params += [seq.params] * (len(d) + 1)
                seeds += [seq.seed] * (len(d) + 1)
                positions += range(L, L + len(d) + 1)
                who.append((i, len(d) + 1))
            pos += T
        if not rows:
            return {}
        x = logits[rows]
        if step.logit_mask is not None or step.logit_bias is not None:  # each position's own mask and bias
            sel = torch.tensor(rows, device=logits.device)
            x = guided.apply(x, None if step.logit_mask is None else step.logit_mask[sel],
                             None if step.logit_bias is None else tuple(t[sel] for t in step.logit_bias))
        toks = sample_tokens(x, params, seeds, positions)
        out, at = {}, 0
        for i, n in who:
            out[i], at = toks[at:at + n], at + n
        return out

    def synthetic_drafts(self, seq, k: int) -> list[int]:
        """k drafts for synthetic acceptance: ids keyed by (the request's seed, its length, the position), spread
        over the vocabulary as distinct tokens are, and independent of the batch."""
        V = self.engine.model_cfg.vocab_size
        key = _mix(_mix(_mix(SYNTHETIC_SEED ^ DRAFT_SALT) ^ (seq.seed & M64)) ^ len(seq.token_ids))
        return [_mix(key + j) % V for j in range(k)]

    def synthetic_accepted(self, seq, drafted: int) -> int:
        """Drafts accepted under synthetic acceptance: position j is accepted when u < rates[j] (non-increasing,
        so the accepted ones are a prefix and P(more than j) = rates[j]); u keyed by the request and its length."""
        key = _mix(_mix(_mix(SYNTHETIC_SEED) ^ (seq.seed & M64)) ^ len(seq.token_ids))
        u = (key >> 11) * 2.0**-53  # 53 random bits: uniform in [0, 1)
        return sum(1 for r in self.rates[:drafted] if u < r)

    # ---- the step ----
    def room(self, seq) -> int:
        """Most drafts this sequence may take: accepted ones plus the bonus token must not pass
        max_tokens or max_model_len, which also keeps every real draft inside its reserved blocks."""
        n = len(seq.token_ids)
        return max(0, min(self.k, seq.prompt_len + seq.params.max_tokens - n - 1, self.engine.max_model_len - n - 1))

    def _drafts(self, seqs) -> dict[int, list[int]]:
        """Each row's drafts (rows with none left out): the drafter's, or synthetic ones (the drafter still
        proposes: its host time is a real step's)."""
        ask = [(i, k) for i, s in enumerate(seqs) if speculates(s.params) and (k := self.room(s)) > 0]
        if not ask:
            return {}
        props = self.drafter.propose([seqs[i] for i, _ in ask], [k for _, k in ask])
        if self.rates is not None:  # synthetic: every row verifies its whole room, of tokens that route like text
            props = [self.synthetic_drafts(seqs[i], k) for i, k in ask]
        return {i: list(p[:k]) for (i, k), p in zip(ask, props) if p}

    def _width(self, seqs, drafts) -> int | None:
        """Drafts a row to verify at this B (0: a plain step), or None without a cost table (verify them all)."""
        costs = self.effective_costs(len(seqs)) if self.width_mode == "auto" else None
        if costs is None:
            return None
        return choose_width([self._survival(s, drafts.get(i, [])) for i, s in enumerate(seqs)], costs)

    def plain_next(self, seqs) -> bool:
        """Whether these decoding sequences' next step would be a plain one: a drafter that runs on the host
        (n-gram, suffix) proposes nothing for any of them at their tokens now, or the width chooser picks plain for
        what it proposes. The engine then launches that step early (decode lookahead), so a step with speculation
        on that proposes nothing costs what a plain step does: the drafter's host work overlaps the step before.
        The tokens are a step old (the one being read back is not in them): a draft that appears with it waits a
        step. Model drafters (their proposals are GPU work) never launch early."""
        if not self.enabled or not getattr(self.drafter, "host_only", False):
            return not self.enabled
        drafts = self._drafts(seqs)
        if not drafts:
            return True
        w = self._width(seqs, drafts)
        if w == 0 and not self.plain_stale():  # (a stale plain excess is measured by a plain step anyway)
            self.stats["width_steps"][0] += 1
            return True
        return False

    def step(self, batch):
        """-> (StepInput, [(seq, new tokens)], info) for a verify step, or None: run a plain step. Rows still
        prefilling do not verify: a step with a prompt chunk is a plain one, so the chunk keeps the prefill kernels
        and the KDA snapshots a prompt takes (beside running decodes the engine runs a chunk in pieces, and the
        decode steps between the pieces verify)."""
        if not self.enabled or any(s.in_prefill for s, _ in batch):
            return None
        drafts = self._drafts([s for s, _ in batch])
        if drafts:
            w = self._width([s for s, _ in batch], drafts)
            if w is not None:
                if w and self.plain_stale():  # measure a plain step again (one in EXCESS_STALE at most)
                    w = 0
                    self.stats["width_explore_steps"] += 1
                self.stats["width_steps"][w] += 1
                drafts = {i: d[:w] for i, d in drafts.items() if w}
        drafts = {i: d for i, d in ((i, self._in_grammar(batch[i][0], d)) for i, d in drafts.items()) if d}
        if not drafts:
            return None
        T = 1 + max(len(d) for d in drafts.values())
        e, c = self.engine, self.cache
        bs = c.block_size
        rows, idx, flat = [], [], 0
        for i, (seq, n) in enumerate(batch):
            start = seq.num_cached
            d = drafts.get(i, [])
            toks = seq.token_ids[start:start + n] + d + [seq.token_ids[-1]] * (T - 1 - len(d))  # filler: never accepted
            idx.extend(range(flat, flat + T))
            flat += len(toks)
            need = -(-(start + len(toks)) // bs)
            own = seq.blocks[:need]
            rows.append((toks, start, seq.kda_slot, own + [c.scratch_block] * (need - len(own))))
        step = StepInput.build(rows, bs, e.device)
        step.logits_idx = torch.tensor(idx, dtype=torch.long, device=e.device)
        step.spec_tokens = T
        step.kda_ckpt = self.ckpt
        step.logit_mask, step.logit_bias = self._constraints(batch, drafts, T)
        self._plan_draws(batch, step, T)
        return step, drafts, T

    @staticmethod
    def _in_grammar(seq, d: list[int]) -> list[int]:
        """A constrained row's drafts up to the first its grammar refuses (those after it could never be accepted), or
        through the one that ends it (its stop token: nothing follows)."""
        m = seq.guide
        if m is None:
            return d
        ok = 0
        while ok < len(d) and m.accept_token(d[ok]):
            ok += 1
            if m.is_terminated():
                break
        if ok:
            m.rollback(ok)
        return d[:ok]

    def _constraints(self, batch, drafts, T: int) -> tuple:
        """(token bitmasks [B·T, V/32], biases [B·T, n]) of a verify step's positions, or None each: a constrained
        row's position j masked by its grammar after its first j drafts (filled here, the matcher stepped through
        them and back), every position of a biased row biased; other positions unconstrained."""
        seqs = [s for s, _ in batch]
        e = self.engine
        mask = bias = None
        if any(s.guide is not None for s in seqs):
            host = torch.full((len(seqs) * T, guided.words(e.model_cfg.vocab_size)), -1, dtype=torch.int32,
                              pin_memory=e.device.type == "cuda")
            for i, s in enumerate(seqs):
                if s.guide is None:
                    continue
                d = drafts.get(i, [])
                for j in range(len(d) + 1):
                    if s.guide.is_terminated():  # its last draft ends the grammar: no position after it counts
                        break
                    s.guide.fill_next_token_bitmask(host, i * T + j)
                    if j < len(d):
                        s.guide.accept_token(d[j])  # in the grammar: _in_grammar kept only such drafts
                if d:
                    s.guide.rollback(len(d))
            mask = host.to(e.device, non_blocking=True)
        if any(s.params.logit_bias for s in seqs):
            bias = guided.bias_tensors([s.params.logit_bias for s in seqs for _ in range(T)], e.device)
        return mask, bias

    def _plan_draws(self, batch, step, T: int) -> bool:
        """Let the runner draw a pure verify step's sampled rows inside the step (its graph), as a plain step's:
        step.sampling a row per token, each sequence's settings repeated T times (made once per batch composition
        and T: engine._sampling_for), keyed by the input's position + 1 (decode/head.py draw). Only where every row
        speculates: a logprobs or penalised row keeps the step's draws on the host. -> whether planned."""
        e = self.engine
        if not getattr(e, "device_sampling", False):
            return False
        seqs = [s for s, _ in batch]
        if all(s.params.greedy for s in seqs) or not all(speculates(s.params) for s in seqs):
            return False
        step.sampling = e._sampling_for(seqs, T)
        step.sample_top_k = e._sampling_top_k
        return True

    def _device_draws(self, batch, drafts, T, tokens: list[int]) -> dict[int, list[int]]:
        """A verify step whose runner drew every row's token (_plan_draws): each sampled row's tokens at its
        positions 0..len(drafts), as _draw_sampled draws them (a row without drafts: its first position's, the token
        a plain step draws)."""
        out = {}
        for i, (seq, _) in enumerate(batch):
            if not seq.params.plain_greedy:  # sampled, or greedy over constrained or biased logits: the step's draws
                out[i] = tokens[i * T:i * T + len(drafts.get(i, [])) + 1]
        return out

    def finish(self, batch, step, drafts, T, logits):
        """Accept, roll back, and return [(seq, new tokens)] for every row that produced tokens."""
        e, c = self.engine, self.cache
        greedy = getattr(e.runner, "greedy_tokens", None)
        if greedy is None or greedy.shape[0] != logits.shape[0]:
            greedy = None
        # the runner drew the sampled rows in the step (step.sampling: _plan_draws), unless it fell back to a path
        # that only returns logits (no greedy_tokens)
        on_device = step.sampling is not None and greedy is not None
        tgt = (logits.argmax(-1) if greedy is None else greedy).tolist()
        drawn = (self._device_draws(batch, drafts, T, tgt) if on_device
                 else self._draw_sampled(batch, step, drafts, T, logits))
        out, sample_rows, sample_seqs = [], [], []
        restore_rows, restore_slots, restore_pos, dead = [], [], [], []
        extras = getattr(e.runner, "verify_extras", None)  # a block drafted inside this verify step's graph
        predraft = [] if extras is not None and hasattr(self.drafter, "predrafted") else None
        pos = 0
        for i, (seq, n) in enumerate(batch):
            d = drafts.get(i, [])
            if seq.params.plain_greedy or i in drawn:  # the target's tokens: argmax, or keyed draws per position
                t = drawn[i] if i in drawn else tgt[pos:pos + len(d) + 1]
                f = e.forced.get(seq.request_id)
                if f is not None:  # replay: the recorded tokens are the target's choice
                    at = len(seq.token_ids) - seq.prompt_len
                    t = [f[at + j] if at + j < len(f) else t[j] for j in range(len(d) + 1)]
                a = 0
                if self.rates is not None:
                    a = self.synthetic_accepted(seq, len(d))
                else:
                    while a < len(d) and d[a] == t[a]:
                        a += 1
                if predraft is not None and f is None and self.rates is None and (on_device or i not in drawn):
                    predraft.append((i, seq, a))  # its in-verify block is kept where the device counted a too:
                    # from the tokens the step took (sampled rows' too when it drew them), as the host did here
                out.append((i, seq, d[:a] + [t[a]]))
            else:
                a = 0
                sample_rows.append(pos)
                sample_seqs.append((i, seq))
            if d:
                self.stats["num_drafts"] += 1
                self.stats["num_draft_tokens"] += len(d)
                self.stats["num_accepted_tokens"] += a
                for j in range(a):
                    self.stats["accepted_per_pos"][j] += 1
            self.drafter.verified(seq, len(d), a)
            if d:
                self.tracker.record(len(d), a)
            start = seq.num_cached
            seq.num_cached += 1 + a
            if a < T - 1:  # roll back: state after position a; entries a+1.. are rejected
                restore_rows.append(i)
                restore_slots.append(seq.kda_slot)
                restore_pos.append(a)
                dead.extend(c.block_size * seq.blocks[p // c.block_size] + p % c.block_size
                            for p in range(start + 1 + a, start + T) if p // c.block_size < len(seq.blocks))
            pos += T
        if restore_rows:
            c.restore_kda(restore_slots, self.ckpt, restore_rows, restore_pos)
        if dead:
            c.clear_latent(dead)
        if predraft is not None:
            self.drafter.predrafted(extras, predraft)
        if sample_rows:
            toks = e._sample([s for _, s in sample_seqs], logits[sample_rows])
            out += [(i, s, [t]) for (i, s), t in zip(sample_seqs, toks)]
        self.stats["verify_steps"] += 1
        out.sort(key=lambda x: x[0])
        return [(s, t) for _, s, t in out]
