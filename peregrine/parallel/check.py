"""TP = N against TP = 1 on the GPU, both decode paths, one command:

    python -m peregrine.parallel.check --tp 2 [--model tiny-kimi-linear] [--layers 4] [--steps 64]

Per path: the same prompts (8 sequences, greedy) through a one-rank engine and an
N-rank engine built from the same seed; every step's logits are compared (relative
RMSE, BF16 tolerance) and the greedy tokens must be identical. In BF16 the partial
sums are added in another order, so a near-tie may flip a token: the first
divergence is reported with whether each side's token is in the other's top-5
(vLLM's check_logprobs_close rule), and only steps before it are compared.
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


def run(model: str, tp: int, backend: str, steps: int, log) -> dict:
    from ..engine import SamplingParams
    from ..engine.build import build_engine
    backend, *opts = backend.split(":")  # e.g. latency_specialized:nccl:slice
    if set(opts) - set(OPTIONS):
        raise ValueError(f"unknown path option(s) {sorted(set(opts) - set(OPTIONS))}; known: {', '.join(OPTIONS)}")
    ecfg = EngineConfig(max_num_seqs=N_SEQS, max_model_len=steps + 32, decode_backend=backend, tensor_parallel_size=tp,
                        max_decode_batch=N_SEQS, tp_allreduce="nccl" if "nccl" in opts else "auto",
                        tp_slice_replicated="slice" in opts, extra={"lm_head_scale": LM_HEAD_SCALE})
    e, _ = build_engine(model, ecfg, dummy_weights=True, log=log)
    rec, fwd = [], e.runner.forward

    def recording(step):
        out = fwd(step)
        rec.append((e.runner.last_path, out.float().cpu()))
        return out
    e.runner.forward = recording
    g = torch.Generator().manual_seed(0)
    V = e.model_cfg.vocab_size
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (N_SEQS,), generator=g)]
    toks = e.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))
    paths = {}
    for p, _ in rec:
        paths[p] = paths.get(p, 0) + 1
    out = {"tokens": toks, "logits": [x for _, x in rec], "paths": paths, "dtype": str(e.model.dtype)}
    del e
    gc.collect()
    torch.cuda.empty_cache()
    return out


def compare(a: dict, b: dict) -> dict:
    from ..testing import rel_rmse
    tol = FP32_TOL if "float32" in a["dtype"] else BF16_TOL
    div = None  # (sequence, position) of the first greedy divergence
    for s, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
        k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if k is not None and (div is None or k < div[1]):
            div = (s, k)
    # steps before the divergence: one logits row per sequence and step
    n = len(a["logits"]) if div is None else min(len(a["logits"]), div[1] + 1)
    errs = [rel_rmse(lb, la) for la, lb in zip(a["logits"][:n], b["logits"][:n]) if la.shape == lb.shape]
    res = {"tokens_identical": div is None, "max_rel_rmse": max(errs) if errs else None, "tol": tol,
           "steps_compared": len(errs), "paths_tp1": a["paths"], "paths_tpn": b["paths"]}
    if div is not None:
        s, k = div
        la, lb = a["logits"][k][s], b["logits"][k][s]  # decode step k: row s (all sequences decode from step 1)
        ta, tb = a["tokens"][s][k], b["tokens"][s][k]
        res["first_divergence"] = {"sequence": s, "position": k, "tp1": ta, "tpn": tb,
                                   "near_tie_top5": bool(ta in lb.topk(TOP).indices.tolist() and tb in la.topk(TOP).indices.tolist())}
    res["ok"] = bool(errs) and res["max_rel_rmse"] <= tol and (div is None or res["first_divergence"]["near_tie_top5"])
    res["strict_ok"] = res["ok"] and div is None
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
    ap.add_argument("--results-dir", default="results")
    args = ap.parse_args(argv)
    from ..bench import gpu
    log = lambda m: print(f"[check] {m}", file=sys.stderr, flush=True)  # noqa: E731
    model = truncated(args.model, args.layers)
    name = args.model + (f"-{args.layers}l" if args.layers else "")
    result = {"kind": "tp-check", "model": name, "tp": args.tp, "steps": args.steps, "metadata": gpu.run_metadata(),
              "paths": {}}
    ok = True
    for backend in args.backends.split(","):
        t0 = time.time()
        try:
            one = run(model, 1, backend, args.steps, log)
            many = run(model, args.tp, backend, args.steps, log)
            r = compare(one, many)
        except Exception as e:  # reported, and the other path still runs
            r = {"ok": False, "error": repr(e), "traceback": traceback.format_exc()}
        r["seconds"] = round(time.time() - t0, 1)
        result["paths"][backend] = r
        ok &= r["ok"]
        log(f"{name} {backend}: TP={args.tp} vs TP=1 " + ("OK" if r["ok"] else "FAILED") + " " +
            json.dumps({k: v for k, v in r.items() if k != "traceback"}))
    from .launch import shutdown
    shutdown()
    path = gpu.write_result(gpu.result_path(name, f"tp{args.tp}-check", args.results_dir), result)
    log(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
