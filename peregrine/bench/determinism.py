"""Run-to-run determinism of whole generations (docs/correctness.md §4: a moving result on fixed inputs is a
race until proven otherwise), on the GPU:

    python -m peregrine.bench.determinism [--model kimi-linear-48b-a3b] [--layers 4] [--steps 48]

One engine per backend; the same prompts (B = 1 and B = 4, greedy, EOS ignored) generated REPEATS
times in a row over the same engine, so caches and KDA slots are reused exactly as in serving.
Every run's tokens and every step's logits must equal the first run's bit for bit. Writes
results/DATE-GPU-<model>-determinism.json; exit 1 if anything moved.
"""
from __future__ import annotations

import argparse
import sys

import torch

from ..config import EngineConfig
from ..parallel.check import LM_HEAD_SCALE, truncated

REPEATS = 3
BATCHES = (1, 4)


def generations(model: str, backend: str, steps: int, log) -> dict:
    from ..engine import SamplingParams
    from ..engine.build import build_engine
    ecfg = EngineConfig(max_num_seqs=max(BATCHES), max_model_len=steps + 64, decode_backend=backend,
                        extra={"lm_head_scale": LM_HEAD_SCALE})
    e, _ = build_engine(model, ecfg, dummy_weights=True, log=log)
    rec, fwd = [], e.runner.forward

    def recording(step):
        out = fwd(step)
        rec.append(out.float().cpu())
        return out
    e.runner.forward = recording
    g = torch.Generator().manual_seed(1)
    V = e.model_cfg.vocab_size
    res = {}
    for B in BATCHES:
        prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(8, 40, (B,), generator=g)]
        runs = []
        for _ in range(REPEATS):
            rec.clear()
            toks = e.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))
            runs.append((toks, list(rec)))
        t0, l0 = runs[0]
        same_tokens = [toks == t0 for toks, _ in runs[1:]]
        same_logits = [len(ls) == len(l0) and all(torch.equal(a, b) for a, b in zip(ls, l0)) for _, ls in runs[1:]]
        first_moved = next((i for _, ls in runs[1:] for i, (a, b) in enumerate(zip(ls, l0)) if not torch.equal(a, b)), None)
        res[f"B={B}"] = {"tokens_equal": same_tokens, "logits_bitwise_equal": same_logits,
                         "first_moved_step": first_moved, "steps": len(l0)}
        log(f"{backend} B={B}: tokens equal {same_tokens}, logits bitwise {same_logits}"
            + (f", first moved at step {first_moved}" if first_moved is not None else ""))
    del e
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="kimi-linear-48b-a3b")
    ap.add_argument("--layers", type=int, default=4, help="keep the first N layers (real widths; 0 = all)")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--backends", default="standard,latency_specialized")
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the determinism check needs a CUDA GPU", file=sys.stderr)
        return 2
    from . import gpu
    model = truncated(a.model, a.layers)
    log = lambda m: print(f"[determinism] {m}", flush=True)  # noqa: E731
    out = {"model": a.model, "layers": a.layers, "steps": a.steps, "repeats": REPEATS, "meta": gpu.run_metadata(),
           "backends": {b: generations(model, b, a.steps, log) for b in a.backends.split(",")}}
    ok = all(all(r["tokens_equal"]) and all(r["logits_bitwise_equal"]) for b in out["backends"].values() for r in b.values())
    out["deterministic"] = ok
    path = gpu.write_result(gpu.result_path(a.model, "determinism", a.results_dir), out)
    print(f"{'deterministic' if ok else 'NOT DETERMINISTIC'} -> {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
