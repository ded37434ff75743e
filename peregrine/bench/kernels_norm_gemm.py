"""Residual add + RMSNorm fused into the decode GEMM (kernels/norm_gemm.py) against the two-kernel chain it
would replace (kernels/norm.add_rms_norm, then kernels/gemm.skinny_gemm), at the attention in-projections of
kimi-linear-48b-a3b (KDA 12576 x 2304, MLA 6720 x 2304) and B = 1 / 2 / 4 / 8. Both timed as CUDA graphs
rotating over weight copies that leave the L2 (as bench kernels_gemm); bytes are the weight, x, the
residual read and written, the norm weight and y. Issue #20 (fewer, fatter kernels).
    python -m peregrine.bench.kernels_norm_gemm [--quick]
"""
from __future__ import annotations

import torch

from peregrine.bench import kernels_gemm as kg
from peregrine.kernels.gemm import skinny_gemm
from peregrine.kernels.norm import add_rms_norm
from peregrine.kernels.norm_gemm import norm_gemm

SHAPES = ((12576, 2304), (6720, 2304))  # (N, K): the KDA and MLA in_proj of kimi-linear-48b-a3b
MS = (1, 2, 4, 8)
EPS = 1e-6


def run(copy_gbps: float, full: bool = True, iters: int = 30) -> list[dict]:
    rows = []
    for n, k in SHAPES if full else SHAPES[:1]:
        for m in MS if full else (1, 8):
            case = kg.Case(m, n, k)
            dt = case.x.dtype
            r = torch.randn(m, k, device=kg.DEVICE).to(dt)
            ro = torch.empty_like(r)
            nw = torch.ones(k, device=kg.DEVICE, dtype=dt)
            res = r.clone()  # the chain adds into its residual in place, as the decode step does
            fused = lambda w: norm_gemm(case.x, nw, w, EPS, residual=r, residual_out=ro, out=case.y)  # noqa: E731
            chain = lambda w: skinny_gemm(add_rms_norm(case.x, res, nw, EPS)[0], w, out=case.y)  # noqa: E731
            w0 = case.ws[0]
            y_chain = skinny_gemm(add_rms_norm(case.x, r.clone(), nw, EPS)[0], w0).float()
            err = ((fused(w0).float() - y_chain).norm() / y_chain.norm()).item()  # same inputs, both forms
            t, samples = case.time(fused, iters)
            tc, chain_samples = case.time(chain, iters)
            nbytes = case.bytes + (2 * m * k + k) * dt.itemsize
            gbps = nbytes / t / 1e6
            rows.append({"kernel": "norm_gemm", "shape": f"M={m} N={n} K={k}", "M": m, "N": n, "K": k,
                         "time_ms": t, "chain_ms": tc, "rel_err_vs_chain": err, "bytes": nbytes, "gbps": gbps, "pct_of_copy": gbps / copy_gbps,
                         "samples_ms": samples, "chain_samples_ms": chain_samples})
            del case
            torch.cuda.empty_cache()
    return rows


def compile_check() -> list[dict]:
    """The fused kernel for sm_90a in BF16 (no GPU needed) at the plan's dot and FMA tiles: registers, spills."""
    from peregrine.bench.kernels_moe import compile_sm90
    from peregrine.kernels import gemm
    from peregrine.kernels import norm_gemm as K
    bf, n, c = "*bf16", (lambda v: ("i32", v)), (lambda v: ("constexpr", v))
    out = []
    for m in (1, 8):
        cfg = gemm.heuristic(m, 12576, 2304)
        dot = cfg["dot"]
        args = dict(x_ptr=(bf, 0), r_ptr=(bf, 0), ro_ptr=(bf, 0), nw_ptr=(bf, 0), w_ptr=(bf, 0), y_ptr=(bf, 0),
                    M=n(m), N=n(12576), K=n(2304), stride_xm=n(2304), stride_rm=n(2304), stride_rom=n(2304),
                    stride_wn=n(2304), stride_ym=n(12576), stride_ys=n(0), k_per_split=n(2304), eps=("fp32", EPS),
                    BLOCK_M=c(gemm.DOT_MIN_ROWS if dot else min(m, gemm.FMA_MAX_ROWS)), BLOCK_N=c(cfg["BLOCK_N"]),
                    BLOCK_K=c(cfg["BLOCK_K"]), USE_DOT=c(dot), IEEE=c(False), EVEN_K=c(True), HAS_RES=c(True))
        out.append({"M": m} | compile_sm90(K._norm_gemm_kernel, args, cfg["num_warps"], cfg["num_stages"]))
    return out


def main():
    from peregrine.bench.gpu import family_main
    family_main("norm-gemm", run, lambda r: f"{r['shape']:>22} fused {1e3 * r['time_ms']:8.1f} us, chain "
                f"{1e3 * r['chain_ms']:8.1f} us  {r['gbps']:6.0f} GB/s {100 * r['pct_of_copy']:5.1f}% of copy, "
                f"rel err vs chain {r['rel_err_vs_chain']:.1e}", doc=__doc__)


if __name__ == "__main__":
    main()
