"""Programmatic Dependent Launch (PDL) for the decode kernels, Hopper and newer.

A kernel launched with PDL (``launch_pdl=True``: CUDA's programmatic stream serialization)
may start while its stream predecessor is still running, once every program of that
predecessor has called ``griddepcontrol.launch_dependents`` (or exited). It then loads what
no earlier kernel writes (weights) and calls ``griddepcontrol.wait``, which blocks until
every prerequisite grid has completed and its memory is visible, before it reads or writes
anything else. Only the edge into a PDL-launched kernel is relaxed: a normally launched
kernel, a cuBLAS call or a copy in between waits for full completion as always, and since
every PDL kernel here waits before touching activations, caches or outputs, it is safe
whoever its predecessor is (wait is a no-op for a normal launch). The edge is captured
into CUDA graphs as a programmatic dependency (CUDA 12.3+).

Two launches back. Every PDL kernel here triggers its dependents only from ``pdl_wait``, i.e. after
its own wait returned (its predecessor complete), and every one has programs that reach it. So when
kernel N + 1 starts, kernel N has passed its wait and kernel N - 1 has completed, its memory visible:
before its wait, N + 1 may also read what N - 1 and earlier kernels wrote (expert ids of the router,
two launches before the down projection).
Such a kernel says so where it does it, and its caller must guarantee the launch in between (a normal
launch between counts too: it starts only after its predecessor completes). A program that exits
without reaching ``pdl_wait`` counts as triggering, so a kernel's early-exiting programs are fine as
long as some program of it waits.

Kernels take ``USE_PDL: tl.constexpr`` and call ``pdl_wait(USE_PDL)`` at their boundary;
the launch sites add ``**launch_kwargs(device)``. Under the Triton interpreter (which has
no inline asm) the gdc calls are no-ops, so the PDL code path - loads moved ahead of the
wait - still runs in the CPU tests. Off by default; ``set_pdl`` / ``pdl`` switch it
process-wide, read at launch time (graph capture bakes it in).
"""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from . import interpreting

PDL_CAPABILITY = (9, 0)  # griddepcontrol is sm_90+
_STATE = {"on": False}

if interpreting():
    @triton.jit
    def _gdc_wait():
        pass

    @triton.jit
    def _gdc_launch_dependents():
        pass
else:
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """The dependency boundary: wait for the predecessor grid(s), then let the next kernel launch
    (its programs then prefetch their weights while this one runs; at most one kernel ahead,
    since the next one cannot pass its own wait, and so trigger, before this one completes)."""
    if USE_PDL:
        _gdc_wait()
        _gdc_launch_dependents()


def set_pdl(on: bool) -> None:
    """Process-wide switch read by every PDL-capable launch from now on."""
    _STATE["on"] = bool(on)


def pdl_enabled() -> bool:
    return _STATE["on"]


@contextlib.contextmanager
def pdl(on: bool):
    """Set the switch for a block (e.g. a graph capture), restoring the previous value after."""
    prev = _STATE["on"]
    _STATE["on"] = bool(on)
    try:
        yield
    finally:
        _STATE["on"] = prev


@functools.lru_cache(maxsize=None)
def supported(device_type: str, index: int | None) -> bool:
    """PDL launches need a Hopper-or-newer CUDA device and compiled (not interpreted) kernels."""
    if device_type != "cuda" or interpreting() or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(index) >= PDL_CAPABILITY


def launch_kwargs(device) -> dict:
    """Extra launch arguments for a PDL-capable kernel: {} when off. Interpreter: the PDL code
    path with no-op gdc calls (launch_pdl is dropped by the interpreter anyway)."""
    if not _STATE["on"]:
        return {}
    if interpreting():
        return {"USE_PDL": True}
    dev = torch.device(device)
    if not supported(dev.type, dev.index):
        return {}
    return {"USE_PDL": True, "launch_pdl": True}
