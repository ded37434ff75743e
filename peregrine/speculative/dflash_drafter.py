"""--speculative-config {"method": "dflash" | "dspark", "model": DIR}: the drafter the speculative decoder asks,
made of the drafter model and its tap buffer (dflash.py) and its step as CUDA graphs (dflash_graphs.py)."""
from __future__ import annotations

import torch

from ..config import ConfigError
from .dflash import DFlashModel, TapWriter, check_fits, check_room, load_folder, read_back
from .dflash_graphs import DrafterGraphs
from .width import survival_from_rates


class DFlashDrafter:
    """--speculative-config {"method": "dflash" | "dspark", "model": DIR}: drafts a block per request from the
    target's tapped hidden states. Per request it keeps each drafter layer's context keys and values, extended at
    each propose by the tokens the target was fed since (their c read from the TapWriter's buffer)."""

    def __init__(self, cfg, engine, log=print):
        cfg_d, weights = load_folder(cfg.model)
        tcfg = engine.model_cfg
        if tcfg.attn_res_block_size is not None:
            raise ConfigError(f"--speculative-config: {cfg.method} drafts from a residual stream; this target's "
                              "AttnRes layers have none (Kimi K3): use ngram, suffix or draft_model")
        dev = engine.cache.latent.device
        target = engine.runner.model
        if cfg_d.shifted != (cfg.method == "dspark"):
            log(f"speculative: {cfg.model} is a {'DeepSpec' if cfg_d.shifted else 'z-lab'} drafter; "
                f"its own convention is used (method '{cfg.method}' only names the family)")
        weights = {k: v.to(dev) for k, v in weights.items()}
        self.model = DFlashModel(cfg_d, weights, target.embed_tokens, target.lm_head)
        check_fits(cfg_d, weights, self.model, tcfg, f"drafter {cfg.model}")
        c = engine.cache
        slots, dtype = c.latent.shape[1] * c.block_size, target.embed_tokens.dtype
        check_room(cfg_d, slots, dtype, torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else None, cfg.model)
        self.writer = TapWriter(self.model, slots, dtype, dev)
        target.taps = self.writer
        self.bs, self.k, self.dev = c.block_size, cfg.k, dev
        self.survival: dict[int, list[float]] = {}  # id(seq) -> P(drafts 0..j all accepted), from the confidences
        on_gpu = dev.type == "cuda" and engine.engine_cfg.cuda_graphs
        self.graphs = DrafterGraphs(self.model, self.writer, c.block_size, min(cfg.k, cfg_d.num_drafts),
                                    engine.max_model_len, dev, capture=on_gpu, log=log)
        # the fast path drafts the next block inside each verify step (dflash_graphs.in_verify); where the rows'
        # accepted counts agree with the host's, propose takes those blocks: {id(seq): (fed length, drafts, confs)}
        self.ready: dict[int, tuple[int, list[int], list[float] | None]] = {}
        self.stats = {"drafted_in_verify": 0, "drafted_apart": 0}
        if self.graphs.paged and hasattr(engine.runner, "after_verify"):
            engine.runner.after_verify = self.graphs.in_verify
        log(f"speculative: {cfg_d.num_layers}-layer {'DSpark' if cfg_d.markov_rank or cfg_d.confidence else 'DFlash'}"
            f" drafter from {cfg.model}, taps at target layers {cfg_d.target_layer_ids}, block {cfg_d.block_size}, "
            f"up to {cfg_d.num_drafts} drafts")

    @torch.inference_mode()
    def propose(self, seqs, ks: list[int]) -> list[list[int]]:
        """One block per asking request, all in one batched step (a CUDA graph per batch size and context bucket
        on the GPU: dflash_graphs.py); drafts and confidences back in one copy."""
        asked = [i for i, (seq, k) in enumerate(zip(seqs, ks))  # drafts follow the one token not yet fed
                 if k > 0 and seq.num_cached > 0 and len(seq.token_ids) == seq.num_cached + 1]
        out: list[list[int]] = [[] for _ in seqs]
        if not asked:
            return out
        got = {}
        for i in asked:
            r = self.ready.pop(id(seqs[i]), None)
            if r is not None and r[0] == seqs[i].num_cached:
                got[i] = r[1:]
        self.stats["drafted_in_verify"] += len(got)
        rest = [i for i in asked if i not in got]
        if rest:
            sq = [seqs[i] for i in rest]
            drafts, confs = self.graphs.draft([s.blocks for s in sq], [s.num_cached for s in sq],
                                              [s.token_ids[-1] for s in sq])
            got |= {i: (drafts[r], None if confs is None else confs[r]) for r, i in enumerate(rest)}
            self.stats["drafted_apart"] += len(rest)
        for i in asked:
            d, c = got[i]
            n = min(ks[i], len(d))
            if c is not None:
                self.survival[id(seqs[i])] = survival_from_rates(c[:n])
            out[i] = d[:n]
        return out

    def predrafted(self, extras: dict, rows: list[tuple[int, object, int]]) -> None:
        """After a verify step whose graph drafted on (dflash_graphs.in_verify): rows (verify row, sequence, drafts
        the host accepted) of greedy rows (and of sampled rows whose tokens the step drew); a row's block is kept for
        its next propose where the device counted the same, so it was anchored on the token the host appended and
        read the context through it."""
        self.ready.clear()
        if not rows:
            return
        d, c = extras["drafts"], extras["confs"]
        (acc, _), (ids, confs) = read_back([(extras["accepted"], None),
                                            (d.reshape(-1), None if c is None else c.reshape(-1))])
        k = d.shape[1]
        for row, seq, a in rows:
            if acc[row] == a:
                self.ready[id(seq)] = (seq.num_cached, ids[row * k:(row + 1) * k],
                                       None if confs is None else confs[row * k:(row + 1) * k])

    def verified(self, seq, drafted: int, accepted: int) -> None:
        pass  # the next propose reads the fed positions' context; rejected ones were never read

    def detach(self, engine) -> None:
        """Stop the target's forwards from feeding this drafter (its taps, its work inside verify steps)."""
        if engine.runner.model.taps is self.writer:
            engine.runner.model.taps = None
        if getattr(engine.runner, "after_verify", None) == self.graphs.in_verify:
            engine.runner.after_verify = None

    def release(self, seq) -> None:
        self.survival.pop(id(seq), None)
        self.ready.pop(id(seq), None)
