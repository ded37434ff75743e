"""Fused Triton decode kernels, each file one family with its FP32 reference.

Capability gate: ``available(device)`` says whether the Triton kernels can run
there (a Hopper-or-newer CUDA device, or any CPU tensor when the Triton
interpreter is on). Callers fall back to the standard PyTorch path otherwise.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

try:  # triton is optional at import time: the standard path never needs it
    import triton  # noqa: F401
    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False

MIN_CAPABILITY = (9, 0)  # the kernels are tuned for Hopper; older GPUs take the standard path


# batch-invariant mode (--batch-invariant, docs/correctness.md §5): while on, the decode kernels take their tiles, split
# counts and plans from static sizes only (the weights' shapes, max_model_len), never from the batch, so a row's bits
# do not depend on the rows beside it. Set by the runner before each step and capture (engines in one process may differ).
_invariant = {"on": False, "max_len": 0}


def set_batch_invariant(on: bool, max_len: int = 0) -> None:
    _invariant["on"], _invariant["max_len"] = bool(on), int(max_len)


def batch_invariant() -> bool:
    return _invariant["on"]


def invariant_max_len() -> int:
    """The longest sequence an invariant-mode MLA decode may see (its fixed split length comes from it)."""
    return _invariant["max_len"]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device | str | None = None) -> bool:
    if not HAVE_TRITON:
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        return interpreting()
    if dev.type == "cuda" and not interpreting():
        return torch.cuda.get_device_capability(dev) >= MIN_CAPABILITY
    return False


def why_unavailable(device=None) -> str | None:
    if available(device):
        return None
    if not HAVE_TRITON:
        return "triton is not installed"
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        return "CPU without TRITON_INTERPRET=1"
    return f"GPU capability below sm_{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]}"


def read_plan_entries(path: Path, warn: str | None = None) -> dict:
    """The "entries" object of a tuned plan file (kernels/*_plan.json); {} when the file is missing,
    unreadable or malformed, so every shape takes its kernel's defaults. warn: name the plan in a
    warning when an existing file cannot be read."""
    try:
        entries = json.loads(path.read_text()).get("entries", {}) if path.exists() else {}
    except (OSError, ValueError, AttributeError) as e:
        if warn:
            warnings.warn(f"ignoring unreadable {warn} plan {path}: {e}")
        return {}
    return entries if isinstance(entries, dict) else {}

