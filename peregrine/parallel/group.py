"""The tensor-parallel group: this process's rank, the world size, and the
collectives the model calls (docs/architecture.md "Tensor parallel").

The world-1 group (SINGLE) does nothing: every collective returns its input,
so the single-GPU code path is the TP code path with no-ops. Collectives on
CUDA are NCCL calls on the current stream (capturable in a CUDA graph once the
communicator exists); on CPU the same calls run over gloo (tests). The all-reduce
after row-parallel layers may instead go through a one-shot symmetric-memory
all-reduce (parallel/symm.py), chosen per group with an NCCL fallback.
"""
from __future__ import annotations

import copy

import torch

from ..config import ConfigError


class TPGroup:
    def __init__(self, rank: int = 0, world: int = 1, device: torch.device | None = None, group=None, ctrl=None,
                 slice_replicated: bool = False):
        """group: the torch.distributed group of the collectives (None: the default group);
        ctrl: a CPU (gloo) group for the per-step control messages (parallel/control.py);
        slice_replicated: the models built on this group compute the router logits and the MLA
        latent (and q-LoRA query-down) projections as a slice per rank and all-gather them,
        instead of every rank computing them whole (parallel/shard.py)."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a world of {world}")
        self.rank, self.world, self.device, self.group, self.ctrl = rank, world, device, group, ctrl
        self.slice_replicated = slice_replicated and world > 1
        self.symm = None  # parallel.symm.OneShot when the symmetric-memory all-reduce is on

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, world={self.world}" + (", sliced)" if self.slice_replicated else ")")

    def with_slicing(self, on: bool) -> "TPGroup":
        """This group (same process group, same collectives) with slice_replicated set: one engine's choice."""
        if bool(on) == self.slice_replicated or self.world == 1:
            return self
        g = copy.copy(self)
        g.slice_replicated = bool(on)
        return g

    # ---- sizes ----
    def split(self, n: int, field: str) -> int:
        """This rank's share of n (n must divide evenly; the error names the config field)."""
        if n % self.world:
            raise ConfigError(f"tensor parallel size {self.world} does not divide '{field}' ({n}): "
                              f"choose a size that divides it")
        return n // self.world

    def span(self, n: int, field: str = "size") -> tuple[int, int]:
        """[lo, hi) of this rank's contiguous share of n."""
        k = self.split(n, field)
        return self.rank * k, (self.rank + 1) * k

    # ---- collectives ----
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (of partial results of a row-parallel layer); may work in place."""
        if self.world == 1:
            return x
        if self.symm is not None and self.symm.usable(x):
            return self.symm.all_reduce(x)
        import torch.distributed as dist
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_stacked(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x (at least 1-D) stacked in rank order: [world, *x.shape] (no concatenation copy)."""
        if self.world == 1:
            return x.unsqueeze(0)
        import torch.distributed as dist
        x = x.contiguous()
        out = torch.empty((self.world, *x.shape), dtype=x.dtype, device=x.device)
        if x.is_cuda:  # one buffer, no Python list: graph-capturable
            dist.all_gather_into_tensor(out.view(-1, *x.shape[1:]), x, group=self.group)
        else:
            dist.all_gather(list(out.unbind(0)), x, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's x along dim, in rank order."""
        if self.world == 1:
            return x
        return torch.cat(self.all_gather_stacked(x).unbind(0), dim)

    def argmax(self, local_logits: torch.Tensor, local_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy token over a vocab split in rank order: [S, V/N] local logits -> [S] int64 global ids.

        Each rank offers (its max, its global index); the highest value wins and ties go to the
        lowest rank, so the result is the lowest index of the global max, as argmax over the full
        row gives. local_ids: the rank's argmax when already computed (lowest index on ties)."""
        if local_ids is None:
            local_ids = local_logits.argmax(-1)
        if self.world == 1:
            return local_ids
        V = local_logits.shape[-1]
        best = local_logits.float().gather(-1, local_ids.view(-1, 1)).squeeze(-1)
        # FP64 pairs: the value is exact, and so is any index below 2^53
        pair = torch.stack([best.double(), (local_ids + self.rank * V).double()], -1)  # [S, 2]
        allp = self.all_gather(pair.unsqueeze(0), dim=0)                              # [N, S, 2]
        win = allp[..., 0].argmax(0)                                                  # first max: lowest rank
        return allp[..., 1].gather(0, win.unsqueeze(0)).squeeze(0).long()


SINGLE = TPGroup()
