"""MLA absorbed-decode microbenchmark (BENCHMARKS.md §2): Kimi-Linear shapes over the paged cache.

Each case is a CUDA graph of REPS calls rotating over disjoint copies of the cache (block
tables into one pool, blocks shuffled), so every call streams its entries from HBM, not L2.
Bytes = cache entries (+ FP8 scales) + block-table entries + q + o; the FP32 split
partials are overhead, not counted. `tune=True` adds a sweep of splits × tilings.
    python -m peregrine.bench.kernels_mla [--quick] [--tune]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics

import torch

from peregrine.kernels import mla

H, KV_LORA, ROPE = 32, 512, 64          # Kimi-Linear MLA
L = KV_LORA + ROPE
SM_SCALE = 192 ** -0.5
PAGE = 64                               # default cache block size
BATCHES = (1, 2, 4, 8)
CONTEXTS = (1024, 8192, 32768, 131072)
MAX_CACHE_BYTES = 8 << 30               # skip cases whose cache alone exceeds this
L2_BYTES = 60 << 20
ROTATE_BYTES = 3 * L2_BYTES             # rotation working set that cannot stay in L2
MAX_COPIES = 64
REPS = 20                               # calls per graph replay: amortises the replay launch
DTYPE = torch.bfloat16
TUNE_SPLITS = (16, 32, 64, 132, 264)
TUNE_TILINGS = (
    mla.MlaTiling(),
    mla.MlaTiling(block_n=32),
    mla.MlaTiling(block_n=64, num_stages=2),
    mla.MlaTiling(block_n=32, num_stages=4),
    mla.MlaTiling(block_h=16, block_n=64),
)


def entry_bytes(fp8: bool) -> int:
    return L + 4 if fp8 else L * DTYPE.itemsize


class Case:
    """B sequences of `ctx` tokens each, `copies` disjoint cache copies in one shuffled pool."""

    def __init__(self, batch: int, ctx: int, fp8: bool):
        nb = -(-ctx // PAGE)
        self.cache_bytes = batch * ctx * entry_bytes(fp8)
        copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // self.cache_bytes)))
        total = copies * batch * nb
        vals = torch.randn(total, PAGE, L, device="cuda", dtype=DTYPE)
        if fp8:
            self.latent, self.scale = _quantize(vals)
        else:
            self.latent, self.scale = vals, None
        perm = torch.randperm(total, device="cuda")
        self.tables = [perm[i * batch * nb:(i + 1) * batch * nb].view(batch, nb).contiguous() for i in range(copies)]
        self.lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.q = torch.randn(batch, H, L, device="cuda", dtype=DTYPE)
        self.out = torch.empty(batch, H, KV_LORA, device="cuda", dtype=DTYPE)
        io = batch * (nb * 8 + H * L * DTYPE.itemsize + H * KV_LORA * DTYPE.itemsize)
        self.bytes = self.cache_bytes + io

    def call(self, bt, **kw):
        return mla.mla_decode(self.q, self.latent, self.scale, bt, self.lens, SM_SCALE,
                              kv_lora_rank=KV_LORA, out=self.out, **kw)

    def rel_err(self, **kw) -> float:
        self.call(self.tables[0], **kw)
        ref = mla.mla_decode_ref(self.q, self.latent, self.scale, self.tables[0], self.lens, SM_SCALE,
                                 kv_lora_rank=KV_LORA)
        return ((self.out.float() - ref).norm() / ref.norm()).item()

    def time(self, iters: int = 30, **kw) -> tuple[float, list[float]]:
        from peregrine.bench.gpu import time_fn
        seq = [self.tables[i % len(self.tables)] for i in range(REPS)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for bt in seq[:3]:  # compile + allocator warm-up outside capture
                self.call(bt, **kw)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for bt in seq:
                self.call(bt, **kw)
        samples = [t / REPS for t in time_fn(g.replay, iters=iters, warmup=3)]
        del g
        return statistics.median(samples), samples


def _quantize(vals):
    from peregrine.cache import quantize_fp8
    qs, ss = [], []
    for chunk in vals.split(4096):  # bounds the FP32 temporaries on the largest pools
        q, s = quantize_fp8(chunk)
        qs.append(q)
        ss.append(s)
    del vals
    return torch.cat(qs), torch.cat(ss)


def _row(case, batch, ctx, fp8, copy_gbps, t, samples, **extra) -> dict:
    gbps = case.bytes / t / 1e6
    return {"H": H, "L": L, "B": batch, "context": ctx, "cache": "fp8" if fp8 else "bf16", "time_ms": t,
            "cache_bytes": case.cache_bytes, "bytes": case.bytes, "gbps": gbps, "pct_of_copy": gbps / copy_gbps,
            "samples_ms": samples} | extra


def run(copy_gbps: float, full: bool = True, tune: bool = False, iters: int = 30) -> list[dict]:
    """One row per (cache dtype, B, context) with the default heuristic; with tune=True also
    sweep rows (B = 1, 8K and 32K) marked "sweep": True."""
    rows = []
    batches, contexts = (BATCHES, CONTEXTS) if full else ((1, 8), (8192, 32768))
    for fp8, batch, ctx in itertools.product((False, True), batches, contexts):
        if batch * ctx * entry_bytes(fp8) > MAX_CACHE_BYTES:
            continue
        case = Case(batch, ctx, fp8)
        err = case.rel_err()
        t, samples = case.time(iters)
        splits = mla.pick_num_splits(batch, H, case.tables[0].shape[1] * PAGE, "cuda")
        rows.append(_row(case, batch, ctx, fp8, copy_gbps, t, samples, num_splits=splits, rel_err=err))
        print(table(rows[-1:], head=not rows[:-1]), flush=True)
        del case
        torch.cuda.empty_cache()
    if tune:
        rows += sweep(copy_gbps, iters=max(10, iters // 3))
    return rows


def sweep(copy_gbps: float, iters: int = 10) -> list[dict]:
    rows = []
    for fp8, ctx in itertools.product((False, True), (8192, 32768)):
        case = Case(1, ctx, fp8)
        for tiling, splits in itertools.product(TUNE_TILINGS, TUNE_SPLITS):
            tiling = dataclasses.replace(tiling, min_split_tokens=tiling.block_n)  # let `splits` rule
            try:
                err = case.rel_err(num_splits=splits, tiling=tiling)
                t, samples = case.time(iters, num_splits=splits, tiling=tiling)
            except Exception as e:  # noqa: BLE001 - out of resources: skip the config
                print(f"skip {tiling} splits={splits}: {type(e).__name__}")
                continue
            rows.append(_row(case, 1, ctx, fp8, copy_gbps, t, samples, num_splits=splits, rel_err=err,
                             tiling=vars(tiling), sweep=True))
        del case
        torch.cuda.empty_cache()
    best = {}
    for r in rows:
        k = (r["cache"], r["context"])
        if k not in best or r["time_ms"] < best[k]["time_ms"]:
            best[k] = r
    print("best per (cache, context):\n" + table(best.values()))
    return rows


def table(rows, head: bool = True) -> str:
    lines = [f"{'cache':>5} {'B':>2} {'ctx':>7} {'splits':>6} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'err':>8} tiling"] if head else []
    for r in rows:
        lines.append(f"{r['cache']:>5} {r['B']:>2} {r['context']:>7} {r['num_splits']:>6} {r['time_ms']:>8.4f} "
                     f"{r['gbps']:>7.0f} {100 * r['pct_of_copy']:>5.1f}% {r['rel_err']:>8.1e} {r.get('tiling', '')}")
    return "\n".join(lines)


def main():
    from peregrine.bench.gpu import copy_bandwidth, result_path, run_metadata, write_result
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="B 1, 8 at 8K and 32K only")
    ap.add_argument("--tune", action="store_true", help="also sweep num_splits x tilings at B = 1")
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args()
    copy = copy_bandwidth()
    meta = run_metadata() | {"copy_gbps": copy["gbps"], "copy_samples_ms": copy["samples_ms"]}
    rows = run(copy["gbps"], full=not a.quick, tune=a.tune)
    path = write_result(result_path("kernels", "mla", a.results_dir), {"meta": meta, "rows": rows})
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s\n{table([r for r in rows if not r.get('sweep')])}\n-> {path}")


if __name__ == "__main__":
    main()
