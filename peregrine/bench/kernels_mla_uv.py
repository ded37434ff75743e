"""MLA decode tail microbenchmark: the split combine with W_UV fused in (kernels/mla.py combine_uv) against
the chain it replaces in SpecializedRunner._mla_attend (combine kernel, cuBLAS bmm with W_UV, and at B > 1
the copy of the bmm's non-contiguous output), at Kimi-Linear-48B's shapes (H 32, C 512, R 64, v 128),
B 1, 2, 4, 8, contexts 1024 and 8192, BF16 cache (--fp8: also the FP8 one, whose plan splits differ).

"tail" rows time the tail alone on the split kernel's partials of one call (L2-resident, as in a step:
the split kernel has just written them); "full" rows add the split kernel (mla_decode) over the rotating
cache tables of peregrine.bench.kernels_mla.Case. W_UV rotates over COPIES layers' kv_b so it streams
from HBM as in a real step (one layer's 4 MB would otherwise sit in the 60 MB L2). Tail bytes = W_UV +
the active splits' FP32 partials and LSEs + out + lengths; full bytes add the cache entries, tables and q.
Every fused tiling in --tilings (block_v x block_c x block_b w num_warps) is timed; with PDL on too for
the first (the fused kernel prefetches its W_UV tile during the split kernel's tail).
    python -m peregrine.bench.kernels_mla_uv [--quick] [--batches 1,2,4,8] [--contexts 1024,8192] [--tilings ...]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses

import torch

from peregrine.kernels.mla import UvTiling

H, C, ROPE, V, NOPE = 32, 512, 64, 128, 128   # Kimi-Linear-48B MLA
SM_SCALE = 192 ** -0.5
BATCHES = (1, 2, 4, 8)
CONTEXTS = (1024, 8192)
QUICK = ((1, 8), (8192,))                     # --quick: batches, contexts
ROTATE_BYTES = 3 * (60 << 20)                 # W_UV rotation working set past the H200's L2
REPS = 20                                     # calls per graph replay
DTYPE = torch.bfloat16
TOL = 1e-2                                    # fused vs the FP32 reference, relative
TILINGS = (UvTiling(), UvTiling(block_b=4), UvTiling(block_b=1), UvTiling(block_c=16),
           UvTiling(block_c=64, num_warps=8), UvTiling(block_v=64))


def parse_tiling(s: str) -> UvTiling:
    """'128x32x16w4' -> UvTiling(block_v=128, block_c=32, block_b=16, num_warps=4)."""
    dims, _, warps = s.partition("w")
    v, c, b = (int(x) for x in dims.split("x"))
    return UvTiling(v, c, b, int(warps or 4))


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"B {QUICK[0]} at contexts {QUICK[1]} only")
    ap.add_argument("--batches", type=ints, default=None, help="comma-separated batch sizes (overrides --quick)")
    ap.add_argument("--contexts", type=ints, default=None, help="comma-separated context lengths (overrides --quick)")
    ap.add_argument("--tilings", type=lambda s: [parse_tiling(x) for x in s.split(",")], default=None,
                    help="fused tilings to time, e.g. 128x32x16w4,128x64x16w8 (the first also with PDL)")
    ap.add_argument("--fp8", action="store_true", help="also an FP8 cache")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--results-dir", default="results")
    return ap.parse_args(argv)


def active_splits(ctx: int, splits: int, tiling) -> int:
    """Splits a sequence of ctx tokens fills (kernels/mla.py _split_bounds)."""
    per = -(-max(-(-ctx // splits), tiling.min_split_tokens) // tiling.block_n) * tiling.block_n
    return -(-ctx // per)


def case_bytes(batch: int, ctx: int, splits: int, tiling=None) -> int:
    """HBM/L2 bytes the tail must move: W_UV once (whatever B), the active partials and LSEs, out, lengths."""
    from peregrine.kernels.mla import DEFAULT_TILING
    s = active_splits(ctx, splits, tiling or DEFAULT_TILING) if splits > 1 else 1
    part = batch * H * s * (C * 4 + 4) if splits > 1 else batch * H * C * DTYPE.itemsize
    return H * V * C * DTYPE.itemsize + part + batch * H * V * DTYPE.itemsize + batch * 4


class Case:
    def __init__(self, batch: int, ctx: int, fp8: bool):
        from peregrine.bench.kernels_mla import Case as Attn
        from peregrine.kernels import mla
        self.attn = a = Attn(batch, ctx, fp8)
        kv_b = H * (NOPE + V) * C * DTYPE.itemsize
        self.copies = max(2, -(-ROTATE_BYTES // kv_b))
        self.w = [(torch.randn(H * (NOPE + V), C, device="cuda") * C ** -0.5).to(DTYPE).view(H, NOPE + V, C)[:, NOPE:]
                  for _ in range(self.copies)]
        self.p = mla.mla_partials(a.q, a.latent, a.scale, a.tables[0], a.lens, SM_SCALE, kv_lora_rank=C)
        self.o = torch.empty(batch, H, C, dtype=DTYPE, device="cuda")
        self.out = torch.empty(batch, H * V, dtype=DTYPE, device="cuda")
        self.batch, self.ctx, self.cache = batch, ctx, "fp8" if fp8 else "bf16"
        self.splits = self.p.num_splits
        self.tail_bytes = case_bytes(batch, ctx, self.splits, self.p.tiling)
        # cache entries, tables and q (kernels_mla's count less its o), W_UV, out, lengths
        self.full_bytes = a.bytes + H * V * C * DTYPE.itemsize + batch * (H * (V - C) * DTYPE.itemsize + 4)

    def bmm(self, o, i):
        return torch.bmm(o.transpose(0, 1), self.w[i].transpose(1, 2)).transpose(0, 1).reshape(self.batch, -1)

    def chain_tail(self, i):
        from peregrine.kernels import mla
        o = self.p.direct if self.p.part is None else mla.combine(self.p, self.o)
        return self.bmm(o, i)

    def fused_tail(self, i, u=None):
        from peregrine.kernels import mla
        return mla.combine_uv(self.p, self.w[i], out=self.out, uv_tiling=u)

    def chain_full(self, i):
        a = self.attn
        return self.bmm(a.call(a.tables[i % len(a.tables)]), i)

    def fused_full(self, i, u=None):
        from peregrine.kernels import mla
        a = self.attn
        return mla.mla_decode(a.q, a.latent, a.scale, a.tables[i % len(a.tables)], a.lens, SM_SCALE,
                              kv_lora_rank=C, w_uv=self.w[i], out=self.out, uv_tiling=u)

    def agreement(self, u) -> dict:
        from peregrine.kernels import mla
        a = self.attn
        ref = torch.einsum("bhc,hvc->bhv", a.ref, self.w[0].float()).reshape(self.batch, -1)
        chain = self.chain_full(0).float()
        got = self.fused_full(0, u).float()
        rel = lambda x, y: ((x - y).norm() / y.norm()).item()  # noqa: E731
        return {"rel_err": rel(got, ref), "chain_rel_err": rel(chain, ref), "vs_chain": rel(got, chain),
                "uv_why_not": mla.uv_why_not(a.q, self.w[0], C)}



def tiling_tag(u: UvTiling) -> str:
    return f"{u.block_v}x{u.block_c}x{u.block_b}w{u.num_warps}"


def _time(fn, copies, iters, pdl_on=False) -> float:
    from peregrine.bench.gpu import graph_time
    from peregrine.kernels.pdl import pdl
    with pdl(True) if pdl_on else contextlib.nullcontext():
        ms, _ = graph_time([lambda i=i: fn(i % copies) for i in range(REPS)], iters=iters)
    return ms * 1e3


def time_case(case: Case, tilings, iters: int, copy_gbps: float) -> dict:
    row = {"B": case.batch, "context": case.ctx, "cache": case.cache, "num_splits": case.splits,
           "tail_bytes": case.tail_bytes, "full_bytes": case.full_bytes, **case.agreement(tilings[0])}
    t = {"chain_tail": _time(case.chain_tail, case.copies, iters),
         "chain_full": _time(case.chain_full, case.copies, iters),
         "chain_full_pdl": _time(case.chain_full, case.copies, iters, True)}
    for k, u in enumerate(tilings):
        tag = tiling_tag(u)
        try:
            t[f"fused_tail[{tag}]"] = _time(lambda i, u=u: case.fused_tail(i, u), case.copies, iters)
            if k == 0:
                t["fused_tail"] = t[f"fused_tail[{tag}]"]
                t["fused_tail_pdl"] = _time(lambda i, u=u: case.fused_tail(i, u), case.copies, iters, True)
                t["fused_full"] = _time(lambda i, u=u: case.fused_full(i, u), case.copies, iters)
                t["fused_full_pdl"] = _time(lambda i, u=u: case.fused_full(i, u), case.copies, iters, True)
        except Exception as e:  # noqa: BLE001 - one failing tiling must not hide the rest
            row[f"error[{tag}]"] = f"{type(e).__name__}: {e}"[:200]
    for name, us in t.items():
        nbytes = case.full_bytes if "full" in name else case.tail_bytes
        row[f"{name}_us"] = us
        row[f"{name}_gbps"] = nbytes / (us * 1e-6) / 1e9
        row[f"{name}_pct_of_copy"] = row[f"{name}_gbps"] / copy_gbps
    fused = [k for k in t if k.startswith("fused_tail[")]
    if fused:
        best = min(fused, key=t.get)
        row |= {"best_tiling": best[len("fused_tail["):-1], "tail_speedup": t["chain_tail"] / t[best]}
    return row


def run(copy_gbps: float, batches, contexts, tilings, iters: int = 30, fp8: bool = False) -> list[dict]:
    rows = []
    for cache_fp8 in (False, True) if fp8 else (False,):
        for ctx in contexts:
            for b in batches:
                case = Case(b, ctx, cache_fp8)
                rows.append(time_case(case, tilings, iters, copy_gbps))
                print(line(rows[-1]), flush=True)
                del case
                torch.cuda.empty_cache()
    return rows


def line(r: dict) -> str:
    f = lambda k: f"{r[k + '_us']:6.2f} us {100 * r[k + '_pct_of_copy']:4.1f}%" if k + "_us" in r else "     -"  # noqa: E731
    tiles = " ".join(f"{k[len('fused_tail['):-len(']_us')]} {r[k]:.2f}" for k in r
                     if k.startswith("fused_tail[") and k.endswith("]_us"))
    return (f"{r['cache']:>4} B={r['B']:>2} ctx={r['context']:>5} S={r['num_splits']:>3} | tail: chain {f('chain_tail')}"
            f"  fused {f('fused_tail')}  +pdl {f('fused_tail_pdl')} | full: chain {f('chain_full')}  +pdl "
            f"{f('chain_full_pdl')}  fused {f('fused_full')}  +pdl {f('fused_full_pdl')} | err {r['rel_err']:.1e} "
            f"(chain {r['chain_rel_err']:.1e}, vs chain {r['vs_chain']:.1e}) | tilings us: {tiles}"
            + (f" | best {r['best_tiling']} x{r['tail_speedup']:.2f}" if "best_tiling" in r else ""))


def main(argv=None) -> int:
    from peregrine.bench.gpu import copy_bandwidth, kernel_resources, result_path, run_metadata, write_result
    from peregrine.kernels import mla
    a = parse_args(argv)
    batches = a.batches or (QUICK[0] if a.quick else BATCHES)
    contexts = a.contexts or (QUICK[1] if a.quick else CONTEXTS)
    tilings = a.tilings or list(TILINGS)
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s")
    rows = run(copy["gbps"], batches, contexts, tilings, a.iters, a.fp8)
    meta = run_metadata() | {"copy_gbps": copy["gbps"], "copy_samples_ms": copy["samples_ms"],
                             "tilings": [dataclasses.asdict(u) for u in tilings],
                             "kernel_resources": kernel_resources(mla._mla_uv_kernel)}
    path = write_result(result_path("kernels", "mla-uv", a.results_dir), {"meta": meta, "rows": rows})
    print(f"registers/spills: {meta['kernel_resources']}\n-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
