"""Helpers shared by the kernel and model tests (docs/correctness.md §1)."""
from __future__ import annotations

import torch


def rel_rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere gives inf so it never passes."""
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    if o.shape != r.shape:
        raise AssertionError(f"shape mismatch: {tuple(o.shape)} vs {tuple(r.shape)}")
    if not torch.isfinite(o).all():
        return float("inf")
    den = r.norm().item()
    return (o - r).norm().item() / (den if den > 0 else 1.0)


def assert_close(out, ref, tol: float, what: str = "output") -> None:
    e = rel_rmse(out, ref)
    assert e <= tol, f"{what}: relative RMSE {e:.3e} > {tol:.1e}"


def poisoned(shape, dtype, device) -> torch.Tensor:
    """An output buffer filled with NaN, so an unwritten element fails the check."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


SENTINEL = 12345.0  # written into slots a kernel must not touch; checked bit-for-bit
