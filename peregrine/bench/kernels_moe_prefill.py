"""MoE prefill glue microbenchmark (docs/benchmarks.md §2): kernels/moe_prefill.py's gather_pairs,
swiglu_weighted and combine against the torch forms they replace in models/moe.py grouped_experts, at a
1K, an 8K and a 32K prompt's token-expert pairs (Kimi-Linear: top-8, I = 1024, D = 2304), timed as CUDA graphs rotating
over enough input copies to leave the 60 MB L2.
    python -m peregrine.bench.kernels_moe_prefill
"""
from __future__ import annotations

import torch

from peregrine.bench.gpu import graph_time
from peregrine.bench.kernels_gemm import ROTATE_BYTES
from peregrine.kernels.moe_prefill import combine, gather_pairs, swiglu_weighted
from peregrine.models.layers import swiglu

TOKENS = (1024, 8192, 32768)  # prompt tokens per step
TOP_K, I, D = 8, 1024, 2304
DTYPE = torch.bfloat16
DEVICE = "cuda"  # a module constant so the bench logic can be smoke-tested on CPU
MAX_COPIES = 16
GATHER_TILES = ((4, 256), (16, 256), (32, 256), (4, 1024), (8, 512))  # (rows, block) candidates beside the default


def _copies(per: int) -> int:
    return max(1, min(MAX_COPIES, -(-ROTATE_BYTES // per)))


def _swiglu_case(P: int):
    per = P * 2 * I * 2 + P * 4 + P * I * 2  # gu read, w read, h written
    n = _copies(per)
    gus = [torch.randn(P, 2 * I, device=DEVICE).to(DTYPE) for _ in range(n)]
    ws = [torch.rand(P, device=DEVICE) for _ in range(n)]
    hs = [torch.empty(P, I, device=DEVICE, dtype=DTYPE) for _ in range(n)]
    fused = [lambda g=g, w=w, h=h: swiglu_weighted(g, w, out=h) for g, w, h in zip(gus, ws, hs)]
    torch_form = [lambda g=g, w=w: (swiglu(g) * w.unsqueeze(-1)).to(DTYPE) for g, w in zip(gus, ws)]
    return fused, torch_form, per


def _gather_case(P: int):
    N = P // TOP_K
    per = N * D * 2 + P * 8 + P * D * 2  # x read, order read, xs written
    n = _copies(per)
    xs = [torch.randn(N, D, device=DEVICE).to(DTYPE) for _ in range(n)]
    order = torch.randperm(P, device=DEVICE)
    outs = [torch.empty(P, D, device=DEVICE, dtype=DTYPE) for _ in range(n)]
    fused = [lambda x=x, o=o: gather_pairs(x, order, TOP_K, out=o) for x, o in zip(xs, outs)]
    tiles = {f"{r}x{b}": [lambda x=x, o=o, t=(r, b): gather_pairs(x, order, TOP_K, out=o, tile=t) for x, o in zip(xs, outs)]
             for r, b in GATHER_TILES}
    return fused, [lambda x=x: x[order // TOP_K] for x in xs], per, tiles


def _combine_case(P: int):
    N = P // TOP_K
    per = P * D * 2 + P * 8 + N * D * 2  # ys read, inv read, out written
    n = _copies(per)
    yss = [torch.randn(P, D, device=DEVICE).to(DTYPE) for _ in range(n)]
    order = torch.randperm(P, device=DEVICE)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(P, device=DEVICE)
    outs = [torch.empty(N, D, device=DEVICE, dtype=DTYPE) for _ in range(n)]
    fused = [lambda ys=ys, o=o: combine(ys, inv, TOP_K, out=o) for ys, o in zip(yss, outs)]

    def torch_form(ys):
        y = torch.empty_like(ys)
        y[order] = ys
        return y.view(N, TOP_K, -1).sum(1, dtype=torch.float32).to(DTYPE)
    return fused, [lambda ys=ys: torch_form(ys) for ys in yss], per


def _combine_add_case(P: int):
    """The combine with the shared expert's output and the residual added in it, against the combine and the
    two adds it replaces (models/moe.py, models/kimi.py)."""
    N = P // TOP_K
    per = P * D * 2 + P * 8 + 3 * N * D * 2  # ys, inv, two addends read, out written
    n = _copies(per)
    yss = [torch.randn(P, D, device=DEVICE).to(DTYPE) for _ in range(n)]
    adds = [tuple(torch.randn(N, D, device=DEVICE).to(DTYPE) for _ in range(2)) for _ in range(n)]
    inv = torch.randperm(P, device=DEVICE)
    outs = [torch.empty(N, D, device=DEVICE, dtype=DTYPE) for _ in range(n)]
    fused = [lambda ys=ys, a=a, o=o: combine(ys, inv, TOP_K, out=o, add=a) for ys, a, o in zip(yss, adds, outs)]
    chain = [lambda ys=ys, a=a, o=o: a[1] + (combine(ys, inv, TOP_K, out=o) + a[0]) for ys, a, o in zip(yss, adds, outs)]
    return fused, chain, per


def run(copy_gbps: float, full: bool = True, iters: int = 20) -> list[dict]:
    rows = []
    for tokens in TOKENS if full else TOKENS[:1]:
        P = tokens * TOP_K
        for kernel, case in (("gather_pairs", _gather_case), ("swiglu_weighted", _swiglu_case),
                             ("combine", _combine_case), ("combine_add2", _combine_add_case)):
            fused, torch_form, nbytes, *tiles = case(P)
            t, samples = graph_time(fused, iters)
            tt, _ = graph_time(torch_form, iters)
            gbps = nbytes / t / 1e6
            rows.append({"kernel": kernel, "shape": f"{tokens} tokens x top-{TOP_K}", "time_ms": t, "torch_ms": tt,
                         "bytes": nbytes, "gbps": gbps, "pct_of_copy": gbps / copy_gbps, "samples_ms": samples}
                        | ({"tiles_ms": {name: graph_time(c, iters)[0] for name, c in tiles[0].items()}} if tiles else {}))
            del fused, torch_form
            torch.cuda.empty_cache()
    return rows


def compile_check() -> list[dict]:
    """Both kernels compiled ahead of time for sm_90a in BF16 (no GPU needed): ptxas's registers and spills."""
    from peregrine.bench.kernels_moe import compile_sm90
    from peregrine.kernels import moe_prefill as K
    bf, n, c = "*bf16", (lambda v: ("i32", v)), (lambda v: ("constexpr", v))
    sw = compile_sm90(K._swiglu_weighted_kernel, dict(gu_ptr=(bf, 0), w_ptr=("*fp32", 0), h_ptr=(bf, 0), I=n(I),
                                                      stride_gu=n(2 * I), stride_h=n(I), BLOCK=c(K.BLOCK_I), BF16=c(True)), 4, 1)
    cb = compile_sm90(K._combine_kernel, dict(ys_ptr=(bf, 0), inv_ptr=("*i64", 0), out_ptr=(bf, 0), a1_ptr=(bf, 0),
                                              a2_ptr=(bf, 0), D=n(D), stride_ys=n(D), stride_out=n(D), stride_a1=n(D),
                                              stride_a2=n(D), K=c(TOP_K), N_ADD=c(K.MAX_ADDENDS), BLOCK=c(K.BLOCK_D),
                                              BF16=c(True)), 4, 1)
    ga = compile_sm90(K._gather_pairs_kernel, dict(x_ptr=(bf, 0), order_ptr=("*i64", 0), xs_ptr=(bf, 0), P=n(8 * 1024),
                                                   D=n(D), stride_x=n(D), stride_xs=n(D), K=c(TOP_K), ROWS=c(K.gather_tile(D, 2)[0]),
                                                   BLOCK=c(K.gather_tile(D, 2)[1])), 4, 1)
    return [{"kernel": "swiglu_weighted"} | sw, {"kernel": "combine"} | cb, {"kernel": "gather_pairs"} | ga]


def main():
    from peregrine.bench.gpu import family_main
    family_main("moe-prefill", run, lambda r: f"{r['kernel']:>16} {r['shape']:>22} {1e3 * r['time_ms']:>9.1f} us "
                f"(torch form {1e3 * r['torch_ms']:>9.1f} us) {r['gbps']:>7.0f} GB/s {100 * r['pct_of_copy']:>5.1f}%"
                + "".join(f"  {k} {1e3 * v:.1f} us" for k, v in r.get("tiles_ms", {}).items()),
                doc=__doc__)


if __name__ == "__main__":
    main()
