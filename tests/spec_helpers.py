"""Shared by the speculative-decoding tests: a drafter whose acceptance is known in advance."""
from __future__ import annotations


class ScriptedDrafter:
    """Proposes the reference greedy continuation with its j-th token replaced by a wrong one, j cycling
    through `accepts`; so the target must accept exactly min(j, drafts) tokens of each proposal."""

    def __init__(self, refs: dict[tuple, list[int]], accepts: list[int], vocab: int, strict: bool = True):
        """strict: the target must stay on the reference path (FP32); else (BF16) stop drafting where it left it."""
        self.refs, self.accepts, self.vocab, self.strict = refs, accepts, vocab, strict
        self.n = 0
        self.expected = 0      # accepted tokens the target must report
        self.released: list[str] = []

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks):
            ref, gen = self.refs[tuple(s.token_ids[: s.prompt_len])], s.token_ids[s.prompt_len:]
            if ref[: len(gen)] != gen:
                assert not self.strict, "the target left its greedy path"
                out.append([])
                continue
            d = list(ref[len(gen): len(gen) + k])
            j = self.accepts[self.n % len(self.accepts)]
            self.n += 1
            if j < len(d):
                d[j] = (d[j] + 1) % self.vocab
            self.expected += min(j, len(d))
            out.append(d)
        return out

    def verified(self, seq, drafted, accepted):
        pass

    def release(self, seq):
        self.released.append(seq.request_id)


def verify_step_outputs(engines, rows, T: int):
    """One verify step of T tokens a row (StepInput.build's rows) on each engine, from its current caches, with
    NaN-poisoned KDA checkpoint buffers: per engine (FP32 logits on the CPU, (state, conv) checkpoints, the KDA
    state and MLA cache after the step). Each engine must serve it on its own path (runner.last_path)."""
    import torch
    from peregrine.decode.batch import StepInput
    outs = []
    for e in engines:
        c = e.cache
        st = StepInput.build(rows, c.block_size, e.device)
        st.logits_idx = torch.arange(len(rows) * T, device=e.device)
        st.spec_tokens = T
        n = len(rows)
        ck = (torch.full((len(c.kda_index), n, T, *c.state.shape[2:]), float("nan"), device=e.device),
              torch.full((len(c.kda_index), n, T, *c.conv.shape[2:]), float("nan"), dtype=c.conv.dtype, device=e.device))
        st.kda_ckpt = ck
        logits = e.runner.forward(st)
        assert e.runner.last_path == e.runner.name
        outs.append((logits.float().cpu(), ck, c.state.clone(), c.latent.clone()))
    return outs
