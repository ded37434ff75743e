"""Issue #20's first measurement: the MoE decode block (router, top-k, routed experts, shared expert,
combine) as one persistent launch (kernels/persistent_moe.py) against today's chain of launches on
the same ops (kernels/moe.py's router + experts + combine, the shared expert through cuBLAS), each
captured in a CUDA graph (10 blocks per replay), at Kimi-Linear widths, per B.

Reports per B: µs per block, GB/s (router weights, each chosen expert's W1/W3/W2 once per assignment
for the persistent kernel and once per distinct expert for the chain, the shared expert) and % of the
copy bandwidth measured in the same run, with the outputs' agreement (BF16, relative RMSE).
    python -m peregrine.bench.persistent_moe [--batch-sizes 1,2,4,8]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from .gpu import copy_bandwidth, graph_time, result_path, run_metadata, write_result

REPS = 10  # blocks per graph replay: amortises the replay launch


def compile_check(model: str = "kimi-linear-48b-a3b") -> dict:
    """The persistent kernel compiled ahead of time for sm_90a at the model's widths (no GPU needed):
    registers, spills, shared memory from ptxas."""
    import triton
    from ..config import resolve_model
    from ..kernels import persistent_moe as P
    from .kernels_moe import compile_sm90
    cfg, _ = resolve_model(model)
    E, D, I, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_token
    IS = I * cfg.num_shared_experts
    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    n, c = (lambda v: ("i32", v)), (lambda v: ("constexpr", v))
    args = dict(task_ptr=(i32, 0), n_tasks=n(2000), queue_ptr=(i32, 0), cnt_ptr=(i32, 0), err_ptr=(i32, 0),
                epoch_ptr=(i32, 0), x_ptr=(bf, 0), wr_ptr=(bf, 0), bias_ptr=(f32, 0), w13_ptr=(bf, 0), w2_ptr=(bf, 0),
                ws13_ptr=(bf, 0), ws2_ptr=(bf, 0), logits_ptr=(f32, 0), ids_ptr=(i32, 0), tw_ptr=(f32, 0),
                h_ptr=(f32, 0), hs_ptr=(f32, 0), part_ptr=(f32, 0), out_ptr=(bf, 0), B=n(1), D=n(D), E=n(E), I=n(I),
                IS=n(IS), scaling=("fp32", 1.0), n_router=n(16), n_sup=n(64), n_up=n(32), c_topk=n(2), c_up=n(3),
                c_down=n(11), TOP_K=c(k), NJ=c(k + 1), RENORM=c(True), HAS_SHARED=c(True), BLOCK_B=c(P.BLOCK_B),
                BLOCK_N=c(P.BLOCK_N), BLOCK_K=c(P.BLOCK_K), BLOCK_NU=c(P.BLOCK_NU), BLOCK_KU=c(P.BLOCK_KU),
                BLOCK_E=c(triton.next_power_of_2(E)),
                BLOCK_I=c(triton.next_power_of_2(I)), BLOCK_IS=c(triton.next_power_of_2(IS)), BLOCK_M=c(P.BLOCK_M),
                MAX_SPINS=c(P.MAX_SPINS))
    return {"model": model} | compile_sm90(P._moe_block_kernel, args, P.NUM_WARPS, 1)


def main(argv=None) -> int:
    from ..config import resolve_model
    from ..kernels import moe as M
    from ..kernels import persistent_moe as P
    from ..models.layers import swiglu
    from ..testing import rel_rmse
    ap = argparse.ArgumentParser(prog="python -m peregrine.bench.persistent_moe", description=__doc__)
    ap.add_argument("--model", default="kimi-linear-48b-a3b")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    cfg, _ = resolve_model(a.model)
    E, D, I, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_token
    IS = I * cfg.num_shared_experts
    bf = dict(dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s, std: (torch.randn(*s, generator=g, device="cuda") * std).to(torch.bfloat16)  # noqa: E731
    gate_w, bias = r(E, D, std=D ** -0.5), torch.randn(E, generator=g, device="cuda") * 0.1
    w13, w2 = r(E, 2 * I, D, std=D ** -0.5), r(E, D, I, std=I ** -0.5)
    ws13, ws2 = r(2 * IS, D, std=D ** -0.5), r(D, IS, std=IS ** -0.5)
    bw = copy_bandwidth()
    print(f"{a.model}: E={E} D={D} I={I} top-{k} shared {IS}; copy bandwidth {bw['gbps']:.0f} GB/s")
    rows = []
    for B in (int(b) for b in a.batch_sizes.split(",")):
        x = r(B, D, std=1.0)
        s = P.Shapes(B=B, D=D, E=E, I=I, IS=IS, top_k=k)
        ws = P.Workspace(s, "cuda")
        out_p = torch.empty(B, D, **bf)
        out_c = torch.empty(B, D, **bf)

        def persistent():
            P.moe_block(x, gate_w, bias, w13, w2, ws13, ws2, ws, renormalize=cfg.moe_renormalize,
                        scaling=cfg.routed_scaling_factor, out=out_p)

        def chain():
            ids, tw = M.moe_route(x, gate_w, bias, k, cfg.moe_renormalize, cfg.routed_scaling_factor)
            sh = swiglu(x @ ws13.T) @ ws2.T
            M.moe_experts(x, w13, w2, ids, tw, out=out_c, add=sh)

        p_ms, p_samples = graph_time([persistent] * REPS)
        c_ms, c_samples = graph_time([chain] * REPS)
        persistent()
        chain()
        ids, _ = M.moe_route(x, gate_w, bias, k, cfg.moe_renormalize, cfg.routed_scaling_factor)
        distinct = int(torch.unique(ids).numel())
        wbytes = E * D * 2 + 3 * IS * D * 2
        p_bytes, c_bytes = wbytes + B * k * 3 * I * D * 2, wbytes + distinct * 3 * I * D * 2
        row = {"B": B, "distinct_experts": distinct, "persistent_ms": p_ms, "chain_ms": c_ms,
               "persistent_samples_ms": p_samples, "chain_samples_ms": c_samples,
               "persistent_bytes": p_bytes, "chain_bytes": c_bytes,
               "persistent_gbps": p_bytes / (p_ms * 1e-3) / 1e9, "chain_gbps": c_bytes / (c_ms * 1e-3) / 1e9,
               "rel_rmse_vs_chain": rel_rmse(out_p.float(), out_c.float()), "error_word": int(ws.err.item())}
        for w in ("persistent", "chain"):
            row[f"{w}_pct_copy_bw"] = 100 * row[f"{w}_gbps"] / bw["gbps"]
        print(f"B={B}: persistent {p_ms * 1e3:7.1f} us ({row['persistent_gbps']:5.0f} GB/s, "
              f"{row['persistent_pct_copy_bw']:4.1f} %), chain {c_ms * 1e3:7.1f} us ({row['chain_gbps']:5.0f} GB/s, "
              f"{row['chain_pct_copy_bw']:4.1f} %); outputs rel. RMSE {row['rel_rmse_vs_chain']:.1e}; "
              f"error word {row['error_word']}; chain samples' median {statistics.median(c_samples) * 1e3:.1f} us")
        rows.append(row)
    path = write_result(result_path(a.model, "persistent-moe", a.results_dir),
                        {"meta": run_metadata(), "copy_bandwidth": bw, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
