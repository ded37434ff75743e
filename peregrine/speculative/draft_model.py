"""Draft-model drafter: a smaller model of the family with the target's vocabulary proposes k
greedy tokens per sequence, with its own caches (one KDA slot and block range per target request).

Per propose: one forward feeds the tokens the draft has not seen yet (the last accepted drafts and
the target's token, or the whole prompt the first time) and gives draft 1; each further forward feeds
draft j and gives draft j+1. The draft's KDA state is snapshotted after each forward, so when the
target accepts a of k drafts the draft returns to the state after draft a; its MLA length moves back
(entries past it are dead and get overwritten).
"""
from __future__ import annotations

import math

import torch

from ..cache import ModelCache
from ..config import ConfigError, resolve_model
from ..decode.batch import StepInput


class _Track:
    def __init__(self, slot: int, blocks: list[int]):
        self.slot, self.blocks = slot, blocks
        self.fed = 0                 # tokens of the target sequence (and drafts) in the draft's caches
        self.base = 0                # len(token_ids) when the last drafts were proposed
        self.snaps: list[tuple[torch.Tensor, torch.Tensor]] = []  # state/conv after round j


class DraftModelDrafter:
    def __init__(self, cfg, engine, log=print):
        from ..decode.standard import StandardRunner
        from ..models.kimi import KimiModel
        from ..models.loader import init_dummy_weights, load_weights
        dcfg, folder = resolve_model(cfg.model)
        tcfg = engine.model_cfg
        if dcfg.vocab_size != tcfg.vocab_size:
            raise ConfigError(f"draft model {cfg.model} has vocabulary {dcfg.vocab_size}, the target {tcfg.vocab_size}: "
                              "they must share one vocabulary")
        if folder is None and not cfg.dummy_weights:
            raise ConfigError(f"draft model '{cfg.model}' ships no weights: add \"dummy_weights\": true to "
                              "--speculative-config, or give a model folder with safetensors")
        ecfg, tc = engine.engine_cfg, engine.cache
        dev, dtype = tc.latent.device, tc.conv.dtype
        with torch.device(dev):
            m = KimiModel(dcfg, dtype).eval()
        if folder is not None and not cfg.dummy_weights:
            load_weights(m, folder, log=log)
        else:
            init_dummy_weights(m, seed=ecfg.seed)
        self.k, self.bs = cfg.k, tc.block_size
        self.per_seq = math.ceil((engine.max_model_len + cfg.k) / self.bs)
        self.cache = ModelCache(dcfg, num_blocks=ecfg.max_num_seqs * self.per_seq, block_size=self.bs,
                                num_slots=ecfg.max_num_seqs, dtype=dtype, device=dev, kv_cache_dtype=ecfg.kv_cache_dtype)
        self.runner = StandardRunner(m, self.cache, cuda_graphs=ecfg.cuda_graphs,
                                     max_graph_batch=ecfg.max_decode_batch, log=log)
        self.model, self.device = m, dev
        self.tracks: dict[str, _Track] = {}
        log(f"speculative: draft model {dcfg.name} ({sum(p.numel() for p in m.parameters()) / 1e6:.1f}M parameters), "
            f"k = {cfg.k}")

    def _track(self, seq) -> _Track:
        t = self.tracks.get(seq.request_id)
        if t is None:
            t = _Track(self.cache.allocate_slot(), self.cache.blocks.allocate(self.per_seq))
            self.tracks[seq.request_id] = t
        return t

    def _forward(self, rows) -> list[int]:
        """rows: (track, tokens); feeds them and returns each row's greedy next token."""
        step = StepInput.build([(toks, t.fed, t.slot, t.blocks[: -(-(t.fed + len(toks)) // self.bs)])
                                for t, toks in rows], self.bs, self.device)
        logits = self.runner.forward(step)
        for t, toks in rows:
            t.fed += len(toks)
        slots = torch.tensor([t.slot for t, _ in rows], device=self.device)
        st, cv = self.cache.state[:, slots], self.cache.conv[:, slots]  # copies (advanced indexing)
        for j, (t, _) in enumerate(rows):
            t.snaps.append((st[:, j], cv[:, j]))
        return logits.argmax(-1).tolist()

    @torch.inference_mode()
    def propose(self, seqs, ks: list[int]) -> list[list[int]]:
        tracks = [self._track(s) for s in seqs]
        out: list[list[int]] = [[] for _ in seqs]
        for t, s in zip(tracks, seqs):
            t.base, t.snaps = len(s.token_ids), []
        active = list(range(len(seqs)))
        for j in range(max(ks)):
            rows = [(tracks[i], seqs[i].token_ids[tracks[i].fed:] if j == 0 else [out[i][-1]]) for i in active]
            for i, tok in zip(active, self._forward(rows)):
                out[i].append(tok)
            active = [i for i in active if ks[i] > j + 1]
            if not active:
                break
        return out

    def verified(self, seq, drafted: int, accepted: int) -> None:
        t = self.tracks.get(seq.request_id)
        if t is None or not drafted or not t.snaps:
            return
        if accepted < drafted:  # back to the state after draft `accepted` (snapshot 0: after the last real token)
            st, cv = t.snaps[accepted]
            self.cache.state[:, t.slot] = st
            self.cache.conv[:, t.slot] = cv
            t.fed = t.base + accepted
        t.snaps = []

    def release(self, seq) -> None:
        t = self.tracks.pop(seq.request_id, None)
        if t is not None:
            self.cache.free_slot(t.slot)
            self.cache.blocks.free(t.blocks)
