"""KDA one-kernel decode microbenchmark (docs/benchmarks.md §2): Kimi-Linear shapes, T = 1.

Each case is a CUDA graph of REPS calls rotating over disjoint state/conv copies (laid out
like the real cache, [copy, slot, ...]), so the FP32 state streams from HBM, not L2.
Bytes = state read + write (FP32) + conv state read + write + qkv|f|b|r inputs + output
+ the layer's small weights + slot ids.

fla (fla-core 0.6.0) is timed side by side when it imports: its decode entry point
fused_recurrent_kda_fwd in the continuous-batching form serving engines use (state pool +
slot indices, in place, gate / beta sigmoid / q-k L2 norm in the kernel). It covers the
recurrence only (no short conv, no output norm or gate), so it moves a few % fewer bytes;
its numerics are checked against our reference on the same conv outputs.

--tune times every candidate config per B (1, 2, 4, 8, 16), keeps the fastest whose
output and state match the FP32 reference, and writes peregrine/kernels/kda_plan.json.
    python -m peregrine.bench.kernels_kda [--quick] [--tune [--no-write]]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import traceback

import torch

from peregrine.kernels import kda as kda_mod
from peregrine.kernels.kda import KdaConfig, kda_decode, kda_decode_ref

H, D, W = 32, 128, 4            # Kimi-Linear KDA heads, head dim, conv width
BATCHES = (1, 2, 4, 8, 16)
T = 1                           # plain decode; speculative T > 1 is the same kernel
SLOTS = 16                      # cache slots per copy; the batch uses a shuffled subset
L2_BYTES = 60 << 20
ROTATE_BYTES = 3 * L2_BYTES     # rotation working set that cannot stay in L2
MAX_COPIES = 64
REPS = 20                       # calls per graph replay: amortises the replay launch
DTYPE = torch.bfloat16
OUT_TOL = 1e-2                  # docs/correctness.md: BF16 output vs the FP32 reference
STATE_TOL = 1e-4                # FP32 state fed by BF16 inputs
TUNE_SPLITS = (2, 4, 8, 16)
TUNE_WARPS = (1, 2, 4, 8)
STATE_PER_THREAD = (8, 64)      # FP32 state values per thread a candidate may hold (ptxas: no spills up to 64)
TUNE_STAGES = (2, 3)            # second pass, on the TOP_K fastest first-pass configs
TOP_K = 2


class Case:
    def __init__(self, batch: int, dev: str = "cuda"):
        C, HD = 3 * H * D, H * D
        per = batch * (H * D * D * 4 + (W - 1) * C * DTYPE.itemsize)
        self.copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // per)))
        self.state = torch.randn(self.copies, SLOTS, H, D, D, device=dev) * 0.1
        self.conv = torch.randn(self.copies, SLOTS, W - 1, C, device=dev, dtype=DTYPE)
        self.slots = torch.randperm(SLOTS, device=dev)[:batch].contiguous()
        rnd = lambda *s, scale=1.0: (torch.randn(*s, device=dev) * scale).to(DTYPE)  # noqa: E731
        self.inp = dict(qkv=rnd(batch, T, C), f=rnd(batch, T, HD), b=rnd(batch, T, H), r=rnd(batch, T, HD),
                        conv_w=rnd(C, W, scale=0.5), A_log=torch.rand(H, device=dev) * 2.7,
                        dt_bias=rnd(HD, scale=0.5), o_norm_w=rnd(D, scale=0.1) + 1)
        self.out = torch.empty(batch, T, HD, device=dev, dtype=DTYPE)
        io = batch * T * (C + HD + H + HD + HD) * DTYPE.itemsize
        weights = (C * W + HD + D) * DTYPE.itemsize + H * 4
        self.bytes = 2 * per + io + weights + batch * 8
        self.batch = batch
        # timing updates the copies in place: validation starts from these untouched originals
        self.state0, self.conv0 = self.state[0].clone(), self.conv[0].clone()
        st, cv = self.state0.clone(), self.conv0.clone()
        self.ref_out = kda_decode_ref(**self.inp, state=st, conv_state=cv, slots=self.slots,  # FP32, unrounded
                                      out=torch.empty(batch, T, HD, device=dev))
        self.ref_state = st[self.slots]

    def call(self, i, **kw):
        return kda_decode(**self.inp, state=self.state[i], conv_state=self.conv[i], slots=self.slots,
                          out=self.out, **kw)

    def errors(self, **kw) -> tuple[float, float]:
        """(output, state) relative errors of one call vs the FP32 reference, from copy 0's original state."""
        st, cv = self.state0.clone(), self.conv0.clone()
        kda_decode(**self.inp, state=st, conv_state=cv, slots=self.slots, out=self.out, **kw)
        e_o = ((self.out.float() - self.ref_out).norm() / self.ref_out.norm()).item()
        e_s = ((st[self.slots] - self.ref_state).norm() / self.ref_state.norm()).item()
        return e_o, e_s


def graph_time(fn_of_i, copies: int, iters: int) -> tuple[float, list[float]]:
    """Median ms per call of a CUDA graph holding REPS calls over rotating copies."""
    from peregrine.bench.gpu import time_fn
    seq = [i % copies for i in range(REPS)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in seq[:3]:  # compile + allocator warm-up outside capture
            fn_of_i(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in seq:
            fn_of_i(i)
    samples = [t / REPS for t in time_fn(g.replay, iters=iters, warmup=3)]
    del g
    return statistics.median(samples), samples


# ---- fla side by side ----

def _conv_qkv(case: Case, dtype) -> tuple[torch.Tensor, ...]:
    """The short conv + SiLU fla's kernel leaves to the caller, from copy 0's conv state: q, k, v [B,T,H,D]."""
    x = case.inp["qkv"]
    hist = torch.cat([case.conv0[case.slots], x], 1).float()          # [B, W-1+T, C]
    w = case.inp["conv_w"].float()                                       # [C, W]
    y = sum(hist[:, j:j + T] * w[:, j] for j in range(W))
    y = y * torch.sigmoid(y)
    return tuple(z.reshape(case.batch, T, H, D).to(dtype).contiguous() for z in y.split(H * D, -1))


def _fla_call(fwd, q, k, v, case: Case, state, g, beta, out):
    return fwd(q=q, k=k, v=v, g=g, beta=beta, A_log=case.inp["A_log"], dt_bias=case.inp["dt_bias"],
               initial_state=state, inplace_final_state=True, ssm_state_indices=case.slots,
               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
               lower_bound=None, out=out)


def fla_errors(case: Case, fwd) -> tuple[float, float]:
    """fla's (output, state) relative errors vs our FP32 reference, fed FP32 conv outputs so any
    gap is the recurrence itself; our output norm and σ(r) gate are applied to its o in PyTorch."""
    B, HD = case.batch, H * D
    q, k, v = _conv_qkv(case, torch.float32)
    st = case.state0.clone()
    o = torch.empty_like(v)
    _fla_call(fwd, q, k, v, case, st, case.inp["f"].view(B, T, H, D).contiguous(), case.inp["b"].contiguous(), o)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * case.inp["o_norm_w"].float()
    o = (o * torch.sigmoid(case.inp["r"].float().view(B, T, H, D))).reshape(B, T, HD)
    e_o = ((o - case.ref_out).norm() / case.ref_out.norm()).item()
    e_s = ((st[case.slots] - case.ref_state).norm() / case.ref_state.norm()).item()
    return e_o, e_s


def fla_compare(case: Case, iters: int) -> dict:
    """fla's time on the same shapes and its numerics vs our reference, or {"fla": why not}."""
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fwd
    except Exception as e:  # noqa: BLE001 - not installed, or an import-time failure
        return {"fla": f"fla not importable ({type(e).__name__}: {e})"[:160]}
    try:
        e_o, e_s = fla_errors(case, fwd)
        B = case.batch
        g = case.inp["f"].view(B, T, H, D).contiguous()
        beta = case.inp["b"].contiguous()
        qb, kb, vb = _conv_qkv(case, DTYPE)  # timing: BF16 inputs as a serving engine has them
        ob = torch.empty_like(vb)
        t, _ = graph_time(lambda i: _fla_call(fwd, qb, kb, vb, case, case.state[i], g, beta, ob), case.copies, iters)
        return {"fla_ms": t, "fla_rel_err_out": e_o, "fla_rel_err_state": e_s}
    except Exception as e:  # noqa: BLE001 - an API drift in fla must not hide our numbers
        return {"fla": f"fla failed: {type(e).__name__}: {e}"[:200]}


# ---- tuning ----

def candidates() -> list[KdaConfig]:
    """The unsplit kernel as the baseline (8 warps as before; ptxas: 25 KB of spills), then every
    split × warps whose state tile is 8..64 FP32 values per thread (above that it spills, below
    most threads idle), with both finishers."""
    out = [KdaConfig(split=1, num_warps=8)]
    for s, w, f in itertools.product(TUNE_SPLITS, TUNE_WARPS, ("last", "launch")):
        if STATE_PER_THREAD[0] <= D * (D // s) // (32 * w) <= STATE_PER_THREAD[1]:
            out.append(KdaConfig(split=s, num_warps=w, finish=f))
    return out


def measure(case: Case, cfg: KdaConfig, iters: int) -> dict:
    """One config: errors, then time; a failure (compile, resources) is recorded, not raised."""
    rec = {"config": dataclasses.asdict(cfg)}
    try:
        e_o, e_s = case.errors(config=cfg)
        rec |= {"rel_err_out": e_o, "rel_err_state": e_s, "correct": e_o <= OUT_TOL and e_s <= STATE_TOL}
        if rec["correct"]:
            rec["time_ms"], rec["samples_ms"] = graph_time(lambda i: case.call(i, config=cfg), case.copies, iters)
    except Exception as e:  # noqa: BLE001
        rec |= {"correct": False, "error": f"{type(e).__name__}: {e}"[:300]}
    return rec


def tune_batch(case: Case, iters: int) -> tuple[dict | None, list[dict]]:
    recs = [measure(case, c, iters) for c in candidates()]
    ok = sorted((r for r in recs if "time_ms" in r), key=lambda r: r["time_ms"])
    for r in ok[:TOP_K]:
        for st in TUNE_STAGES:
            recs.append(measure(case, KdaConfig(**(r["config"] | {"num_stages": st})), iters))
    ok = sorted((r for r in recs if "time_ms" in r), key=lambda r: r["time_ms"])
    for r in recs:
        if not r["correct"]:
            print(f"  B={case.batch} skip {r['config']}: {r.get('error') or 'wrong result'} "
                  f"(err out {r.get('rel_err_out', float('nan')):.1e} state {r.get('rel_err_state', float('nan')):.1e})")
    return (ok[0] if ok else None), recs


def write_plan(best: dict, meta: dict, path=None) -> None:
    path = path or kda_mod.PLAN_PATH
    try:
        old = json.loads(path.read_text()).get("entries", {})
    except (OSError, ValueError):
        old = {}
    entries = old | {kda_mod.plan_key(H, D, B): r["config"] | {"measured": {
        k: r[k] for k in ("time_ms", "gbps", "pct_of_copy", "heuristic_ms", "runner_up_ms", "candidates") if k in r}}
        for B, r in best.items()}
    doc = {"comment": "KDA decode configs per 'H,D,B', from python -m peregrine.bench.kernels_kda --tune",
           "meta": meta, "entries": dict(sorted(entries.items(), key=lambda kv: [int(x) for x in kv[0].split(",")]))}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    kda_mod.load_plan.cache_clear()


# ---- driver ----

def run(copy_gbps: float, full: bool = True, tune: bool = False, iters: int = 30, write: bool = True,
        meta: dict | None = None) -> list[dict]:
    rows, best = [], {}
    for batch in BATCHES if full else (1, 8):
        case = Case(batch)
        cfg = kda_mod.lookup(H, D, batch, "cuda")
        try:
            e_o, e_s = case.errors()
            t, samples = graph_time(case.call, case.copies, iters)
        except Exception:  # noqa: BLE001 - the planned config failing must not hide the others
            print(f"B={batch}: planned config {cfg} failed:\n{traceback.format_exc()}")
            e_o = e_s = t = float("nan")
            samples = []
        gbps = case.bytes / t / 1e6
        row = {"kernel": "kda_decode", "shape": f"B={batch} T={T} H={H} d={D}", "B": batch, "T": T,
               "config": dataclasses.asdict(cfg), "time_ms": t, "bytes": case.bytes, "gbps": gbps,
               "pct_of_copy": gbps / copy_gbps, "rel_err": max(e_o, e_s), "rel_err_out": e_o,
               "rel_err_state": e_s, "samples_ms": samples}
        row |= fla_compare(case, iters)
        if tune:
            heur = kda_mod.heuristic(H, D, batch, "cuda")
            win, recs = tune_batch(case, max(10, iters // 3))
            heur_ms = next((r["time_ms"] for r in recs if r["config"] == dataclasses.asdict(heur) and "time_ms" in r),
                           None)
            for r in recs:
                rows.append({"kernel": "kda_decode[sweep]", "B": batch, "sweep": True, "bytes": case.bytes} | r
                            | ({"gbps": case.bytes / r["time_ms"] / 1e6,
                                "pct_of_copy": case.bytes / r["time_ms"] / 1e6 / copy_gbps} if "time_ms" in r else {}))
            if win is not None:
                timed = sorted(r["time_ms"] for r in recs if "time_ms" in r)
                best[batch] = win | {"gbps": case.bytes / win["time_ms"] / 1e6,
                                     "pct_of_copy": case.bytes / win["time_ms"] / 1e6 / copy_gbps,
                                     "heuristic_ms": heur_ms, "runner_up_ms": timed[1] if len(timed) > 1 else None,
                                     "candidates": len(recs)}
                row |= {"tuned_config": win["config"], "tuned_ms": win["time_ms"], "heuristic_ms": heur_ms}
        rows.append(row)
        print(table([row], head=batch == (BATCHES[0] if full else 1)), flush=True)
        del case
        torch.cuda.empty_cache()
    if tune and best and write:
        write_plan(best, meta or {})
        print(f"wrote {kda_mod.PLAN_PATH} ({len(best)} batch sizes)")
    return rows


def table(rows, head: bool = True) -> str:
    lines = [f"{'B':>2} {'ms':>8} {'GB/s':>6} {'%copy':>6} {'err':>8} {'fla ms':>8} {'fla err':>8} "
             f"{'tuned ms':>8} {'heur ms':>8} config / tuned config"] if head else []
    f = lambda x, spec: format(x, spec) if isinstance(x, float) else f"{'-':>{spec.split('.')[0]}}"  # noqa: E731
    for r in rows:
        cfg = r.get("config", {})
        c = f"s{cfg.get('split')}/w{cfg.get('num_warps')}/{cfg.get('finish')}"
        if "tuned_config" in r:
            tc = r["tuned_config"]
            c += f" -> s{tc['split']}/w{tc['num_warps']}/st{tc['num_stages']}/{tc['finish']}"
        fla_err = max(r.get("fla_rel_err_out", float("nan")), r.get("fla_rel_err_state", float("nan")))
        lines.append(f"{r['B']:>2} {r['time_ms']:>8.4f} {r['gbps']:>6.0f} {100 * r['pct_of_copy']:>5.1f}% "
                     f"{r['rel_err']:>8.1e} {f(r.get('fla_ms'), '8.4f')} {f(fla_err, '8.1e')} "
                     f"{f(r.get('tuned_ms'), '8.4f')} {f(r.get('heuristic_ms'), '8.4f')} {c}"
                     + (f"  [{r['fla']}]" if "fla" in r else ""))
    return "\n".join(lines)


def main():
    from peregrine.bench.gpu import copy_bandwidth, result_path, run_metadata, write_result
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="B 1 and 8 only")
    ap.add_argument("--tune", action="store_true", help="sweep configs per B and write kda_plan.json")
    ap.add_argument("--no-write", action="store_true", help="with --tune: report only, leave the plan alone")
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args()
    copy = copy_bandwidth()
    meta = run_metadata() | {"copy_gbps": copy["gbps"], "copy_samples_ms": copy["samples_ms"]}
    rows = run(copy["gbps"], full=not a.quick, tune=a.tune, write=not a.no_write,
               meta={k: meta[k] for k in ("commit", "gpu", "torch", "triton", "time_utc", "copy_gbps")})
    path = write_result(result_path("kernels", "kda-tune" if a.tune else "kda", a.results_dir),
                        {"meta": meta, "rows": rows})
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s\n{table([r for r in rows if not r.get('sweep')])}\n-> {path}")


if __name__ == "__main__":
    main()
