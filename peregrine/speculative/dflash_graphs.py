"""The DFlash / DSpark drafter's step as CUDA graphs (#43 item 2).

Eager, a propose is a few hundred small launches (every layer's projections, norms, RoPE and attention, then
the Markov draws slot by slot): a 48B-sized drafter's took 13.3 ms launched and 2.5 ms replayed (H100, B = 1, 1K
context, k = 7; results/2026-12-05-session28). Captured, it is one replay per B, the asking requests: where the
Triton kernels run
(kernels/drafter_attn.py, Hopper or the interpreter) the block attends to its context in place in the paged
buffer, splitting whatever length each sequence has at run time, so one graph serves every length. Elsewhere the
context is gathered into a dense copy first, whose shape is fixed per graph: the graph is then per (B, L), L the
longest context padded up to a power of two (bucket(); a gather of at most twice the live context). The inputs
(block tables, fed lengths, anchor tokens) are copied into the graph's own buffers, the drafts and confidences come
back in one copy as before.

On the fast path the block for the next step is drafted at the end of each verify step instead, inside its graph
(in_verify): no launch or read-back of its own; a separate propose is left to rows the verify step did not serve.

With capture=False the same buffers and padding run eagerly: the CPU tests' path, and the fallback when a capture
fails (logged once).
"""
from __future__ import annotations

import time

import torch

from .dflash import PagedContext, read_back

MIN_L = 64  # the smallest context bucket: a new request's few tokens share one graph


def bucket(n: int, max_len: int) -> int:
    """The padded context length for n fed tokens: the next power of two >= n (at least MIN_L), at most max_len."""
    b = MIN_L
    while b < n:
        b *= 2
    return min(b, max(max_len, n))


class DrafterGraphs:
    """Per B (and L bucket where the context is gathered): the drafter's block and draws on static buffers,
    captured on first use."""

    def __init__(self, model, writer, block_size: int, k: int, max_len: int, device, *, capture: bool, log=print,
                 paged: bool | None = None):
        self.model, self.writer, self.bs, self.k, self.max_len = model, writer, block_size, k, max_len
        self.dev, self.capture, self.log = device, capture, log
        self.graphs: dict[tuple[int, int], tuple] = {}  # (B, L) -> (graph or None, inputs, outputs)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.broken: str | None = None  # why capture stopped (then every step runs eagerly)
        self.replays = 0
        self.capture_s = 0.0
        from ..kernels import available
        from ..kernels.drafter_attn import supported
        if paged is None:  # attend in place (no gather, no buckets) where the kernel runs and takes this drafter
            paged = available(device) and supported(model.cfg.head_dim, writer.kv.dtype) is None
        self.paged = paged
        self.table_width = -(-max_len // block_size)  # the paged path's tables: every block a sequence can have

    def _buffers(self, B: int, L: int) -> dict:
        width = self.table_width if self.paged else -(-L // self.bs)
        return {"tables": torch.zeros(B, width, dtype=torch.long, device=self.dev),
                "lens": torch.ones(B, dtype=torch.long, device=self.dev),
                "anchors": torch.zeros(B, dtype=torch.long, device=self.dev)}

    def _run(self, inp: dict, L: int):
        if self.paged:
            ctx, valid = PagedContext(self.writer.kv, inp["tables"], inp["lens"], self.bs), None
        else:
            ctx, valid = self.writer.gather(inp["tables"], inp["lens"], L, self.bs)
        d, c, _ = self.model.draft_batch(inp["anchors"], inp["lens"], ctx, valid, self.k)
        return d, c

    def _entry(self, B: int, L: int):
        key = (B, L)
        if key in self.graphs:
            return self.graphs[key]
        inp = self._buffers(B, L)
        g, out = None, None
        if self.capture and self.broken is None:
            from ..decode.capture import capture
            t0 = time.time()
            try:
                g, out = capture(lambda: self._run(inp, L), self.pool)
            except Exception as e:  # noqa: BLE001  (any capture failure: run eagerly from now on, said once)
                self.broken, g, out = repr(e), None, None
                self.log(f"WARNING: drafter graph capture failed ({self.broken}); the drafter runs eagerly from now on")
            self.capture_s += time.time() - t0
        self.graphs[key] = (g, inp, out)
        return self.graphs[key]

    @torch.inference_mode()
    def warm_up(self, max_batch: int, log=print) -> int:
        """Capture every batch size's graph now (a server's start-up; otherwise each is captured at its first
        use, inside a request's step) -> graphs captured. Only where one graph serves every length (paged)."""
        if not (self.capture and self.paged):
            return 0
        t0, before = time.time(), len(self.graphs)
        for B in range(1, max_batch + 1):
            self._entry(B, 0)
        n = sum(1 for g, _, _ in self.graphs.values() if g is not None) - before
        if n:
            log(f"captured {n} drafter graphs (B = 1..{max_batch}) in {time.time() - t0:.1f}s")
        return max(n, 0)

    def in_verify(self, step, tokens):
        """Run inside the target's verify step (SpecializedRunner.after_verify, captured in its graph): each row's
        accepted drafts as the host counts a greedy row's (the fed drafts equal to the target's tokens, in order),
        and from there the next block: anchored on the target's token after them, over the context through it.
        -> {"accepted" [B], "drafts" [B, k], "confs" [B, k] or None}, on the device. The host uses a row's block
        only where its own count agrees (DFlashDrafter.predrafted): forced or synthetic rows fall back, and sampled
        rows unless the step drew their tokens too (tokens: each row's draw then, speculative/decoder.py)."""
        T = step.spec_tokens
        B = tokens.shape[0] // T
        got, fed = tokens.view(B, T).long(), step.input_ids.view(B, T)
        a = (fed[:, 1:] == got[:, :-1]).long().cumprod(1).sum(1)
        lens = step.positions.view(B, T)[:, 0] + 1 + a
        ctx = PagedContext(self.writer.kv, step.block_tables, lens, self.bs)
        d, c, _ = self.model.draft_batch(got.gather(1, a[:, None])[:, 0], lens, ctx, None, self.k)
        return {"accepted": a, "drafts": d, "confs": c}

    @torch.inference_mode()
    def draft(self, blocks: list[list[int]], lens: list[int], anchors: list[int]):
        """B requests' block tables, fed lengths and last tokens -> (drafts [B][k], confidences [B][k] or None),
        read back in one copy."""
        B, L = len(lens), (0 if self.paged else bucket(max(lens), self.max_len))
        g, inp, out = self._entry(B, L)
        # only the blocks the fed positions use: the columns past them are never read (positions < lens)
        need = min(-(-max(lens) // self.bs), inp["tables"].shape[1])
        rows = [bl[:need] + [0] * (need - len(bl[:need])) for bl in blocks]
        inp["tables"][:, :need].copy_(torch.tensor(rows, dtype=torch.long))
        inp["lens"].copy_(torch.tensor(lens, dtype=torch.long))
        inp["anchors"].copy_(torch.tensor(anchors, dtype=torch.long))
        if g is not None:
            g.replay()
            self.replays += 1
            d, c = out
        else:
            d, c = self._run(inp, L)
        ids, confs = read_back([(d.reshape(-1), None if c is None else c.reshape(-1))])[0]
        k = d.shape[1]
        return ([ids[b * k:(b + 1) * k] for b in range(B)],
                None if confs is None else [confs[b * k:(b + 1) * k] for b in range(B)])
