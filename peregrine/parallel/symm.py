"""One-shot all-reduce over torch symmetric memory (docs/architecture.md "Tensor parallel").

Each rank's row-parallel GEMM writes its [B, D] partial sum straight into a buffer
every peer can read over NVLink; one kernel then waits for the peers (signal pads),
reads all N partials and writes the sum: one launch and one hop, against NCCL's
ring/tree protocol whose fixed cost dominates at a few KB. NVLink multicast stays
off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1; launch.py), so this is the plain
peer-to-peer one-shot, not multimem.

Two buffers alternate: a rank may start writing the next layer's partial while a
slower peer still reads this one; the next all-reduce's entry barrier orders it.
Capability gate: CUDA, the op present in this torch, a rendezvous that succeeds and
a first all-reduce whose result checks out; otherwise None (the caller uses NCCL).
"""
from __future__ import annotations

import warnings

import torch

BUFFERS = 2  # double buffering: see the module docstring


def op_available() -> str | None:
    """None when this torch has the one-shot op, else why not."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the build
        return f"no torch.distributed._symmetric_memory ({e})"
    if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
        return "torch.ops.symm_mem.one_shot_all_reduce missing in this torch"
    return None


class OneShot:
    def __init__(self, tp, rows: int, width: int, dtype, device):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as sm
        self.rows, self.width, self.dtype = rows, width, dtype
        group = tp.group or dist.group.WORLD
        self.group_name = group.group_name
        if hasattr(sm, "enable_symm_mem_for_group"):  # needed by older torch, a deprecated no-op in newer
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sm.enable_symm_mem_for_group(self.group_name)
        self.bufs = [sm.empty(rows, width, dtype=dtype, device=device) for _ in range(BUFFERS)]
        self.handles = [sm.rendezvous(b, group) for b in self.bufs]  # collective: every rank, same order
        self.i = 0

    @classmethod
    def create(cls, tp, rows: int, width: int, dtype, device, log=None):
        """The one-shot all-reduce, or None (with the reason logged) where it cannot run."""
        why = "not a CUDA device" if torch.device(device).type != "cuda" else op_available()
        me = None
        if why is None:
            try:
                me = cls(tp, rows, width, dtype, device)
                why = me.self_check(tp)
            except Exception as e:  # every rank fails alike (same torch, same driver)
                why = f"{type(e).__name__}: {e}"
        if why is not None:
            if log:
                log(f"tensor parallel: one-shot symmetric-memory all-reduce unavailable ({why}); the group all-reduce (NCCL on GPUs)")
            return None
        if log:
            log(f"tensor parallel: one-shot symmetric-memory all-reduce for rows ≤ {rows} x {width} "
                f"(NVLink multicast off), {BUFFERS} buffers")
        return me

    def self_check(self, tp) -> str | None:
        rows = torch.arange(self.rows * self.width, device=self.bufs[0].device).view(self.rows, self.width) % 7
        for _ in range(BUFFERS):
            self.buffer(self.rows).copy_(rows + tp.rank)
            out = self.all_reduce(self.buffer(self.rows))
            want = tp.world * rows + sum(range(tp.world))
            if not torch.equal(out.float(), want.to(self.dtype).float()):
                return "first all-reduce gave a wrong sum"
        torch.cuda.synchronize()
        self.reset()
        return None

    def reset(self) -> None:
        self.i = 0

    def buffer(self, rows: int) -> torch.Tensor:
        """The [rows, width] view the next all_reduce reads (write the partial sum here to skip a copy)."""
        return self.bufs[self.i][:rows]

    def usable(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.dim() == 2 and x.shape[0] <= self.rows and x.shape[1] == self.width and x.dtype == self.dtype

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if not self.usable(x):
            raise ValueError(f"one-shot all-reduce buffer is [{self.rows}, {self.width}] {self.dtype}, got {tuple(x.shape)} {x.dtype}")
        v = self.buffer(x.shape[0])
        if x.data_ptr() != v.data_ptr():
            v.copy_(x)
        self.i = (self.i + 1) % BUFFERS
        return torch.ops.symm_mem.one_shot_all_reduce(v, "sum", self.group_name)
