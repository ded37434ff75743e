"""TP = N against TP = 1 on the GPU, both decode paths, one command:

    python -m peregrine.parallel.check --tp 2 [--model tiny-kimi-linear] [--layers 4] [--steps 64]

Per path: the same prompts (8 sequences, greedy) through a one-rank engine and an
N-rank engine built from the same seed; every step's logits are compared (relative
RMSE, BF16 tolerance) and the greedy tokens must be identical. In BF16 the partial
sums are added in another order, so a near-tie may flip a token: the first
divergence is reported with whether each side's token is in the other's top-5
(vLLM's check_logprobs_close rule), and only steps before it are compared. With routing
recorded (the default), a step where a sequence's routed experts differ ends its comparison too:
its logits move by design, and a token divergence after it is not judged. --dtype float32
leaves no room for either: tokens must be identical and logits within 1e-4.
A path may carry options after colons: `nccl` (NCCL instead of the one-shot all-reduce),
`slice` (tp_slice_replicated: router logits and MLA latent sliced per rank and gathered).
Writes results/DATE-GPU-MODEL-tpN-check.json (one file per world size); exit 1 if a path fails.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from ..config import EngineConfig, resolve_model

BF16_TOL = 3e-2        # relative RMSE of a step's logits (as tests/test_specialized.py on the GPU)
FP32_TOL = 1e-4
TOP = 5                # the near-tie rule at a divergence
LM_HEAD_SCALE = 4.0    # sharper dummy logits: greedy choices as confident as a trained model's
N_SEQS = 8
OPTIONS = ("nccl", "slice")  # path options after a colon (module docstring)


def truncated(model: str, layers: int | None) -> str:
    """A model folder with only the first `layers` layers of the preset (real widths, quick to build)."""
    if not layers:
        return model
    cfg, _ = resolve_model(model)
    from ..config import PRESET_DIR
    raw = json.loads((PRESET_DIR / f"{model}.json").read_text())
    d = raw.get("text_config") or raw
    lac = d["linear_attn_config"]
    lac["kda_layers"] = [x for x in lac["kda_layers"] if x <= layers]
    lac["full_attn_layers"] = [x for x in lac["full_attn_layers"] if x <= layers]
    d["num_hidden_layers"] = layers
    out = Path(tempfile.mkdtemp()) / f"{model}-{layers}l"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw))
    return str(out)


def run(model: str, tp: int, backend: str, steps: int, log, routing: bool = True, dtype: str | None = None) -> dict:
    """Greedy generation of N_SEQS seeded prompts; every step's logits, and with `routing` (eager steps)
    every step's routed experts per MoE layer, split per sequence."""
    from ..engine import SamplingParams
    from ..engine.build import build_engine
    backend, *opts = backend.split(":")  # e.g. latency_specialized:nccl:slice
    if set(opts) - set(OPTIONS):
        raise ValueError(f"unknown path option(s) {sorted(set(opts) - set(OPTIONS))}; known: {', '.join(OPTIONS)}")
    ecfg = EngineConfig(max_num_seqs=N_SEQS, max_model_len=steps + 32, decode_backend=backend, tensor_parallel_size=tp,
                        max_decode_batch=N_SEQS, tp_allreduce="nccl" if "nccl" in opts else "auto",
                        tp_slice_replicated="slice" in opts, dtype=dtype, extra={"lm_head_scale": LM_HEAD_SCALE})
    e, _ = build_engine(model, ecfg, dummy_weights=True, log=log)
    rec, routes, fwd = [], [], e.runner.forward
    runner = getattr(e.runner, "inner", e.runner)  # rank 0 under TP: the driver wraps the runner
    moes = [l.mlp for l in runner.model.layers if l.is_moe] if routing else []
    if routing:
        e.runner.record_routing = True  # eager steps on every rank: last_ids belong to this step

    def recording(step):
        out = fwd(step)
        rec.append((e.runner.last_path, out.float().cpu()))
        if moes:  # per sequence: its tokens' sorted expert ids, every MoE layer
            ids = [m.last_ids.sort(-1).values.cpu() for m in moes]
            routes.append([[x[o:o + n] for x in ids] for o, n in zip(_offsets(step.q_lens), step.q_lens)])
        return out
    e.runner.forward = recording
    g = torch.Generator().manual_seed(0)
    V = e.model_cfg.vocab_size
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (N_SEQS,), generator=g)]
    toks = e.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))
    paths = {}
    for p, _ in rec:
        paths[p] = paths.get(p, 0) + 1
    out = {"tokens": toks, "logits": [x for _, x in rec], "paths": paths, "dtype": str(e.model.dtype),
           "routes": routes or None, "lookahead_steps": e.stats["lookahead_steps"]}
    del e
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _offsets(lens):
    out, o = [], 0
    for n in lens:
        out.append(o)
        o += n
    return out


def first_routing_flips(a: dict, b: dict, n: int) -> list:
    """Per sequence, the first step whose routed experts differ between the runs (None: never, or
    routing not recorded). A router near-tie in BF16 swaps one expert and moves that row's logits by
    10-20 % on dummy weights (peregrine/bench/bf16_spread.py): from there on the runs legitimately part."""
    flips = [None] * n
    for i, (ra, rb) in enumerate(zip(a.get("routes") or [], b.get("routes") or [])):
        for s in range(min(n, len(ra), len(rb))):
            if flips[s] is None and any(not torch.equal(x, y) for x, y in zip(ra[s], rb[s])):
                flips[s] = i
    return flips


def compare(a: dict, b: dict) -> dict:
    """Per sequence, every step up to where the runs legitimately part (its first token divergence
    or routing flip) within tolerance, except the flip step itself; a token divergence before any
    routing flip must be a top-5 near-tie (vLLM's check_logprobs_close rule)."""
    from ..testing import rel_rmse
    tol = FP32_TOL if "float32" in a["dtype"] else BF16_TOL
    n = min(len(a["tokens"]), len(b["tokens"]))
    divs = [next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None) for ta, tb in zip(a["tokens"], b["tokens"])]
    flips = first_routing_flips(a, b, n)
    errs, bad, near = [], [], []
    for s in range(n):
        stop = min(x for x in (divs[s], flips[s], len(a["logits"]) - 1) if x is not None)
        for i in range(stop + 1):  # step i made token i of every sequence (all decode from step 1)
            la, lb = a["logits"][i], b["logits"][i]
            if la.shape != lb.shape or s >= la.shape[0]:
                continue
            err = rel_rmse(lb[s], la[s])
            if i == flips[s]:
                continue  # the step where an expert was swapped: its logits differ by design
            errs.append(err)
            if err > tol:
                bad.append({"sequence": s, "step": i, "rel_rmse": err})
        if divs[s] is not None and (flips[s] is None or divs[s] < flips[s]):  # after a flip: parted by design
            k = divs[s]
            la, lb = a["logits"][k][s], b["logits"][k][s]
            ta, tb = a["tokens"][s][k], b["tokens"][s][k]
            near.append({"sequence": s, "position": k, "tp1": ta, "tpn": tb,
                         "near_tie_top5": bool(ta in lb.topk(TOP).indices.tolist() and tb in la.topk(TOP).indices.tolist())})
    res = {"tokens_identical": all(d is None for d in divs), "max_rel_rmse": max(errs) if errs else None, "tol": tol,
           "rows_compared": len(errs), "first_divergence_per_sequence": divs, "first_routing_flip_per_sequence": flips,
           "over_tolerance": bad[:8], "token_divergences_off_flips": near, "paths_tp1": a["paths"], "paths_tpn": b["paths"],
           "lookahead_steps_tp1": a.get("lookahead_steps"), "lookahead_steps_tpn": b.get("lookahead_steps")}
    res["ok"] = bool(errs) and not bad and all(x["near_tie_top5"] for x in near)
    res["strict_ok"] = res["ok"] and res["tokens_identical"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default="tiny-kimi-linear")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers (real widths, quick build)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--backends", default="standard,latency_specialized,latency_specialized:nccl",
                    help="decode paths with options: latency_specialized:nccl forces NCCL instead of the one-shot "
                         "all-reduce, :slice turns tp_slice_replicated on (e.g. standard:slice)")
    ap.add_argument("--dtype", default=None, help="model dtype (default bf16 on the GPU); float32 compares at "
                    f"{FP32_TOL} with no room for near-ties")
    ap.add_argument("--results-dir", default="results")
    ap.add_argument("--graphs", action="store_true", help="replay CUDA graphs instead of recording routing "
                    "(then a router near-tie cannot be told from an error)")
    args = ap.parse_args(argv)
    from ..bench import gpu
    log = lambda m: print(f"[check] {m}", file=sys.stderr, flush=True)  # noqa: E731
    model = truncated(args.model, args.layers)
    name = args.model + (f"-{args.layers}l" if args.layers else "") + (f"-{args.dtype}" if args.dtype else "")
    result = {"kind": "tp-check", "model": name, "tp": args.tp, "steps": args.steps, "metadata": gpu.run_metadata(),
              "paths": {}}
    ok = True
    for backend in args.backends.split(","):
        t0 = time.time()
        try:
            one = run(model, 1, backend, args.steps, log, routing=not args.graphs, dtype=args.dtype)
            many = run(model, args.tp, backend, args.steps, log, routing=not args.graphs, dtype=args.dtype)
            r = compare(one, many)
        except Exception as e:  # reported, and the other path still runs
            r = {"ok": False, "error": repr(e), "traceback": traceback.format_exc()}
        r["seconds"] = round(time.time() - t0, 1)
        result["paths"][backend] = r
        ok &= r["ok"]
        log(f"{name} {backend}: TP={args.tp} vs TP=1 " + ("OK" if r["ok"] else "FAILED") + " " +
            json.dumps({k: v for k, v in r.items() if k != "traceback"}))
    path = gpu.write_result(gpu.result_path(name, f"tp{args.tp}-check", args.results_dir), result)
    log(f"wrote {path}")  # before the ranks' teardown: the result is kept whatever happens there
    from .launch import shutdown
    shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
