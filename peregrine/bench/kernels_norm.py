"""RMSNorm / fused add + RMSNorm microbenchmark (BENCHMARKS.md §2).

Timed as CUDA graphs rotating over enough input copies to exceed the 60 MB L2.
    python -m peregrine.bench.kernels_norm
"""
from __future__ import annotations

import itertools

import torch

from peregrine.bench.gpu import graph_time
from peregrine.bench.kernels_gemm import ROTATE_BYTES
from peregrine.kernels.norm import add_rms_norm, rms_norm

DS = (2304, 7168)  # Kimi-Linear and K3 hidden sizes
MS = (1, 2, 4, 8, 16)
MAX_COPIES = 512  # a 4.6 KB row needs thousands of copies to leave L2; this bounds capture size
EPS = 1e-5
DTYPE = torch.bfloat16
DEVICE = "cuda"  # a module constant so the bench logic can be smoke-tested on CPU


def _case(kind: str, m: int, d: int):
    size = 2  # BF16 bytes
    per = (2 if kind == "rms_norm" else 4) * m * d * size  # x (+ residual read and write) + out
    copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // per)))
    w = torch.randn(d, device=DEVICE).to(DTYPE)
    xs = [torch.randn(m, d, device=DEVICE).to(DTYPE) for _ in range(copies)]
    outs = [torch.empty_like(x) for x in xs]
    if kind == "rms_norm":
        calls = [lambda x=x, o=o: rms_norm(x, w, EPS, out=o) for x, o in zip(xs, outs)]
    else:
        rs = [torch.randn(m, d, device=DEVICE).to(DTYPE) for _ in range(copies)]
        calls = [lambda x=x, r=r, o=o: add_rms_norm(x, r, w, EPS, out=o) for x, r, o in zip(xs, rs, outs)]
    return calls, per + d * size


def run(copy_gbps: float, full: bool = True, iters: int = 30) -> list[dict]:
    rows = []
    for kind, d, m in itertools.product(("rms_norm", "add_rms_norm"), DS, MS if full else (1, 16)):
        calls, nbytes = _case(kind, m, d)
        t, samples = graph_time(calls, iters)
        gbps = nbytes / t / 1e6
        rows.append({"kernel": kind, "D": d, "M": m, "time_ms": t, "bytes": nbytes, "gbps": gbps,
                     "pct_of_copy": gbps / copy_gbps, "samples_ms": samples})
        del calls
    torch.cuda.empty_cache()
    return rows


def main():
    from peregrine.bench.gpu import family_main
    family_main("norm", run, lambda r: f"{r['kernel']:>13} {r['D']:>5} {r['M']:>3} {1e3 * r['time_ms']:>7.2f} "
                f"{r['gbps']:>7.0f} {100 * r['pct_of_copy']:>5.1f}%",
                header=f"{'kernel':>13} {'D':>5} {'M':>3} {'us':>7} {'GB/s':>7} {'%copy':>6}", doc=__doc__)


if __name__ == "__main__":
    main()
