"""RMSNorm / fused add + RMSNorm microbenchmark (docs/benchmarks.md §2), and KDA's gated output norm at
prefill sizes against the fla path it replaced (the cat of a row's two pieces at its snapshot cut, then
fla's rms_norm_gated).

Timed as CUDA graphs rotating over enough input copies to exceed the 60 MB L2.
    python -m peregrine.bench.kernels_norm
"""
from __future__ import annotations

import itertools

import torch

from peregrine.bench.gpu import graph_time
from peregrine.bench.kernels_gemm import ROTATE_BYTES
from peregrine.kernels.norm import add_rms_norm, gated_rms_norm, rms_norm

DS = (2304, 7168)  # Kimi-Linear and K3 hidden sizes
MS = (1, 2, 4, 8, 16)
MAX_COPIES = 512  # a 4.6 KB row needs thousands of copies to leave L2; this bounds capture size
EPS = 1e-5
DTYPE = torch.bfloat16
DEVICE = "cuda"  # a module constant so the bench logic can be smoke-tested on CPU
GATED_T = (1024, 8192, 32768)  # prefill rows of a cold prompt
GATED_H, GATED_D = 32, 128     # Kimi-Linear's KDA heads
TAIL = 64  # the second piece of a row cut at its last block end


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


def _gated_cases(T: int):
    """(name, calls, bytes) of one row's gated norm: the kernel writing in place, then (where fla is installed)
    the fla path it replaced, timed as the row's fla_ms."""
    Hd = GATED_H * GATED_D
    o = torch.randn(T, GATED_H, GATED_D, device=DEVICE).to(DTYPE)
    r = torch.randn(T, Hd, device=DEVICE).to(DTYPE)  # the 48B's low-rank gate output: contiguous (no copy for fla)
    w = torch.randn(GATED_D, device=DEVICE).to(DTYPE)
    out = torch.empty(T, Hd, device=DEVICE, dtype=DTYPE)
    nbytes = 3 * T * Hd * 2  # o and r read, out written
    cases = [("gated_rms_norm", [lambda: gated_rms_norm(o, r, w, EPS, out=out)], nbytes)]
    try:
        from fla.modules.fused_norm_gate import rms_norm_gated
    except Exception:  # fla absent: the kernel alone
        return cases
    cut = T - TAIL

    def fla_path():
        a = torch.cat([o[:cut], o[cut:]])  # the row's two chunk_kda outputs, joined
        rms_norm_gated(a.view(-1, GATED_D), r.reshape(-1, GATED_D).contiguous(), w, None, activation="sigmoid", eps=EPS)
    return cases + [("fla_gated+cat", [fla_path], nbytes)]


def run(copy_gbps: float, full: bool = True, iters: int = 30) -> list[dict]:
    rows = []
    for T in GATED_T if full else GATED_T[:1]:
        (name, calls, nbytes), *fla = _gated_cases(T)
        t, samples = graph_time(calls, iters)
        gbps = nbytes / t / 1e6
        rows.append({"kernel": name, "shape": f"{T} tokens x {GATED_H} heads x {GATED_D}", "D": GATED_H * GATED_D,
                     "M": T, "time_ms": t, "bytes": nbytes, "gbps": gbps, "pct_of_copy": gbps / copy_gbps,
                     "samples_ms": samples, "fla_ms": graph_time(fla[0][1], iters)[0] if fla else None})
        torch.cuda.empty_cache()
    for kind, d, m in itertools.product(("rms_norm", "add_rms_norm"), DS, MS if full else (1, 16)):
        calls, nbytes = _case(kind, m, d)
        t, samples = graph_time(calls, iters)
        gbps = nbytes / t / 1e6
        rows.append({"kernel": kind, "shape": f"M={m} D={d}", "D": d, "M": m, "time_ms": t, "bytes": nbytes, "gbps": gbps,
                     "pct_of_copy": gbps / copy_gbps, "samples_ms": samples})
        del calls
    torch.cuda.empty_cache()
    return rows


def main():
    from peregrine.bench.gpu import family_main
    family_main("norm", run, lambda r: f"{r['kernel']:>14} {r['D']:>5} {r['M']:>5} {1e3 * r['time_ms']:>7.2f} "
                f"{r['gbps']:>7.0f} {100 * r['pct_of_copy']:>5.1f}%",
                header=f"{'kernel':>14} {'D':>5} {'M':>5} {'us':>7} {'GB/s':>7} {'%copy':>6}", doc=__doc__)


if __name__ == "__main__":
    main()
