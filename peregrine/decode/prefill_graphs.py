"""Piecewise CUDA graphs of prefill steps on the standard path.

An eager prefill step is ~125 small launches a layer (norms, projections, the MoE's routing, sort,
grouped GEMMs and combine), so at 1–2K tokens the host, not the GPU, sets its time (H200, 48B,
profiled: a 1K chunk is 58 ms of kernels in 143 ms of wall time). The token-parallel work between
two attention cores (W_o, residual, MLP, residual, the next layer's norm and projections) does not
depend on how the tokens split into rows, so it is captured once per token bucket, padded rows riding
along and ignored. The cores (the KDA recurrence, MLA's cache writes and attention) depend on each
row's length, cached prefix and snapshot cuts, and run eagerly between the replays.

Segments read and write static buffers: the residual stream and the layers' projections ping-pong
between two copies (segment j reads one, writes the other), so a segment run twice (warm-up, then
its replay) gives the same result; a core's output is copied into its type's buffer before the next
segment. With capture=False the same buffers and padding run eagerly (the CPU tests' path).
"""
from __future__ import annotations

import time

import torch

from ..models import moe
from ..models.kda import SHORT_ROW_MAX_TOKENS
from .batch import StepInput
from .capture import capture

# padded token counts a graph is captured for: powers of two to 2K (the MoE reads every expert from ~1K
# tokens on, so padding there costs little), then steps of 1.5x (padding a long step costs compute)
BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def unsupported(model) -> str | None:
    """Why a model's prefill steps cannot be captured, or None."""
    cfg = model.cfg
    if model.tp.world > 1:
        return "tensor parallel"
    if cfg.attn_res_block_size:
        return "AttnRes layers"
    if cfg.expert_quant == "mxfp4" and not moe.mxfp4_grouped(next(model.parameters())):
        return "MXFP4 experts without the grouped kernel (the dequantize loop syncs on the expert list)"
    if model.dtype == torch.float32:
        return "FP32 (the grouped GEMM serves BF16; the experts' loop syncs on the expert list)"
    return None


class PrefillGraphs:
    """run(step) -> a generator: None after each `layers_per_piece` layers (if given), then the logits."""

    def __init__(self, model, cache, max_tokens: int, *, capture: bool = True, buckets=BUCKETS, log=None):
        self.model, self.cache, self.capture, self.log = model, cache, capture, log
        above = [b for b in buckets if b >= max_tokens]
        self.buckets = [b for b in buckets if b < max_tokens] + above[:1]  # the step budget's bucket ends the list
        self.kinds = [type(layer.attn).__name__ for layer in model.layers]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.buf: dict | None = None  # made at the first step, sized for the largest bucket
        self.broken: str | None = None
        self.capture_s = 0.0
        self.replays = 0

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def serves(self, step) -> bool:
        return (not self.broken and self.buckets and not step.is_decode and step.kda_ckpt is None
                and self.bucket(step.input_ids.shape[0]) is not None)

    def _alloc(self, like: torch.Tensor | None) -> torch.Tensor | None:
        if like is None:
            return None
        return torch.zeros(self.buckets[-1], *like.shape[1:], dtype=like.dtype, device=like.device)

    def _segment(self, j: int, Tb: int) -> None:
        """Segment j on the buffers' first Tb rows: ids or x[j % 2] (and layer j-1's core output and
        projections) -> x[(j + 1) % 2] and layer j's projections."""
        b, L = self.buf, len(self.kinds)
        if j == 0:
            x, pre = self.model.segment(0, b["ids"][:Tb])
        else:
            k = self.kinds[j - 1]
            pre_in = tuple(None if t is None else t[:Tb] for t in b["pre"][k][(j - 1) % 2])
            x, pre = self.model.segment(j, b["x"][j % 2][:Tb], b["o"][k][:Tb], pre_in)
        if b["x"][(j + 1) % 2] is None:  # first use: the buffers take the eager outputs' shapes
            b["x"] = [self._alloc(x), self._alloc(x)]
        b["x"][(j + 1) % 2][:Tb].copy_(x)
        if j < L:
            k = self.kinds[j]
            if k not in b["pre"]:
                b["pre"][k] = [tuple(self._alloc(t) for t in pre) for _ in range(2)]
            for dst, t in zip(b["pre"][k][j % 2], pre):
                if t is not None:
                    dst[:Tb].copy_(t)

    def _run_segment(self, j: int, Tb: int) -> None:
        if not self.capture or self.broken:
            return self._segment(j, Tb)
        g = self.graphs.get((Tb, j))
        if g is None:
            g = self._try_capture(j, Tb)
            if g is None:
                return self._segment(j, Tb)
        g.replay()
        self.replays += 1

    def _try_capture(self, j: int, Tb: int):
        t0 = time.time()
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            # the warm-ups also make the buffers; run twice, a segment gives the same result
            g, _ = capture(lambda: self._segment(j, Tb), self.pool)
        except Exception as e:  # keep serving, loudly: eager prefill is slower but correct
            self.broken = f"{type(e).__name__}: {e}"
            if self.log:
                self.log(f"WARNING: prefill graph capture failed ({self.broken}); prefill runs eagerly from now on")
            torch.cuda.synchronize()
            return None
        self.graphs[(Tb, j)] = g
        self.capture_s += time.time() - t0
        if self.log and j == len(self.kinds):
            n = sum(1 for key in self.graphs if key[0] == Tb)
            self.log(f"captured {n} prefill graphs for {Tb} tokens ({self.capture_s:.1f}s in all, "
                     f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated)")
        return g

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Capture every bucket's graphs now (a server's start-up; otherwise each is captured at its first
        step), with dummy prefills over the cache's scratch slot and block; then clear the buffers. Each
        bucket runs Tb and Tb - 1 tokens: the cores' Triton kernels (fla's, the KDA row kernel, the MLA
        prefill kernel) are compiled for lengths that are and are not multiples of 16 (Triton specializes
        on that) and autotuned here, not at a request's first step (a fresh machine: minutes)."""
        t0 = time.time()
        for n, Tb in enumerate(self.buckets):
            if self.broken:
                return
            if self.log:
                self.log(f"capturing prefill graphs: {Tb} tokens ({n + 1}/{len(self.buckets)})")
            for T in sorted({Tb, max(1, Tb - 1)}, reverse=True):
                if self.bucket(T) == Tb:
                    self._dummy_prefill([T])
        # two long rows in one step (two prompts arriving together): fla's varlen kernels, which such KDA rows
        # share, compile and autotune here, not at that step (a fresh machine's first server: 84 s, session 9);
        # 2n a multiple of 16 and 2n - 1 not, as above
        n = (SHORT_ROW_MAX_TOKENS // 8 + 1) * 8
        for rows in ((n, n), (n, n - 1)):
            if sum(rows) <= self.buckets[-1] and not self.broken:
                self._dummy_prefill(rows)
        # a short row cut one token before its end (a prompt of P = 64k + 1 tokens gets a KDA snapshot at P - 1):
        # the one-kernel recurrence over a single token, which Triton compiles apart (it specializes T = 1)
        if not self.broken:
            self._dummy_prefill([self.buckets[0]], cut=self.buckets[0] - 1)
        for t in [*self.buf["x"], *self.buf["o"].values(), *(u for v in self.buf["pre"].values() for p in v for u in p)]:
            if t is not None:
                t.zero_()
        if self.capture:
            torch.cuda.synchronize()
        if self.log:
            self.log(f"prefill graphs ready: {len(self.graphs)} for {len(self.buckets)} token buckets up to "
                     f"{self.buckets[-1]} in {time.time() - t0:.1f}s")

    def _dummy_prefill(self, rows: list[int], cut: int | None = None) -> None:
        """A prefill step of rows of these lengths, every one over the cache's scratch slot and block; cut: the
        first row's KDA layers split their recurrence there, as at a snapshot (none is taken)."""
        c = self.cache
        table = [c.scratch_block] * ((max(rows) + c.block_size - 1) // c.block_size)
        step = StepInput.build([([0] * r, 0, c.scratch_slot, table) for r in rows], c.block_size, c.latent.device)
        if cut is not None:
            step.kda_snapshots = {0: [(cut, None)]}
        for _ in self.run(step):
            pass

    def run(self, step, layers_per_piece: int | None = None):
        m, N = self.model, step.input_ids.shape[0]
        Tb = self.bucket(N)
        if self.buf is None:
            self.buf = {"ids": torch.zeros(self.buckets[-1], dtype=torch.long, device=step.input_ids.device),
                        "x": [None, None], "pre": {}, "o": {}}
        b = self.buf
        b["ids"][:N].copy_(step.input_ids)
        self._run_segment(0, Tb)
        L = len(self.kinds)
        for i, layer in enumerate(m.layers):
            k = self.kinds[i]
            pre = tuple(None if t is None else t[:Tb] for t in b["pre"][k][i % 2])
            o = layer.attn.core(pre, step, self.cache)
            if k not in b["o"]:  # MLA's core gives FP32 or, prefill rows only, the flash kernel's model dtype: FP32 here
                b["o"][k] = self._alloc(o.float() if k == "MLA" else o)
            b["o"][k][:N].copy_(o)
            self._run_segment(i + 1, Tb)
            if layers_per_piece and (i + 1) % layers_per_piece == 0 and i + 1 < L:
                yield None
        yield m._logits(b["x"][(L + 1) % 2][:N], step)
