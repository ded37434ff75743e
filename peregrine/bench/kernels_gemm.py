"""Skinny GEMM microbenchmark and plan tuner (docs/benchmarks.md §2).

Each case is timed as a CUDA graph of REPS calls that rotate over enough weight
copies to exceed the 60 MB L2, so every call streams its weight from HBM and
the Python launch cost stays out of the number (the decode step is a graph too).
    python -m peregrine.bench.kernels_gemm [--quick] [--tune [--write-plan]]
    python -m peregrine.bench.kernels_gemm --grouped [--pdl]   # KDA gates: one grouped launch vs two
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from peregrine.bench.gpu import graph_time
from peregrine.kernels import gemm
from peregrine.kernels.pdl import pdl_enabled

# Weight shapes (N, K) of the decode step.
SHAPES = [
    # Kimi-Linear, hidden 2304
    (12576, 2304),   # fused KDA input projection q|k|v|f_a|g_a|b
    (2304, 4096),    # KDA o_proj, MLA o_proj
    (4096, 128),     # KDA f_b / g_b (low rank up)
    (6720, 2304),    # MLA fused q + kv_a
    (18432, 2304),   # dense gate|up
    (2304, 9216),    # dense down
    (2048, 2304),    # shared expert gate|up
    (2304, 1024),    # shared expert down
    (163840, 2304),  # lm_head
    (256, 2304),     # router
    # K3 widths, hidden 7168
    (12288, 7168), (7168, 12288), (2112, 7168), (18432, 1536), (3584, 7168), (7168, 3584), (6144, 7168),
]
QUICK = [(12576, 2304), (2304, 4096), (256, 2304), (163840, 2304), (7168, 12288)]
# The 48B decode step's GEMMs with more than one call per step (the dense layer's and lm_head's run once)
DECODE_48B = [(12576, 2304), (2304, 4096), (4096, 128), (6720, 2304), (2048, 2304), (2304, 1024)]
# the o_proj (20 KDA + 7 MLA layers) ran at ~50 % of copy at M = 2..8 in session 18's step timeline
SHAPE_SETS = {"all": SHAPES, "quick": QUICK, "decode48b": DECODE_48B, "oproj": [(2304, 4096)]}
DEEP_STAGES = (3, 4)  # tensor-core tiles: cp.async stages in flight per program (the wide sweep keeps 2)
BYTES_PER_THREAD = 64  # weight bytes each thread loads per K step in the wide sweep: 4 x 16-byte vectors
MS = (1, 2, 4, 8, 16)
L2_BYTES = 60 << 20
ROTATE_BYTES = 3 * L2_BYTES  # working set that cannot stay in L2
MAX_COPIES = 192  # bounds memory for the smallest weights (f_b: 1 MB -> 180 MB)
REPS = 20  # min calls per graph replay (amortises the replay launch); every copy is used once
DTYPE = torch.bfloat16
DEVICE = "cuda"  # a module constant so the bench logic can be smoke-tested on CPU


class Case:
    """Rotated weight copies + inputs for one (M, N, K)."""

    def __init__(self, m, n, k, dtype=DTYPE):
        wbytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // wbytes)))
        self.ws = [torch.randn(n, k, device=DEVICE).div_(k ** 0.5).to(dtype) for _ in range(copies)]
        self.x = torch.randn(m, k, device=DEVICE).to(dtype)
        self.y = torch.empty(m, n, device=DEVICE, dtype=dtype)
        self.bytes = wbytes + (m * k + m * n) * torch.finfo(dtype).bits // 8
        self.m, self.n, self.k = m, n, k

    def time(self, call, iters=30) -> tuple[float, list[float]]:
        return graph_time([lambda w=self.ws[i % len(self.ws)]: call(w) for i in range(max(REPS, len(self.ws)))], iters)


@triton.jit
def _stream_kernel(w_ptr, out_ptr, N, K, stride_wn, k_per_split, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight reads of a GEMM tiling and nothing else (no x, no products): each program streams its
    [BLOCK_N, k range] block in BLOCK_K steps and keeps the running max, one float per program. Nothing feeds a
    tl.dot, so Triton does not pipeline these loads: for a tensor-core config that it does pipeline this
    understates the tiling; for the FMA configs (never pipelined) it is the same load stream."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (pid_s * k_per_split + rk)[None, :]
    acc = tl.full((BLOCK_N, BLOCK_K), float("-inf"), tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        kk = pid_s * k_per_split + k + rk
        tile = tl.load(ptrs + k, mask=(rn < N)[:, None] & (kk < K)[None, :], other=float("-inf"))
        acc = tl.maximum(acc, tile.to(tl.float32))
    tl.store(out_ptr + pid_s * tl.num_programs(0) + pid_n, tl.max(tl.max(acc, axis=1), axis=0))


def stream_tiles(w: torch.Tensor, cfg: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    """Max of w read with cfg's grid and tiles (a "plain"/"splitk" config): [split, N tiles] per-program
    maxima. The time of this is the ceiling of the tiling."""
    N, K = w.shape
    grid, k_per, tile = gemm.tiling(1, N, K, cfg)
    out = out if out is not None else torch.empty(grid[1] * grid[0], dtype=torch.float32, device=w.device)
    _stream_kernel[grid[:2]](w, out, N, K, w.stride(0), k_per, BLOCK_N=tile["BLOCK_N"], BLOCK_K=tile["BLOCK_K"],
                             num_warps=tile["num_warps"], num_stages=tile["num_stages"])
    return out.view(grid[1], grid[0])


def _ours(case, cfg=None):
    return lambda w: gemm.skinny_gemm(case.x, w, out=case.y, config=cfg)


def _cublas(case):
    return lambda w: torch.matmul(case.x, w.t(), out=case.y)


def run(copy_gbps: float, full: bool = True, tune: bool = False, iters: int = 30, plan: dict | None = None,
        ms=MS, shapes=None, stream: bool = False) -> list[dict]:
    """One row per (shape, M): ours (plan config, or freshly tuned with tune=True) vs cuBLAS; with `stream`
    also the weight reads alone with our config's grid and tiles (stream_tiles), where it has tiles."""
    rows = []
    if tune and plan is None:
        plan = tune_plan(copy_gbps, full, ms, shapes=shapes)
    for (n, k), m in itertools.product(shapes or (SHAPES if full else QUICK), ms):
        case = Case(m, n, k)
        cfg = plan[gemm.plan_key(m, n, k)] if plan else gemm.lookup(m, n, k)
        cfg = {key: v for key, v in cfg.items() if key != "measured"}
        t, samples = case.time(_ours(case, cfg), iters)
        tc, _ = case.time(_cublas(case), iters)
        gbps, gbps_c = case.bytes / t / 1e6, case.bytes / tc / 1e6
        rows.append({"kernel": cfg["kernel"], "config": cfg, "N": n, "K": k, "M": m, "time_ms": t,
                     "bytes": case.bytes, "gbps": gbps, "pct_of_copy": gbps / copy_gbps,
                     "cublas_ms": tc, "cublas_gbps": gbps_c, "cublas_pct_of_copy": gbps_c / copy_gbps,
                     "samples_ms": samples})
        if stream and cfg["kernel"] != "torch":
            sink = stream_tiles(case.ws[0], cfg)
            ts, stream_samples = case.time(lambda w: stream_tiles(w, cfg, sink), iters)
            wbytes = n * k * DTYPE.itemsize
            rows[-1].update(stream_ms=ts, stream_pct_of_copy=wbytes / ts / 1e6 / copy_gbps,
                            stream_samples_ms=stream_samples)
        del case
    torch.cuda.empty_cache()
    return rows


GROUPED = (4096, 128, 2)  # (N, K, G): KDA's f_b and g_b, the two low-rank gate up-projections of a layer
GROUPED_MS = (1, 2, 4, 8)


def run_grouped(copy_gbps: float, ms=GROUPED_MS, n: int = GROUPED[0], k: int = GROUPED[1], g: int = GROUPED[2],
                iters: int = 30) -> list[dict]:
    """grouped_gemm of G (N, K) problems against G skinny_gemm launches on the same columns, both with
    the plan's config of the single problem (the same tiles: `identical` checks the bits)."""
    rows = []
    for m in ms:
        case = Case(m, g * n, k, DTYPE)  # rotated copies of the stacked weight [G·N, K]
        x = torch.randn(m, g * k, device=DEVICE).to(DTYPE)
        y, y2 = case.y, torch.empty_like(case.y)
        cols = [(slice(i * k, (i + 1) * k), slice(i * n, (i + 1) * n)) for i in range(g)]
        grouped = lambda w: gemm.grouped_gemm(x, w, g, out=y)  # noqa: E731
        separate = lambda w, out=y: [gemm.skinny_gemm(x[:, a], w[b], out=out[:, b]) for a, b in cols]  # noqa: E731
        grouped(case.ws[0]), separate(case.ws[0], y2)
        identical = bool(torch.equal(y, y2))  # before the timed graphs overwrite y
        t, samples = case.time(grouped, iters)
        ts, sep_samples = case.time(separate, iters)
        nbytes = (g * n * k + m * g * k + m * g * n) * DTYPE.itemsize
        gbps, gbps_s = nbytes / t / 1e6, nbytes / ts / 1e6
        rows.append({"kernel": "grouped", "config": gemm.lookup(m, n, k), "M": m, "N": n, "K": k, "G": g,
                     "time_ms": t, "separate_ms": ts, "saved_us": 1e3 * (ts - t), "bytes": nbytes,
                     "gbps": gbps, "pct_of_copy": gbps / copy_gbps, "separate_gbps": gbps_s,
                     "separate_pct_of_copy": gbps_s / copy_gbps, "identical": identical,
                     "samples_ms": samples, "separate_samples_ms": sep_samples})
        del case
    return rows


def grouped_table(rows) -> str:
    lines = [f"{'M':>3} {'N':>5} {'K':>4} {'G':>2} {'grouped us':>10} {'GB/s':>6} {'%copy':>6} "
             f"{'separate us':>11} {'GB/s':>6} {'%copy':>6} {'saved us':>8} identical"]
    for r in rows:
        lines.append(f"{r['M']:>3} {r['N']:>5} {r['K']:>4} {r['G']:>2} {1e3 * r['time_ms']:>10.2f} {r['gbps']:>6.0f} "
                     f"{100 * r['pct_of_copy']:>5.1f}% {1e3 * r['separate_ms']:>11.2f} {r['separate_gbps']:>6.0f} "
                     f"{100 * r['separate_pct_of_copy']:>5.1f}% {r['saved_us']:>8.2f} {r['identical']}")
    return "\n".join(lines)


def candidates(m: int, n: int, k: int):
    """A small sweep: compile time, not run time, bounds how many configs we can try."""
    dots = (False, True) if m <= gemm.FMA_MAX_ROWS else (True,)
    bm = min(1 << (m - 1).bit_length(), gemm.FMA_MAX_ROWS)
    for dot, bn, bk, warps in itertools.product(dots, (16, 32, 64), (128, 256, 512, 1024), (4, 8)):
        if (not dot and bm * bn * bk > gemm.FMA_ACC_REGS * 32 * warps) or (dot and bn * bk > 64 * 256):
            continue  # accumulator or tile would spill registers
        tiles = -(-n // bn)
        for split in (1, 2, 4, 8, 16):
            if split > 1 and (tiles >= 2 * gemm.NUM_SMS or tiles * split > 8 * gemm.NUM_SMS or k < split * bk):
                continue  # enough programs already / too many partials / empty splits
            yield {"kernel": "splitk" if split > 1 else "plain", "BLOCK_N": bn, "BLOCK_K": bk,
                   "SPLIT_K": split, "num_warps": warps, "num_stages": 2, "dot": dot}


def wide_candidates(m: int, n: int, k: int):
    """The decode sweep: narrow N tiles too (4, 8 rows: more programs for small N), the warps sized to
    the tile, split K with the inline (last-arrival) reduce, with and without the weight prefetch;
    between one and sixteen waves of programs."""
    dot_only = m > gemm.FMA_MAX_ROWS
    bm = min(1 << (m - 1).bit_length(), gemm.FMA_MAX_ROWS)
    tiles = [(True, bn, bk) for bn in (16, 32) for bk in (128, 256)]
    if not dot_only:
        tiles += [(False, bn, bk) for bn in (4, 8, 16) for bk in ((256, 512) if k < 2048 else (512, 1024))]
    for dot, bn, bk in tiles:
        bk = min(bk, max(gemm.DOT_MIN_ROWS, 1 << (k - 1).bit_length()))
        warps = 4 if dot else max(1, min(8, bn * bk * 2 // (32 * BYTES_PER_THREAD)))
        if not dot and bm * bn * bk > gemm.FMA_ACC_REGS * 32 * warps:
            continue  # the FMA accumulator would spill
        if dot and bn * bk > 64 * 256:
            continue
        for split in (1, 2, 4, 8):
            programs = -(-n // bn) * split
            if k < split * bk or not gemm.NUM_SMS // 2 <= programs <= 16 * gemm.NUM_SMS:
                continue
            for prefetch in (False, True):  # one weight tile in flight per program, or two
                yield {"kernel": "splitk" if split > 1 else "plain", "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split,
                       "num_warps": warps, "num_stages": 2, "dot": dot, "reduce": "inline" if split > 1 else "kernel",
                       "prefetch": prefetch}


def deep_candidates(m: int, n: int, k: int):
    """The wide sweep's best kinds, and tensor-core tiles (rows padded to 16, so the accumulator is small
    whatever M) whose loads Triton software-pipelines through shared memory with DEEP_STAGES tiles in
    flight: more bytes in flight per program than the FMA tiles' register budget allows."""
    yield from (c for c in wide_candidates(m, n, k) if not c["dot"] and c["prefetch"])
    for bn, bk, split, stages in itertools.product((16, 32, 64), (128, 256), (1, 2, 4, 8), DEEP_STAGES):
        bk = min(bk, max(gemm.DOT_MIN_ROWS, 1 << (k - 1).bit_length()))
        programs = -(-n // bn) * split
        steps = -(-k // (split * bk))
        if bn * bk > 64 * 256 or steps < stages or not gemm.NUM_SMS <= programs <= 8 * gemm.NUM_SMS:
            continue  # a tile too big for registers, fewer K steps than stages, or too few / many programs
        yield {"kernel": "splitk" if split > 1 else "plain", "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split,
               "num_warps": 4, "num_stages": stages, "dot": True, "reduce": "inline" if split > 1 else "kernel",
               "prefetch": False}


def fast_candidates(m: int, n: int, k: int):
    """The heuristic tile with and without tensor cores, and cuBLAS: a plan in seconds per shape."""
    heur = gemm.heuristic(m, n, k)
    yield heur
    if not heur["dot"]:  # small M: the tensor-core tile (rows padded to 16) may still win
        yield gemm.heuristic(gemm.FMA_MAX_ROWS + 1, n, k)
    yield heur | {"kernel": "torch"}


def tune_one(m, n, k, copy_gbps: float, iters: int = 10, fast: bool = False, wide: bool = False,
             deep: bool = False) -> dict:
    case = Case(m, n, k)
    ref = gemm.skinny_gemm_ref(case.x, case.ws[0])
    results = []
    heur = gemm.heuristic(m, n, k)
    sweep = fast_candidates if fast else deep_candidates if deep else wide_candidates if wide else candidates
    cfgs = list(sweep(m, n, k)) + ([] if fast else [heur | {"kernel": "torch"}])
    for cfg in cfgs + ([heur] if heur not in cfgs else []):
        try:
            case.y.zero_()
            gemm.skinny_gemm(case.x, case.ws[0], out=case.y, config=cfg)
            err = (case.y.float() - ref).norm().item() / ref.norm().item()
            if not err < 1e-2:
                continue
            t, _ = case.time(_ours(case, cfg), iters)
        except Exception as e:  # noqa: BLE001 - out of resources etc.: skip the config
            print(f"skip {cfg}: {type(e).__name__}")
            continue
        results.append((t, cfg))
    results.sort(key=lambda r: r[0])
    t, best = results[0]
    t_heur = next((r[0] for r in results if r[1] == heur), None)
    t_torch = next((r[0] for r in results if r[1]["kernel"] == "torch"), None)
    gbps = case.bytes / t / 1e6
    return best | {"measured": {"time_ms": t, "gbps": gbps, "pct_of_copy": gbps / copy_gbps,
                                "runner_up_ms": results[1][0] if len(results) > 1 else None,
                                "heuristic_ms": t_heur, "cublas_ms": t_torch, "candidates": len(results),
                                "pdl": pdl_enabled()}}


def tune_plan(copy_gbps: float, full: bool = True, ms=MS, fast: bool = False, shapes=None, wide: bool = False,
              deep: bool = False) -> dict:
    plan = {}
    for (n, k), m in itertools.product(shapes or (SHAPES if full else QUICK), ms):
        plan[gemm.plan_key(m, n, k)] = tune_one(m, n, k, copy_gbps, fast=fast, wide=wide, deep=deep)
        print(gemm.plan_key(m, n, k), plan[gemm.plan_key(m, n, k)], flush=True)
    return plan


def write_plan(plan: dict, meta: dict, path=gemm.PLAN_PATH) -> None:
    """Merge `plan` into `path`'s entries (a new file starts from gemm_plan.json's)."""
    base = path if path.exists() else gemm.PLAN_PATH
    old = json.loads(base.read_text()) if base.exists() else {}
    entries = old.get("entries", {}) | plan
    path.write_text(json.dumps({"meta": meta, "entries": entries}, indent=1, sort_keys=True) + "\n")
    gemm.load_plan.cache_clear()
    gemm._lookup.cache_clear()
    gemm._tuned_rows.cache_clear()


def table(rows) -> str:
    head = f"{'N':>7} {'K':>6} {'M':>3} {'kernel':>7} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'cuBLAS ms':>9} {'%copy':>6}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['N']:>7} {r['K']:>6} {r['M']:>3} {r['kernel']:>7} {r['time_ms']:>8.4f} {r['gbps']:>7.0f} "
                     f"{100 * r['pct_of_copy']:>5.1f}% {r['cublas_ms']:>9.4f} {100 * r['cublas_pct_of_copy']:>5.1f}%"
                     + (f"  reads alone {r['stream_ms']:.4f} ms {100 * r['stream_pct_of_copy']:.1f}%" if "stream_ms" in r
                        else ""))
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="five representative shapes only")
    ap.add_argument("--tune", action="store_true", help="sweep configs per shape before timing")
    ap.add_argument("--write-plan", action="store_true", help="with --tune: merge the winners into gemm_plan.json")
    ap.add_argument("--fast", action="store_true", help="with --tune: only heuristic tile (FMA / tensor-core) vs cuBLAS")
    ap.add_argument("--ms", help="row counts M, comma separated (default 1,2,4,8,16; with --grouped 1,2,4,8)")
    ap.add_argument("--pdl", action="store_true", help="launch with Programmatic Dependent Launch (tune for {\"pdl\": true})")
    ap.add_argument("--shapes", choices=sorted(SHAPE_SETS), help="a named shape set (overrides --quick)")
    ap.add_argument("--wide", action="store_true", help="with --tune: the decode sweep (narrow tiles, inline split-K reduce)")
    ap.add_argument("--deep", action="store_true",
                    help="with --tune: the wide sweep's prefetching FMA tiles and tensor-core tiles with 3-4 pipeline stages")
    ap.add_argument("--stream", action="store_true",
                    help="also time each config's weight reads alone (same grid and tiles, no x, no math): its ceiling")
    ap.add_argument("--plan-out", help="with --write-plan: merge into this file instead of gemm_plan.json")
    ap.add_argument("--grouped", action="store_true", help="only KDA's two gate up-projections: one grouped launch vs two")
    ap.add_argument("--results-dir", default="results")
    return ap


def main(argv=None):
    from peregrine.bench.gpu import copy_bandwidth, result_path, run_metadata, write_result
    a = parser().parse_args(argv)
    from peregrine.kernels.pdl import set_pdl
    set_pdl(a.pdl)  # back-to-back calls in the timed graphs then overlap as in a PDL decode step
    ms = tuple(int(v) for v in a.ms.split(",")) if a.ms else GROUPED_MS if a.grouped else MS
    copy = copy_bandwidth()
    meta = run_metadata() | {"copy_gbps": copy["gbps"], "copy_samples_ms": copy["samples_ms"], "pdl": a.pdl}
    if a.grouped:
        rows = run_grouped(copy["gbps"], ms=ms)
        path = write_result(result_path("kernels", "gemm-grouped", a.results_dir), {"meta": meta, "rows": rows})
        print(f"copy bandwidth {copy['gbps']:.0f} GB/s\n{grouped_table(rows)}\n-> {path}")
        return
    shapes = SHAPE_SETS[a.shapes] if a.shapes else None
    plan = tune_plan(copy["gbps"], not a.quick, ms, fast=a.fast, shapes=shapes, wide=a.wide, deep=a.deep) if a.tune else None
    if plan and a.write_plan:
        write_plan(plan, {k: meta[k] for k in ("commit", "gpu", "torch", "triton", "time_utc", "copy_gbps", "pdl")},
                   Path(a.plan_out) if a.plan_out else gemm.PLAN_PATH)
    rows = run(copy["gbps"], full=not a.quick, plan=plan, ms=ms, shapes=shapes, stream=a.stream)
    path = write_result(result_path("kernels", "gemm", a.results_dir), {"meta": meta, "plan": plan, "rows": rows})
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s\n{table(rows)}\n-> {path}")


if __name__ == "__main__":
    main()
