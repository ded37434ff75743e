"""MLA prefill of a cold prompt through torch SDPA's cuDNN backend (the same math as mla_prefill.py).

For one sequence whose keys are its own queries (start = 0, T = L) top-left causal SDPA is the MLA
prefill mask, so cuDNN's fused attention (FA3-class on Hopper) can serve it. It takes full heads:
k = [k_nope | k_rope broadcast to every head] is assembled once ([L, H, Dn+Dr], one pass), q and v go
in as strided views, and the output is copied into the caller's [T, H, Dv] buffer. Same H200, same
shapes (results/2026-12-01-prefill/…-kernels-mla_prefill.json): cuDNN 0.073 / 1.25 / 18.6 ms against
the Triton kernel's 0.135 / 1.50 / 22.0 ms at T = 1K / 8K / 32K from position 0; with a cached
prefix (start > 0) the lower-right mask costs cuDNN an explicit mask and the Triton kernel wins
(7.8 vs 4.0 ms at 8K after 8K), so only cold rows come here.

Gate: a CUDA device, BF16 / FP16, torch's cuDNN SDPA enabled, T >= MIN_T; any error from the
backend (a cuDNN build that rejects the shape) turns the route off for the process with one
warning, and the caller's Triton kernel serves the row.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

MIN_T = 1024            # shortest cold row sent to cuDNN: it won at 1K, 8K and 32K (above); below, untimed
ENABLED: bool | None = None  # None: wherever the gate allows; tests force it on or off
_broken: str | None = None   # the first backend error seen: the route stays off after it


def usable(q: torch.Tensor, T: int, L: int, start: int) -> bool:
    """Whether the cuDNN route may serve this row (the caller falls back to the Triton kernel)."""
    if ENABLED is False or _broken is not None or start != 0 or T != L or T < MIN_T:
        return False
    if ENABLED:
        return True
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and torch.backends.cudnn.is_available()
            and torch.backends.cuda.cudnn_sdp_enabled())


def assemble_k(k_nope: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """[L, H, Dn] and the heads' shared [L, Dr] -> contiguous [L, H, Dn + Dr] (one write)."""
    L, H, Dn = k_nope.shape
    k = torch.empty(L, H, Dn + k_rope.shape[1], dtype=k_nope.dtype, device=k_nope.device)
    k[..., :Dn] = k_nope
    k[..., Dn:] = k_rope[:, None, :]
    return k


def attend(q, k_nope, k_rope, v, sm_scale: float, out: torch.Tensor, backend=None) -> torch.Tensor:
    """Causal attention of q [T, H, Dn+Dr] over its own T keys into out [T, H, Dv]; backend: an
    SDPBackend (default cuDNN; the CPU test passes MATH to check the layout work)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    k = assemble_k(k_nope, k_rope)
    heads = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731 - [N, H, d] -> [1, H, N, d], a view
    with sdpa_kernel(backend if backend is not None else SDPBackend.CUDNN_ATTENTION):
        o = scaled_dot_product_attention(heads(q), heads(k), heads(v), scale=float(sm_scale), is_causal=True)
    return out.copy_(o[0].transpose(0, 1))


def try_attend(q, k_nope, k_rope, v, sm_scale: float, out: torch.Tensor) -> bool:
    """attend(), or False (and the route off for good, with one warning) if the backend refuses."""
    global _broken
    try:
        attend(q, k_nope, k_rope, v, sm_scale, out)
        return True
    except RuntimeError as e:  # cuDNN missing / refusing the shape: the Triton kernel serves instead
        _broken = f"{type(e).__name__}: {e}"[:300]
        log.warning("MLA prefill: cuDNN SDPA refused a %d-token row (%s); the Triton kernel serves cold rows from now on",
                    q.shape[0], _broken)
        return False
