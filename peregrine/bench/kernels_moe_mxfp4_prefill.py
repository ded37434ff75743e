"""The MoE prefill's grouped GEMM over MXFP4 experts (kernels/moe_mxfp4_prefill.py; docs/benchmarks.md §2) at a 1K,
an 8K and a 32K prompt's token-expert pairs on Kimi-Linear's experts (256, top-8, I = 1024, D = 2304; uniform routing:
P / 256 rows an expert, every expert read): up (2I x D) and down (D x I) against torch's BF16 grouped GEMM on the same
sorted rows and BF16 weights (what the BF16 48B runs), each with its GB/s over the MXFP4 weights and the rows read and
written, and TFLOP/s; then the whole experts (models/moe.py grouped_experts: sort, up, activation, down, combine) over
MXFP4 against BF16, and against the dequantize loop over the used experts it replaced (eager: it syncs, so timed once
with events, not as a graph). CUDA graphs of one call each (the weights, 0.6-2.4 GB, leave the L2 anyway).
    python -m peregrine.bench.kernels_moe_mxfp4_prefill [--quick]
"""
from __future__ import annotations

import torch

from peregrine.bench.gpu import graph_time
from peregrine.models.layers import swiglu

TOKENS = (1024, 8192, 32768)  # prompt tokens per step
E, TOP_K, I, D = 256, 8, 1024, 2304
DTYPE = torch.bfloat16
SCALE = 120  # E8M0 of the dummy weights: 2^-7, values of the order of a trained layer's
ITERS = 10


def _weights(R: int, K: int):
    """MXFP4 experts [E, R, K] in the v4 layout (random codes) and the BF16 weights they decode to."""
    from peregrine.kernels import mxfp4_repack
    from peregrine.kernels.mxfp4_format import GROUP
    q = torch.randint(0, 256, (E, R, K // 2), device="cuda", dtype=torch.uint8)
    codes, scales = mxfp4_repack.repack(q, torch.full((E, R, K // GROUP), SCALE, device="cuda", dtype=torch.uint8))
    return codes, scales, mxfp4_repack.dequantize(codes, scales, DTYPE)


def _gemms(tokens: int) -> list[dict]:
    from peregrine.kernels.moe_mxfp4_prefill import grouped_mm
    P = tokens * TOP_K
    counts = torch.full((E,), P // E, device="cuda", dtype=torch.int64)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = []
    for name, R, K in (("up", 2 * I, D), ("down", D, I)):
        q, s, wb = _weights(R, K)
        a = torch.randn(P, K, device="cuda").to(DTYPE)
        o = torch.empty(P, R, device="cuda", dtype=DTYPE)
        t, samples = graph_time([lambda: grouped_mm(a, q, s, counts, True, out=o)], ITERS)
        tb, _ = graph_time([lambda: torch._grouped_mm(a, wb.transpose(1, 2), offs=offs)], ITERS)
        rows.append({"kernel": f"grouped_mm {name}", "shape": f"{tokens} tokens x top-{TOP_K}", "time_ms": t,
                     "torch_ms": tb, "bytes": q.numel() + s.numel() + (a.numel() + o.numel()) * 2,
                     "tflops": 2 * P * R * K / t / 1e9, "torch_tflops": 2 * P * R * K / tb / 1e9, "samples_ms": samples})
        del q, s, wb, a, o
        torch.cuda.empty_cache()
    return rows


def _experts(tokens: int) -> dict:
    from peregrine.kernels.mxfp4_repack import dequantize
    from peregrine.models import moe
    q13, s13, w13 = _weights(2 * I, D)
    q2, s2, w2 = _weights(D, I)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, D, device="cuda", generator=g).to(DTYPE)
    ids = torch.rand(tokens, E, device="cuda", generator=g).topk(TOP_K, dim=-1).indices
    w = torch.rand(tokens, TOP_K, device="cuda", generator=g)
    mx = (q13, s13, q2, s2, True)
    t, samples = graph_time([lambda: moe.grouped_experts(x, None, None, ids, w, swiglu, mx=mx)], ITERS)
    tb, _ = graph_time([lambda: moe.grouped_experts(x, w13, w2, ids, w, swiglu)], ITERS)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    moe.mxfp4_experts(x, q13, s13, q2, s2, ids, w, swiglu, dequantize=dequantize)  # warm
    start.record()
    moe.mxfp4_experts(x, q13, s13, q2, s2, ids, w, swiglu, dequantize=dequantize)
    end.record()
    torch.cuda.synchronize()
    nbytes = sum(v.numel() for v in (q13, s13, q2, s2)) + x.numel() * 2 * 2
    return {"kernel": "experts", "shape": f"{tokens} tokens x top-{TOP_K}", "time_ms": t, "torch_ms": tb,
            "loop_ms": start.elapsed_time(end), "bytes": nbytes, "tflops": 2 * tokens * TOP_K * 3 * I * D / t / 1e9,
            "samples_ms": samples}


def run(copy_gbps: float, full: bool = True) -> list[dict]:
    rows = []
    for tokens in TOKENS if full else TOKENS[:2]:
        for r in _gemms(tokens) + [_experts(tokens)]:
            gbps = r["bytes"] / r["time_ms"] / 1e6
            rows.append(r | {"gbps": gbps, "pct_of_copy": gbps / copy_gbps})
        torch.cuda.empty_cache()
    return rows


def compile_check() -> list[dict]:
    """The kernel compiled ahead of time for sm_90a in BF16 at its default tile (no GPU needed): registers, spills."""
    from peregrine.bench.kernels_moe import compile_sm90
    from peregrine.kernels import moe_mxfp4_prefill as M
    n, c = (lambda v: ("i32", v)), (lambda v: ("constexpr", v))
    R, K = 2 * I, D
    args = dict(a_ptr=("*bf16", 0), rows_ptr=("*i64", 0), codes_ptr=("*u8", 0), scale_ptr=("*u8", 0),
                cum_rows_ptr=("*i32", 0), cum_blocks_ptr=("*i32", 0), out_ptr=("*bf16", 0), R=n(R), K=n(K), E=n(E),
                stride_a=n(K), stride_ce=n(R * K // 2), stride_cr=n(K // 2), stride_se=n(R * K // 32), stride_sr=n(1),
                stride_sg=n(R), stride_o=n(R), HAS_ROWS=c(True), V4=c(True), LOG2_E=c(8), IEEE=c(False),
                BLOCK_M=c(M.BLOCK_M), BLOCK_N=c(M.BLOCK_N), BLOCK_K=c(M.BLOCK_K))
    return [{"kernel": "grouped_mm"} | compile_sm90(M._grouped_mm_kernel, args, M.NUM_WARPS, M.NUM_STAGES)]


def main():
    from peregrine.bench.gpu import family_main
    family_main("moe-mxfp4-prefill", run, lambda r: (
        f"{r['kernel']:>16} {r['shape']:>22} {1e3 * r['time_ms']:>9.1f} us (BF16 {1e3 * r['torch_ms']:>9.1f} us) "
        f"{r['gbps']:>6.0f} GB/s {100 * r['pct_of_copy']:>5.1f}% {r['tflops']:>5.0f} TFLOP/s"
        + (f"  dequantize loop {r['loop_ms']:.1f} ms" if "loop_ms" in r else "")), doc=__doc__)


if __name__ == "__main__":
    main()
