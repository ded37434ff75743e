"""The sampler's microbenchmark (issue #41, docs/benchmarks.md §2): kernels/sampling.py's argmax and sort-free
sample at the Kimi vocabulary (163 840 FP32 logits a row), B = 1..16, per setting (greedy rows through
sample, temperature only, top-p 0.95 as chat clients send it, top-k 50 + top-p, min-p; where a search runs,
the default (the candidates, then the descent for rows they cannot settle) against the descent alone at 16
(the default), 64, 32, 128 and 8 pivots a level (a level's tile 4096 / pivots wide) and the one-program
bisection, on random logits x3 (the candidates settle them), on flat rows (x0.3:
every row takes the descent, as dummy weights' rows do) and on a peaked head, against the path it
replaces (engine/sampling.py before #41: full sort, softmax, cumsum, scatter, one multinomial a row) where
that is timeable in a graph, timed as CUDA graphs; and the step's logprobs (kernels/logprobs.py) against
torch's logsumexp + topk. GB/s counts one read of the logits.
    python -m peregrine.bench.kernels_sampling [--quick]
"""
from __future__ import annotations

import contextlib
import os

import torch

from peregrine.bench.gpu import graph_time
from peregrine.kernels.pdl import pdl
from peregrine.kernels import sampling as K
from peregrine.kernels.logprobs import token_logprobs, token_logprobs_ref
from peregrine.kernels.sampling import argmax, sample

VOCAB = 163840
BATCHES = (1, 2, 4, 8, 16)
SETTINGS = {  # name: (temperature, top_k, top_p, min_p)
    "greedy": (0.0, 0, 1.0, 0.0),
    "temperature": (0.8, 0, 1.0, 0.0),
    "top_p_0.95": (0.6, 0, 0.95, 0.0),
    "top_k_50_top_p_0.9": (0.7, 50, 0.9, 0.0),
    "min_p_0.05": (1.0, 0, 1.0, 0.05),
}


SEARCH_AB = {"radix": dict(search="radix"), "radix_nb32": dict(search="radix", nb=32),
             "radix_nb128": dict(search="radix", nb=128), "radix_nb64": dict(search="radix", nb=64),
             "radix_nb8": dict(search="radix", nb=8), "bisect": dict(search="bisect")}
DESCENT_BLOCKS = (1024, 2048, 4096)  # the descent's slice a program weighs, fixed for every B (default: by B)


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name)
        else:
            os.environ[name] = old
PEAK = 4.0  # logits x 3 x 4: the top tokens stand ~20 / T above the rest, as on real text
FLAT = 0.1  # logits x 3 x 0.1: the whole row within CUT of its max, as dummy weights give: every row takes the descent


def _sorted_sampler(logits, t, p):
    """What the engine did before: full-vocabulary sort and the nucleus by cumsum (the multinomial's host
    loop left out: it cannot be captured)."""
    x = logits / t[:, None]
    sx, order = x.sort(dim=-1, descending=True)
    pr = sx.softmax(-1)
    drop = (pr.cumsum(-1) - pr) >= p[:, None]
    out = torch.empty_like(x)
    out.scatter_(-1, order, sx.masked_fill(drop, float("-inf")).softmax(-1))
    return out


def run(copy_gbps: float, full: bool = True, iters: int = 50) -> list[dict]:
    rows = []
    for B in BATCHES if full else (1, 8):
        g = torch.Generator(device="cuda").manual_seed(B)
        logits = torch.randn(B, VOCAB, device="cuda", generator=g) * 3
        seeds = torch.arange(B, device="cuda", dtype=torch.int64) * 7919
        pos = torch.full((B,), 4096, device="cuda", dtype=torch.int64)
        out = torch.empty(B, dtype=torch.int64, device="cuda")
        nbytes = logits.numel() * 4
        t_arg, _ = graph_time([lambda: argmax(logits)], iters)
        rows.append({"kernel": "argmax", "B": B, "time_ms": t_arg, "gbps": nbytes / t_arg / 1e6,
                     "pct_of_copy": nbytes / t_arg / 1e6 / copy_gbps})
        ids = argmax(logits)  # the chosen tokens logprobs gathers: in range (out is uninitialised until a sample)
        t_lp, lp_samples = graph_time([lambda: token_logprobs(logits, ids)], iters)
        rows.append({"kernel": "logprobs", "B": B, "time_ms": t_lp, "samples_ms": lp_samples,
                     "gbps": nbytes / t_lp / 1e6, "pct_of_copy": nbytes / t_lp / 1e6 / copy_gbps,
                     "torch_ms": graph_time([lambda: token_logprobs_ref(logits, ids)], iters)[0]})
        for name, (t, k, p, mp) in SETTINGS.items() if full else list(SETTINGS.items())[1:3]:
            f = lambda v, dt: torch.full((B,), v, device="cuda", dtype=dt)  # noqa: E731
            args = (f(t, torch.float32), f(k, torch.int32), f(p, torch.float32), seeds, pos, f(mp, torch.float32))
            kw0 = dict(top_k_any=k > 0)  # as the engine calls it: top-k's levels only where a row uses top-k
            ms, samples = graph_time([lambda: sample(logits, *args, out=out, **kw0)], iters)  # the default search
            row = {"kernel": f"sample {name}", "B": B, "time_ms": ms, "samples_ms": samples,
                   "gbps": nbytes / ms / 1e6, "pct_of_copy": nbytes / ms / 1e6 / copy_gbps, "vs_argmax": ms / t_arg}
            if name == "top_p_0.95":
                row["sorted_ms"] = graph_time([lambda: _sorted_sampler(logits, args[0], args[2])], iters)[0]
            if name in ("top_p_0.95", "top_k_50_top_p_0.9"):  # as the decode step launches them: with PDL
                with pdl(True):
                    row["pdl_ms"] = graph_time([lambda: sample(logits, *args, out=out, **kw0)], iters)[0]
                    row["pdl_radix_ms"] = graph_time([lambda: sample(logits, *args, out=out, search="radix", **kw0)],
                                                     iters)[0]
            if name in ("top_p_0.95", "top_k_50_top_p_0.9"):  # the other searches, for the A/B
                for label, kw in SEARCH_AB.items():
                    row[f"{label}_ms"] = graph_time([lambda: sample(logits, *args, out=out, **kw0, **kw)], iters)[0]
                for blk in DESCENT_BLOCKS:
                    with _env(K.DESCENT_BLOCK_ENV, str(blk)):
                        row[f"radix_block{blk}_ms"] = graph_time(
                            [lambda: sample(logits, *args, out=out, search="radix", **kw0)], iters)[0]
                if k == 0:  # what skipping top-k's levels saves
                    row["radix_topk_levels_ms"] = graph_time(
                        [lambda: sample(logits, *args, out=out, search="radix", top_k_any=True)], iters)[0]
                flat = logits * FLAT  # every token within the cut of the max (dummy weights' rows): the descent
                row["flat_ms"] = graph_time([lambda: sample(flat, *args, out=out, **kw0)], iters)[0]
                peaked = logits * PEAK  # a head the candidates hold: what they save where they settle
                row["peaked_ms"] = graph_time([lambda: sample(peaked, *args, out=out, **kw0)], iters)[0]
                row["peaked_radix_ms"] = graph_time([lambda: sample(peaked, *args, out=out, search="radix", **kw0)],
                                                    iters)[0]
            rows.append(row)
    return rows


def compile_check() -> list[dict]:
    """The sampling kernels compiled ahead of time for sm_90a (no GPU needed): ptxas's registers, spills."""
    from peregrine.bench.kernels_moe import compile_sm90
    p, n, c = (lambda t: (t, 0)), (lambda v: ("i32", v)), (lambda v: ("constexpr", v))
    out = []
    for R, block in ((1, K.THRESHOLD_TILE), (16, 256)):  # the real vocabulary; a tiny model's rows packed
        common = dict(x_ptr=p("*fp32"), stride_x=n(VOCAB), B=n(8), V=n(VOCAB), temp_ptr=p("*fp32"), R=c(R))
        th = compile_sm90(K._threshold, common | dict(topk_ptr=p("*i64"), topp_ptr=p("*fp32"), minp_ptr=p("*fp32"),
                                                      key_ptr=p("*i32"), BLOCK=c(block)), 8 if R == 1 else 4, 1)
        race = compile_sm90(K._race_stage1, common | dict(key_ptr=p("*i32"), seed_ptr=p("*i64"), pos_ptr=p("*i64"),
                                                          pmax_ptr=p("*fp32"), pidx_ptr=p("*i32"),
                                                          BLOCK=c(K.BLOCK_V if R == 1 else block)), 8 if R == 1 else 4, 1)
        st2 = compile_sm90(K._race_stage2, dict(pmax_ptr=p("*fp32"), pidx_ptr=p("*i32"), out_ptr=p("*i64"), B=n(8),
                                                n_chunks=n(40), R=c(R), CBLOCK=c(64)), 1, 1)
        out += [{"kernel": f"threshold R={R}"} | th, {"kernel": f"race R={R}"} | race, {"kernel": f"race_stage2 R={R}"} | st2]
    nc, cb = VOCAB // K.BLOCK_V, 64  # the candidate search at the real vocabulary
    row = dict(x_ptr=p("*fp32"), stride_x=n(VOCAB), V=n(VOCAB), temp_ptr=p("*fp32"))
    out.append({"kernel": "chunk_max"} | compile_sm90(K._chunk_max, row | dict(cmax_ptr=p("*fp32"), BLOCK=c(K.BLOCK_V)), 8, 1))
    out.append({"kernel": "collect"} | compile_sm90(K._collect, row | dict(
        cmax_ptr=p("*fp32"), cmass_ptr=p("*fp32"), ccnt_ptr=p("*i32"), cx_ptr=p("*fp32"), BLOCK=c(K.BLOCK_V), CB=c(cb),
        CAP=c(K.CAND_CAP)), 8, 1))
    out.append({"kernel": "select"} | compile_sm90(K._select, dict(
        V=n(VOCAB), n_chunks=n(nc), temp_ptr=p("*fp32"), topk_ptr=p("*i64"), topp_ptr=p("*fp32"), minp_ptr=p("*fp32"),
        cmax_ptr=p("*fp32"), cmass_ptr=p("*fp32"), ccnt_ptr=p("*i32"), cx_ptr=p("*fp32"), key_ptr=p("*i32"),
        need_ptr=p("*i32"), CB=c(cb), CAP=c(K.CAND_CAP)), 8, 1))
    for mass, start, block in ((0, 1, K.DESCENT_MIN_BLOCK), (1, 0, K.DESCENT_MIN_BLOCK), (1, 1, K.BLOCK_V)):
        nd = -(-VOCAB // block)  # a descent level: top-k's counts, top-p's masses, over B = 1's or B = 8's slices
        out.append({"kernel": f"descend mass={mass} start={start} block={block}"} | compile_sm90(K._descend, row | dict(
            nc=n(nc), nd=n(nd), topk_ptr=p("*i64"), topp_ptr=p("*fp32"), minp_ptr=p("*fp32"), cmax_ptr=p("*fp32"),
            need_ptr=p("*i32"), prev_part_ptr=p("*fp32"), prev_brk_ptr=p("*i64"), p0_part_ptr=p("*fp32"),
            part_ptr=p("*fp32"), brk_ptr=p("*i64"), key_ptr=p("*i32"), MASS=c(mass), START=c(start), FIRST=c(0),
            FINAL=c(0), HAS_NEED=c(1), BLOCK=c(block), NB=c(K.RADIX_NB), TILE=c(K.RADIX_TILE), CB=c(cb),
            CBD=c(max(16, 1 << (nd - 1).bit_length()))), 4, 1))
    from peregrine.kernels import logprobs as L
    top, KP, nlp = L.LOGPROBS_TOP, 32, VOCAB // L.BLOCK_V
    out.append({"kernel": "logprobs chunk_top"} | compile_sm90(L._chunk_top, dict(
        x_ptr=p("*fp32"), stride_x=n(VOCAB), V=n(VOCAB), cmax_ptr=p("*fp32"), csum_ptr=p("*fp32"), cval_ptr=p("*fp32"),
        cidx_ptr=p("*i32"), BLOCK=c(L.BLOCK_V), K=c(top), KP=c(KP)), 8, 1))
    out.append({"kernel": "logprobs row_merge"} | compile_sm90(L._row_merge, dict(
        x_ptr=p("*fp32"), stride_x=n(VOCAB), tok_ptr=p("*i64"), nc=n(nlp), cmax_ptr=p("*fp32"), csum_ptr=p("*fp32"),
        cval_ptr=p("*fp32"), cidx_ptr=p("*i32"), chosen_ptr=p("*fp32"), topi_ptr=p("*i64"), topv_ptr=p("*fp32"),
        K=c(top), KP=c(KP), CB=c(64)), 4, 1))
    return out


def main():
    from peregrine.bench.gpu import family_main
    family_main("sampling", run, lambda r: f"{r['kernel']:>28} B={r['B']:>2} {1e3 * r['time_ms']:>8.1f} us "
                f"{r['gbps']:>7.0f} GB/s {100 * r['pct_of_copy']:>5.1f}%"
                + (f" (sorted sampler {1e3 * r['sorted_ms']:.1f} us)" if "sorted_ms" in r else "")
                + (f" (torch logsumexp + topk {1e3 * r['torch_ms']:.1f} us)" if "torch_ms" in r else "")
                + "".join(f" ({k[:-3]} {1e3 * r[k]:.1f} us)" for k in r if k.endswith("_ms") and k not in
                          ("time_ms", "samples_ms", "sorted_ms", "torch_ms")), doc=__doc__)


if __name__ == "__main__":
    main()
