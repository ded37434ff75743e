"""MLA prefill of a cold prompt through torch SDPA's cuDNN backend (the same math as mla_prefill.py).

For one sequence whose keys are its own queries (start = 0, T = L) top-left causal SDPA is the MLA
prefill mask, so cuDNN's fused attention (FA3-class on Hopper) can serve it. It takes full heads:
k = [k_nope | k_rope broadcast to every head] is assembled once ([L, H, Dn+Dr], one pass), q and v go
in as they are when on the bucket grid and 16-byte aligned (else as padded copies), and the output is
copied into the caller's [T, H, Dv] buffer. Same H200, same
shapes (results/2026-12-01-prefill/…-kernels-mla_prefill.json): cuDNN 0.073 / 1.25 / 18.6 ms against
the Triton kernel's 0.135 / 1.50 / 22.0 ms at T = 1K / 8K / 32K from position 0; with a cached
prefix (start > 0) the lower-right mask costs cuDNN an explicit mask and the Triton kernel wins
(7.8 vs 4.0 ms at 8K after 8K), so only cold rows come here.

cuDNN builds a plan per sequence length (first call at a new length: ~70 ms at 8K and 32K, session 11's
kernels_mla_prefill run), so rows are padded up to a multiple of BUCKET (zero queries and keys at the end:
top-left causal, no real query sees them) and `warm` builds every bucket's plan at start-up (16K..32K:
17 plans in 0.8 s). The whole route at 32K: 18.9 ms a layer against the Triton kernel's 21.5 (same run).

Gate: a CUDA device, BF16 / FP16, torch's cuDNN SDPA enabled, T >= MIN_T; any error from the
backend (a cuDNN build that rejects the shape) turns the route off for the process with one
warning, and the caller's Triton kernel serves the row.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

MIN_T = 16384           # shortest cold row sent to cuDNN: at 8K the route gains ~0.2 ms a layer (1.42 vs 1.64), not a plan per bucket
BUCKET = 1024           # rows padded to a multiple: lengths share a plan; at >= 16K at most 13 % more work
# None: wherever the gate allows; tests force it on or off; PEREGRINE_MLA_CUDNN=0 turns it off (A/B runs)
ENABLED: bool | None = False if os.environ.get("PEREGRINE_MLA_CUDNN") == "0" else None
_broken: str | None = None   # the first backend error seen: the route stays off after it


def usable(q: torch.Tensor, T: int, L: int, start: int) -> bool:
    """Whether the cuDNN route may serve this row (the caller falls back to the Triton kernel)."""
    if ENABLED is False or _broken is not None or start != 0 or T != L or T < MIN_T:
        return False
    if ENABLED:
        return True
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and torch.backends.cudnn.is_available()
            and torch.backends.cuda.cudnn_sdp_enabled())


def padded(T: int) -> int:
    return -(-T // BUCKET) * BUCKET


ALIGN = 16  # bytes: cuDNN reads rows whose start and strides are 16-byte aligned (odd strides read NaN, session 11)


def _aligned(x: torch.Tensor) -> bool:
    return x.stride(-1) == 1 and x.data_ptr() % ALIGN == 0 and all(s * x.element_size() % ALIGN == 0
                                                                    for s in x.stride()[:-1])


def _padded_copy(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x padded with zero rows to `rows`; x itself when it has them and cuDNN can read its layout."""
    if x.shape[0] == rows and _aligned(x):
        return x
    y = x.new_empty(rows, *x.shape[1:])
    y[: x.shape[0]] = x
    y[x.shape[0]:] = 0
    return y


def assemble_k(k_nope: torch.Tensor, k_rope: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """[L, H, Dn] and the heads' shared [L, Dr] -> contiguous [rows (default L), H, Dn + Dr], zero past L."""
    L, H, Dn = k_nope.shape
    k = k_nope.new_empty(rows or L, H, Dn + k_rope.shape[1])
    k[:L, :, :Dn] = k_nope
    k[:L, :, Dn:] = k_rope[:, None, :]
    k[L:] = 0
    return k


def attend(q, k_nope, k_rope, v, sm_scale: float, out: torch.Tensor, backend=None) -> torch.Tensor:
    """Causal attention of q [T, H, Dn+Dr] over its own T keys into out [T, H, Dv]; backend: an
    SDPBackend (default cuDNN; the CPU test passes MATH to check the layout work). q and v go in as they are
    when T is on the bucket grid and their layout is aligned, else as zero-padded copies; k is assembled."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    T = q.shape[0]
    Tp = padded(T)
    heads = lambda x: x.transpose(0, 1).unsqueeze(0)  # noqa: E731 - [N, H, d] -> [1, H, N, d], a view
    qp, k, vp = _padded_copy(q, Tp), assemble_k(k_nope, k_rope, Tp), _padded_copy(v, Tp)
    with sdpa_kernel(backend if backend is not None else SDPBackend.CUDNN_ATTENTION):
        o = scaled_dot_product_attention(heads(qp), heads(k), heads(vp), scale=float(sm_scale), is_causal=True)
    return out.copy_(o[0, :, :T].transpose(0, 1))


def warm(H: int, Dn: int, Dr: int, Dv: int, sm_scale: float, dtype, device, max_T: int, log=None) -> int:
    """Build the plan of every bucket a cold row of up to max_T tokens can use (a server's start-up), on zero
    inputs; -> plans built (0 where the gate is shut or max_T < MIN_T)."""
    import time
    dev = torch.device(device)
    probe = torch.empty(0, device=dev, dtype=dtype)
    lengths = list(range(padded(MIN_T), padded(max_T) + 1, BUCKET)) if max_T >= MIN_T else []
    if not lengths or not usable(probe, lengths[0], lengths[0], 0):
        return 0
    t0 = time.time()
    n = lengths[-1]
    q, k, v = (torch.zeros(n, H, d, dtype=dtype, device=dev) for d in (Dn + Dr, Dn, Dv))
    kr = torch.zeros(n, Dr, dtype=dtype, device=dev)
    out = torch.empty(n, H, Dv, dtype=dtype, device=dev)
    for i, T in enumerate(lengths):
        if log and (i % 8 == 0 or i == len(lengths) - 1):
            log(f"MLA cold-row attention plans (cuDNN): {T} tokens ({i + 1}/{len(lengths)})")
        if not try_attend(q[:T], k[:T], kr[:T], v[:T], sm_scale, out[:T]):
            return i
    del q, k, v, kr, out
    if log:
        log(f"MLA cold-row attention plans ready: {len(lengths)} lengths ({lengths[0]}..{lengths[-1]}) in "
            f"{time.time() - t0:.1f}s")
    return len(lengths)


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
