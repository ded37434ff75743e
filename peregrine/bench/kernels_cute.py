"""CuTe DSL kernels on the GPU (issue #46), from the shared libraries scripts/build_cute_gpu.sh builds on a CPU
machine (the GPU machine cannot install the DSL) and a call carries in .cute/: each checked against its FP32
reference, then timed per call with CUDA events against the same bytes through torch (cuBLAS) in the same run, with
the copy bandwidth of that run (docs/benchmarks.md §2); the persistent task kernel also against its chain of GEMVs
and with a wait that is never met (its error word).
    python -m peregrine.bench.kernels_cute [--dir .cute] [--results-dir results]
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import statistics

import torch

WATCHDOG_S = 20.0  # a correctness launch not done by then is hung: the process ends (bounded waits end in ~1 s)
TOL = 1e-2  # relative RMS error against the FP32 reference: BF16 inputs, FP32 accumulation in another order


def weight_stream_rows(lib_dir: str) -> list[dict]:
    from peregrine.kernels.cute import weight_stream as ws
    from peregrine.kernels.cute.launch import CuteLibrary
    from peregrine.bench.gpu import time_fn
    rows = []
    for path in sorted(glob.glob(os.path.join(lib_dir, "libweight_stream-*.so"))):
        N, K = map(int, re.search(r"-(\d+)x(\d+)\.so$", path).group(1, 2))
        g = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(N, K, device="cuda", generator=g).to(torch.bfloat16)
        x = torch.randn(K, device="cuda", generator=g).to(torch.bfloat16)
        y = torch.full((N,), float("nan"), device="cuda")
        row = {"kernel": "weight_stream", "N": N, "K": K, "bytes": N * K * 2 + K * 2 + N * 4}
        try:
            lib = CuteLibrary(path)
            lib.run(w, x, y)
            torch.cuda.synchronize()
            ref = ws.reference(w, x)
            err = float((y - ref).norm() / ref.norm())
            row["rel_err"] = err
            if not err < TOL:
                raise ValueError(f"relative error {err:.2e} >= {TOL}")
            row["ms"] = statistics.median(time_fn(lambda: lib.run(w, x, y), iters=50))
            row["torch_ms"] = statistics.median(time_fn(lambda: torch.mv(w, x), iters=50))
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:1000]}"
        rows.append(row)
    return rows


def persistent_case(path: str, timed: bool = True) -> dict:
    """The persistent task kernel (kernels/cute/persistent_layer.py) from a library scripts/build_cute_gpu.sh built for
    one case (the 48B layer's dense GEMV chain, or its MoE block) and B: two steps (the counters not zeroed between
    them) against the ops' FP32 reference, a wait that can never be met (it must write the error word and return,
    not hang), then the step's time; the dense chain also against the same four GEMVs through torch (cuBLAS, one
    launch each) in the same run."""
    import json
    import time
    import torch.nn.functional as F
    from peregrine.bench.gpu import time_fn
    from peregrine.kernels.cute import persistent_layer as tg
    from peregrine.persistent import table as tb
    compiled = json.load(open(path[:-3] + ".json"))
    name = compiled.pop("case")
    B = compiled["B"]
    row = {"kernel": "persistent_layer", "case": name, "B": B}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if sms < compiled["ctas"]:
        row["error"] = f"{compiled['ctas']} CTAs need as many SMs resident; this GPU has {sms}"
        return row
    g = torch.Generator(device="cuda").manual_seed(B)

    def make(*shape):
        if len(shape) == 1:  # a norm weight or the router's bias
            return 1 + 0.1 * torch.randn(shape, device="cuda", generator=g)
        return (torch.randn(shape, device="cuda", generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)
    ops, width, consts, d_in, kda_shape = tb.case(name, make)
    try:
        t0 = time.perf_counter()
        t = tb.encode(ops, width, compiled["ctas"], B)
        row["encode_s"] = time.perf_counter() - t0
        if name == "dense":
            row["bytes"] = t.pool.numel() * 2
        kda = want_kda = None
        if kda_shape is not None:  # B + 1 state slots, the tokens on a shuffled B of them
            H, d, W = kda_shape
            S = compiled["kda_slots"]
            kda = {"state": 0.1 * torch.randn(S, H, d, d, device="cuda", generator=g),
                   "conv_state": torch.randn(S, W - 1, 3 * H * d, device="cuda", generator=g),
                   "slots": torch.randperm(S, device="cuda", generator=g)[:B].to(torch.int32)}
            want_kda = {k: v.clone() for k, v in kda.items()}
        run = tg.Runner(path, t, B, compiled, kda)
        errs = []
        for step in range(2):
            act = torch.full((B, width), float("nan"), device="cuda")
            tb.load_consts(act, consts)
            act[:, :d_in] = torch.randn(B, d_in, device="cuda", generator=g)
            want = tb.reference(ops, act, want_kda)
            run.step(act, WATCHDOG_S)
            torch.cuda.synchronize()
            errs.append(float((act - want).norm() / want.norm()))
            parts = {"act": errs[-1]}
            if kda is not None:
                errs += [float((kda[k] - want_kda[k]).norm() / want_kda[k].norm()) for k in ("state", "conv_state")]
                parts.update(state=errs[-2], conv_state=errs[-1])
            row.setdefault("errs", []).append(parts)  # per step: which output is off
            if step == 0:  # and which op's columns (a failure names the op to look at)
                row["op_errs"] = [[type(o).__name__, lo, hi, float((act[:, lo:hi] - want[:, lo:hi]).norm()
                                                                   / want[:, lo:hi].norm().clamp_min(1e-30))]
                                  for o in ops for lo, hi in tb._io(o, B)[1]]
            topk = next((o for o in ops if isinstance(o, tb.TopK)), None)
            if topk is not None:  # the router's choice, exactly
                sel = topk.dst
                row.setdefault("ids_equal", []).append(bool(torch.equal(act[:, sel:sel + topk.k],
                                                                         want[:, sel:sel + topk.k])))
        row["rel_err"], row["error_word"], row["error_detail"] = max(errs), run.error(), run.error_detail()
        if topk is not None:  # the floor: every other weight once, each chosen expert once
            experts = [o for o in ops if isinstance(o, tb.Experts)]
            E, I2, D = experts[0].w.shape
            sel, k = topk.dst, topk.k
            per_expert = 3 * (I2 // 2) * D * 2
            fixed = sum(o.w.numel() * 2 for o in ops if isinstance(o, tb.Gemv)) + t.params.numel() * 4
            row["experts"] = int(act[:, sel:sel + k].long().unique().numel())
            row["bytes"] = fixed + row["experts"] * per_expert
            row["bytes_streamed"] = tb.streamed_blocks(t, act) * tb.BN * tb.BK * 2 + t.params.numel() * 4
        if not (row["rel_err"] < TOL and row["error_word"] == 0 and all(row.get("ids_equal", [True]))):
            worst = max(row["op_errs"], key=lambda e: e[3] if e[3] == e[3] else float("inf"))  # NaN first
            raise ValueError(f"relative error {row['rel_err']:.2e} (tolerance {TOL}), error word "
                             f"{row['error_word']}, ids equal {row.get('ids_equal')}; per step {row['errs']}; worst op "
                             f"{worst[0]} columns {worst[1]}:{worst[2]} at {worst[3]:.2e}")
        bad = tb.Table(**{**t.__dict__, "tasks": t.tasks.clone()})
        victim = int((bad.tasks[:, tb.SIGNAL] == len(ops) - 1).nonzero()[0])
        bad.tasks[victim, tb.COUNT0] += 1  # one task more than its input op has: never met
        t0 = time.perf_counter()
        stuck = tg.Runner(path, bad, B, compiled, None if kda is None else {k: v.clone() for k, v in kda.items()})
        stuck.step(act, WATCHDOG_S)
        torch.cuda.synchronize()
        row["missing_dep"] = {"error_word": stuck.error(), "want": victim + 1, "s": time.perf_counter() - t0,
                              "detail": stuck.error_detail(), "want_waited_on_op": int(bad.tasks[victim, tb.WAIT0])}
        del stuck
        if row["missing_dep"]["error_word"] != victim + 1:
            raise ValueError(f"a wait never met gave error word {row['missing_dep']['error_word']}, not {victim + 1}")
        if timed:
            row["ms"] = statistics.median(time_fn(lambda: run.step(act), iters=50))
            row["error_word_after_timing"] = run.error()
            if name == "dense":
                x = act[:, :d_in].to(torch.bfloat16)
                w = [o.w for o in ops]
                v0 = 2 * (w[0].shape[0] // 3)

                def chain():
                    y = F.linear(x, w[0])
                    y = F.linear(y[:, v0:], w[1])
                    y = F.linear(y, w[2])
                    return F.linear(y[:, :w[3].shape[1]], w[3])
                row["torch_ms"] = statistics.median(time_fn(chain, iters=50))
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        row["error"] = f"{type(e).__name__}: {str(e)[:1000]}"
    return row


def chain_layer_ms(one: str, two: str) -> dict[int, dict]:
    """Today's chain for one KDA + MoE layer, per B: the specialized step's graph replay with two such layers minus
    with one (bench decode's JSONs in folders `one` and `two`, run on the same machine): embedding, head, sampling
    and launch overheads cancel, one layer's kernels remain."""
    import json

    def load(d):
        f = max(glob.glob(os.path.join(d, "*decode*.json")), key=os.path.getmtime)
        return {r["batch"]: r for r in json.load(open(f))["backends"]["latency_specialized"]["batches"]}
    a, b = load(one), load(two)
    return {B: {"chain_layer_ms": b[B]["graph_replay_ms"] - a[B]["graph_replay_ms"],
                "chain_experts": b[B].get("distinct_experts_mean")} for B in sorted(set(a) & set(b))}


def main() -> None:
    from peregrine.bench.gpu import copy_bandwidth, result_path, run_metadata, write_result
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=".cute", help="folder of the built libraries (scripts/build_cute_gpu.sh)")
    ap.add_argument("--results-dir", default="results")
    ap.add_argument("--chain", nargs=2, metavar=("ONE", "TWO"), help="bench decode folders of the 48B's widths with "
                    "one and two KDA + MoE layers (scripts/gpu_persistent_layer.sh): the layer cases are set beside "
                    "the chain's time for one layer")
    a = ap.parse_args()
    copy = copy_bandwidth()
    rows = weight_stream_rows(a.dir)
    rows += [persistent_case(p) for p in sorted(glob.glob(os.path.join(a.dir, "libpersistent-*.so")))]
    if a.chain:
        chain = chain_layer_ms(*a.chain)
        for r in rows:
            if r.get("case") == "layer" and r.get("B") in chain:
                r.update(chain[r["B"]])
                if "ms" in r:
                    r["persistent_over_chain"] = r["ms"] / r["chain_layer_ms"]
    for r in rows:
        for k in ("ms", "torch_ms"):
            if k in r and r.get("bytes"):
                r[k.replace("ms", "gbps")] = r["bytes"] / r[k] / 1e6
                r[k.replace("ms", "pct_of_copy")] = r["bytes"] / r[k] / 1e6 / copy["gbps"]
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    print("wrote", write_result(result_path("cute", "kernels-cute", a.results_dir),
                                {"meta": run_metadata(), "copy": copy, "rows": rows}))


if __name__ == "__main__":
    main()
