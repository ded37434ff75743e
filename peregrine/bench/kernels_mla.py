"""MLA absorbed-decode microbenchmark (docs/benchmarks.md §2): Kimi-Linear shapes over the paged cache.

Each case is a CUDA graph of REPS calls rotating over disjoint copies of the cache (block
tables into one pool, blocks shuffled), so every call streams its entries from HBM, not L2.
Bytes = cache entries (+ FP8 scales) + block-table entries + q + o; the FP32 split
partials are overhead, not counted.

--tune, per (cache dtype, B, context bucket): every tiling at the wave-filling split count,
then the TOP_K tilings over a range of split counts; the fastest config whose error is
within tolerance goes into peregrine/kernels/mla_plan.json (read by mla_decode at run time).
A time budget stops the sweep cleanly (what was tuned is still written).
    python -m peregrine.bench.kernels_mla [--quick] [--tune [--no-write] [--budget-s 420]] [--verify]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time

import torch

from peregrine.kernels import mla

H, KV_LORA, ROPE = 32, 512, 64          # Kimi-Linear MLA
L = KV_LORA + ROPE
SM_SCALE = 192 ** -0.5
PAGE = 64                               # default cache block size
BATCHES = (1, 2, 4, 8)
CONTEXTS = (1024, 8192, 32768, 131072)  # also the plan's context buckets
MAX_CACHE_BYTES = 8 << 30               # skip cases whose cache alone exceeds this
L2_BYTES = 60 << 20
ROTATE_BYTES = 3 * L2_BYTES             # rotation working set that cannot stay in L2
MAX_COPIES = 64
REPS = 20                               # calls per graph replay: amortises the replay launch
DTYPE = torch.bfloat16
TOL = 1e-2                              # docs/correctness.md: BF16 output vs the FP32 reference
TOP_K = 2                               # tilings carried into the split sweep
WAVE_FACTORS = (0.5, 1, 2, 4)           # split candidates: these many waves of programs
TUNE_TILINGS = {
    "bf16": (mla.MlaTiling(), mla.MlaTiling(block_n=32), mla.MlaTiling(num_stages=2),
             mla.MlaTiling(block_n=32, num_stages=4), mla.MlaTiling(block_h=16),
             mla.MlaTiling(block_n=32, num_warps=4, num_stages=2)),
    "fp8": (mla.MlaTiling(block_n=32), mla.MlaTiling(), mla.MlaTiling(block_n=32, fp8_compute="fp16"),
            mla.MlaTiling(fp8_compute="fp16"), mla.MlaTiling(block_n=32, num_stages=4, fp8_compute="fp16"),
            mla.MlaTiling(block_h=16, fp8_compute="fp16"), mla.MlaTiling(block_h=16, block_n=32)),
}


def entry_bytes(fp8: bool) -> int:
    return L + 4 if fp8 else L * DTYPE.itemsize


class Case:
    """B sequences of `ctx` tokens each, `copies` disjoint cache copies in one shuffled pool."""

    def __init__(self, batch: int, ctx: int, fp8: bool):
        nb = -(-ctx // PAGE)
        self.batch, self.ctx, self.fp8 = batch, ctx, fp8
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
        self.ref = mla.mla_decode_ref(self.q, self.latent, self.scale, self.tables[0], self.lens, SM_SCALE,
                                      kv_lora_rank=KV_LORA)

    def call(self, bt, **kw):
        return mla.mla_decode(self.q, self.latent, self.scale, bt, self.lens, SM_SCALE,
                              kv_lora_rank=KV_LORA, out=self.out, **kw)

    def rel_err(self, **kw) -> float:
        self.call(self.tables[0], **kw)
        return ((self.out.float() - self.ref).norm() / self.ref.norm()).item()

    def time(self, iters: int = 30, fn=None, **kw) -> tuple[float, list[float]]:
        """Median ms of one call (fn(bt) if given, else mla_decode with kw) over rotating cache copies."""
        from peregrine.bench.gpu import time_fn
        call = fn or (lambda bt: self.call(bt, **kw))
        seq = [self.tables[i % len(self.tables)] for i in range(REPS)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for bt in seq[:3]:  # compile + allocator warm-up outside capture
                call(bt)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for bt in seq:
                call(bt)
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


def _row(case, copy_gbps, t, samples, **extra) -> dict:
    gbps = case.bytes / t / 1e6
    return {"H": H, "L": L, "B": case.batch, "context": case.ctx, "cache": "fp8" if case.fp8 else "bf16",
            "shape": f"{'fp8' if case.fp8 else 'bf16'} B={case.batch} ctx={case.ctx}", "time_ms": t,
            "cache_bytes": case.cache_bytes, "bytes": case.bytes, "gbps": gbps, "pct_of_copy": gbps / copy_gbps,
            "samples_ms": samples} | extra


def cases(full: bool):
    batches, contexts = (BATCHES, CONTEXTS) if full else ((1, 8), (8192, 32768))
    for fp8, batch, ctx in itertools.product((False, True), batches, contexts):
        if batch * ctx * entry_bytes(fp8) <= MAX_CACHE_BYTES:
            yield fp8, batch, ctx


def run(copy_gbps: float, full: bool = True, tune: bool = False, iters: int = 30, write: bool = True,
        budget_s: float = 420.0, meta: dict | None = None) -> list[dict]:
    """One row per (cache dtype, B, context) with the planned config; with tune=True, the sweep
    rows (marked "sweep": True) and the winners written to the plan."""
    rows, best = [], {}
    t_end = time.monotonic() + budget_s
    print(table([], head=True))
    for fp8, batch, ctx in cases(full):
        cache = "fp8" if fp8 else "bf16"
        case = Case(batch, ctx, fp8)
        tiling, splits = mla.resolve(batch, H, case.tables[0].shape[1] * PAGE, case.latent.dtype, DTYPE, "cuda")
        row = None
        try:
            err = case.rel_err()
            t, samples = case.time(iters)
            row = _row(case, copy_gbps, t, samples, num_splits=splits, rel_err=err,
                       tiling=dataclasses.asdict(tiling), kernel="mla_decode")
            rows.append(row)
        except Exception as e:  # noqa: BLE001 - one failing shape must not hide the rest
            print(f"{cache} B={batch} ctx={ctx}: planned config FAILED {type(e).__name__}: {e}")
        if tune and time.monotonic() < t_end:
            win, recs = sweep(case, copy_gbps, max(10, iters // 3))
            rows += recs
            if win is not None:
                best[mla.plan_key(cache, batch, ctx)] = win
                if row is not None:
                    row |= {"tuned_ms": win["time_ms"], "tuned_splits": win["num_splits"], "tuned_tiling": win["tiling"]}
        elif tune:
            print(f"budget spent: not tuning {cache} B={batch} ctx={ctx}")
        if row is not None:
            print(table([row], head=False), flush=True)
        del case
        torch.cuda.empty_cache()
    if tune and best and write:
        write_plan(best, meta or {})
        print(f"wrote {mla.PLAN_PATH} ({len(best)} entries)")
    return rows


VERIFY_TS = (2, 4, 8)  # verify widths 1 + k: k = 1, 3, 7 drafts
VERIFY_QUERY_ROWS = (1, 2)  # rows of a sequence a program takes (2: M = 64 with 32 heads, VERIFY_TILING)


def run_verify(copy_gbps: float, full: bool = True, iters: int = 30) -> list[dict]:
    """#42 item 2: a verify step's MLA (T query rows a sequence, causal within the draft) three ways, same
    case: "rows" (what the runner did: each row its own sequence over an expanded table, the latent read T
    times), "shared qr=1" (the T rows share the sequence's table and length in the kernel: no expand, the
    same programs) and "shared qr=2" (two rows a program, M = 64: the latent read T / 2 times); and the plain
    decode step (T = 1) as the floor. GB/s counts the cache once a sequence: the read a verify step needs."""
    rows = []
    for fp8, batch, ctx in cases(full):
        case = Case(batch, ctx, fp8)
        t1, _ = case.time(iters)
        for T in VERIFY_TS:
            q = torch.randn(batch * T, H, L, device="cuda", dtype=DTYPE)
            out = torch.empty(batch * T, H, KV_LORA, device="cuda", dtype=DTYPE)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")

            def as_rows(bt, q=q, out=out, lens=lens, T=T):  # _mla_attend before #42 item 2, expand included
                tables = bt.unsqueeze(1).expand(batch, T, bt.shape[1]).reshape(batch * T, -1)
                row_lens = (lens.unsqueeze(1) - (T - 1) + torch.arange(T, device="cuda", dtype=lens.dtype)).reshape(-1)
                return mla.mla_decode(q, case.latent, case.scale, tables, row_lens, SM_SCALE, kv_lora_rank=KV_LORA,
                                      out=out)

            variants = {"rows": as_rows}
            for qr in VERIFY_QUERY_ROWS:
                variants[f"shared qr={qr}"] = (
                    lambda bt, q=q, out=out, lens=lens, T=T, qr=qr: mla.mla_decode(
                        q, case.latent, case.scale, bt, lens, SM_SCALE, kv_lora_rank=KV_LORA, out=out,
                        tokens_per_seq=T, query_rows=qr))
            want = as_rows(case.tables[0]).float().clone()
            for name, fn in variants.items():
                try:
                    got = fn(case.tables[0]).float()
                    err = ((got - want).norm() / want.norm()).item()
                    t, samples = case.time(iters, fn=fn)
                    rows.append(_row(case, copy_gbps, t, samples, kernel=f"verify {name}", T=T, rel_err=err,
                                     plain_decode_ms=t1, vs_plain=t / t1, num_splits=0))
                    r = rows[-1]
                    print(f"{r['shape']} T={T} {name:>13}: {1e3 * t:8.1f} us ({t / t1:.2f}x plain decode "
                          f"{1e3 * t1:.1f} us) {r['gbps']:7.0f} GB/s {100 * r['pct_of_copy']:5.1f}% err {err:.1e}",
                          flush=True)
                except Exception as e:  # noqa: BLE001 - one failing variant must not hide the rest
                    print(f"{case.batch} {ctx} T={T} {name}: FAILED {type(e).__name__}: {e}")
        del case
        torch.cuda.empty_cache()
    return rows


def compile_check() -> list[dict]:
    """The split kernel compiled ahead of time for sm_90a (no GPU needed): ptxas's registers and spills for
    the decode tilings (BF16 and FP8 caches) and the verify layouts (a row a program; two rows, M = 64)."""
    import triton.language as tl

    from peregrine.bench.kernels_moe import compile_sm90
    p, n, c = (lambda t: (t, 0)), (lambda v: ("i32", v)), (lambda v: ("constexpr", v))
    out = []
    for name, t, qr, fp8 in (("decode bf16", mla.DEFAULT_TILING, 0, False), ("decode fp8", mla.FP8_TILING, 0, True),
                             ("verify qr=1 bf16", mla.DEFAULT_TILING, 1, False),
                             ("verify qr=2 bf16", mla.VERIFY_TILING, 2, False),
                             ("verify qr=2 fp8", mla.FP8_VERIFY_TILING, 2, True)):
        bh = mla._block_h(H, t)
        fp16 = fp8 and t.fp8_compute == "fp16"
        args = dict(q_ptr=p("*bf16"), lat_ptr=p("*fp8e4nv" if fp8 else "*bf16"), scale_ptr=p("*fp32"),
                    bt_ptr=p("*i32"), len_ptr=p("*i32"), part_ptr=p("*fp32"), lse_ptr=p("*fp32"), out_ptr=p("*bf16"),
                    qk_scale=("fp32", 0.1), q_mul=("fp32", 1.0), H=n(H), num_splits=n(8), T=n(8),
                    s_qb=n(H * L), s_qh=n(L), s_lblk=n(PAGE * L), s_ltok=n(L), s_sblk=n(PAGE), s_stok=n(1),
                    s_btb=n(64), s_pb=n(1), s_ph=n(1), s_ps=n(1), s_eb=n(1), s_eh=n(1), s_ob=n(1), s_oh=n(1),
                    C=c(KV_LORA), R=c(ROPE), BLOCK_C=c(KV_LORA), BLOCK_R=c(ROPE), BLOCK_H=c(bh),
                    BLOCK_N=c(t.block_n), MIN_CHUNK=c(t.min_split_tokens), PAGE=c(PAGE), FP8=c(fp8), PV_LOG=c(fp16),
                    DIRECT=c(False), PREC=c("tf32"), CDT=c(tl.float16 if fp16 else tl.bfloat16), QR=c(qr),
                    BLOCK_M=c(max(qr, 1) * bh))
        out.append({"kernel": name} | compile_sm90(mla._mla_split_kernel, args, t.num_warps, t.num_stages))
    return out


def _try(case, copy_gbps, iters, tiling, splits) -> dict:
    rec = {"num_splits": splits, "tiling": dataclasses.asdict(tiling), "sweep": True}
    try:
        err = case.rel_err(num_splits=splits, tiling=tiling)
        if err > TOL:
            return rec | {"rel_err": err, "error": "wrong result"}
        t, samples = case.time(iters, num_splits=splits, tiling=tiling)
        return _row(case, copy_gbps, t, samples, **rec, rel_err=err)
    except Exception as e:  # noqa: BLE001 - out of resources etc.: skip the config
        return rec | {"error": f"{type(e).__name__}: {e}"[:200]}


def _splits_for(case, tiling, waves: float) -> int:
    groups = -(-H // mla._block_h(H, tiling))
    cap = min(mla.MAX_SPLITS, -(-case.ctx // tiling.block_n))
    return max(1, min(cap, int(waves * mla._num_sms(mla._device("cuda"))) // (case.batch * groups)))


def sweep(case, copy_gbps: float, iters: int = 10) -> tuple[dict | None, list[dict]]:
    """Stage 1: every tiling at one wave of programs; stage 2: the TOP_K over split counts."""
    recs = []
    cache = "fp8" if case.fp8 else "bf16"
    for tiling in TUNE_TILINGS[cache]:
        tiling = dataclasses.replace(tiling, min_split_tokens=tiling.block_n)  # let the split count rule
        recs.append(_try(case, copy_gbps, iters, tiling, _splits_for(case, tiling, 1)))
    ok = sorted((r for r in recs if "time_ms" in r), key=lambda r: r["time_ms"])
    for r in ok[:TOP_K]:
        tiling = mla.MlaTiling(**r["tiling"])
        for s in sorted({_splits_for(case, tiling, f) for f in WAVE_FACTORS} - {r["num_splits"]}):
            recs.append(_try(case, copy_gbps, iters, tiling, s))
    for r in recs:
        if "error" in r:
            print(f"  skip {cache} B={case.batch} ctx={case.ctx} splits={r['num_splits']} {r['tiling']}: {r['error']}")
    ok = sorted((r for r in recs if "time_ms" in r), key=lambda r: r["time_ms"])
    if not ok:
        return None, recs
    win = ok[0] | {"candidates": len(recs), "runner_up_ms": ok[1]["time_ms"] if len(ok) > 1 else None}
    return win, recs


def write_plan(best: dict, meta: dict, path=None) -> None:
    path = path or mla.PLAN_PATH
    try:
        old = json.loads(path.read_text()).get("entries", {})
    except (OSError, ValueError):
        old = {}
    new = {k: r["tiling"] | {"num_splits": r["num_splits"], "measured": {
        f: r.get(f) for f in ("time_ms", "gbps", "pct_of_copy", "rel_err", "runner_up_ms", "candidates")}}
        for k, r in best.items()}
    key = lambda kv: (kv[0].split(",")[0], *[int(x) for x in kv[0].split(",")[1:]])  # noqa: E731
    doc = {"comment": "MLA decode tiling + splits per 'cache,B,context bucket', from "
                      "python -m peregrine.bench.kernels_mla --tune", "meta": meta,
           "entries": dict(sorted((old | new).items(), key=key))}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    mla.load_plan.cache_clear()


def table(rows, head: bool = True) -> str:
    lines = [f"{'cache':>5} {'B':>2} {'ctx':>7} {'splits':>6} {'ms':>8} {'GB/s':>7} {'%copy':>6} {'err':>8} "
             f"{'tuned ms':>8} tiling"] if head else []
    for r in rows:
        t = r.get("tuned_tiling") or r.get("tiling") or {}
        tl = f"h{t.get('block_h')}/n{t.get('block_n')}/w{t.get('num_warps')}/st{t.get('num_stages')}/{t.get('fp8_compute')}"
        tuned = f"{r['tuned_ms']:>8.4f}" if "tuned_ms" in r else f"{'-':>8}"
        lines.append(f"{r['cache']:>5} {r['B']:>2} {r['context']:>7} {r.get('tuned_splits', r['num_splits']):>6} "
                     f"{r['time_ms']:>8.4f} {r['gbps']:>7.0f} {100 * r['pct_of_copy']:>5.1f}% {r['rel_err']:>8.1e} "
                     f"{tuned} {tl}")
    return "\n".join(lines)


def main():
    from peregrine.bench.gpu import copy_bandwidth, result_path, run_metadata, write_result
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="B 1, 8 at 8K and 32K only")
    ap.add_argument("--tune", action="store_true", help="sweep tilings x splits per case and write mla_plan.json")
    ap.add_argument("--no-write", action="store_true", help="with --tune: report only, leave the plan alone")
    ap.add_argument("--budget-s", type=float, default=420.0, help="with --tune: stop tuning new cases after this")
    ap.add_argument("--verify", action="store_true",
                    help="#42: a verify step's MLA (T = 2, 4, 8 rows a sequence) as rows, shared qr=1, qr=2")
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args()
    copy = copy_bandwidth()
    meta = run_metadata() | {"copy_gbps": copy["gbps"], "copy_samples_ms": copy["samples_ms"]}
    if a.verify:
        rows = run_verify(copy["gbps"], full=not a.quick)
        path = write_result(result_path("kernels", "mla-verify", a.results_dir), {"meta": meta, "rows": rows})
        print(f"copy bandwidth {copy['gbps']:.0f} GB/s -> {path}")
        return
    rows = run(copy["gbps"], full=not a.quick, tune=a.tune, write=not a.no_write, budget_s=a.budget_s,
               meta={k: meta[k] for k in ("commit", "gpu", "torch", "triton", "time_utc", "copy_gbps")})
    path = write_result(result_path("kernels", "mla-tune" if a.tune else "mla", a.results_dir),
                        {"meta": meta, "rows": rows})
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s\n{table([r for r in rows if not r.get('sweep')])}\n-> {path}")


if __name__ == "__main__":
    main()
