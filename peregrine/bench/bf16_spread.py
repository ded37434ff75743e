"""How far two correct BF16 runs of a dummy-weight model can be apart: the same weights in FP32 and
in BF16, the same greedy prompts through the standard path, per step the relative RMSE of the BF16
logits against FP32 per sequence, and in how many MoE layers the routed experts differ.

    python -m peregrine.bench.bf16_spread [--model tiny-kimi-linear] [--device cpu] [--steps 3]

It calibrates the BF16 tolerances of the path-equivalence checks (tests/test_specialized.py,
peregrine.parallel.check): rows whose routing agrees stay near 1 %, a row where one router near-tie
swaps an expert moves by 10-20 %, so a whole-step tolerance of 3 % fails on correct code.
"""
from __future__ import annotations

import argparse

import torch

from ..config import EngineConfig
from ..parallel.check import LM_HEAD_SCALE, N_SEQS
from ..testing import rel_rmse


def generate(model: str, dtype: str, device: str, steps: int):
    """Greedy generation of N_SEQS seeded prompts; per step the logits and each MoE layer's sorted ids."""
    from ..engine import SamplingParams
    from ..engine.build import build_engine
    ecfg = EngineConfig(max_num_seqs=N_SEQS, max_model_len=64, device=device, dtype=dtype, max_decode_batch=N_SEQS,
                        extra={"lm_head_scale": LM_HEAD_SCALE})
    e, _ = build_engine(model, ecfg, dummy_weights=True, log=lambda m: None)
    rec, fwd = [], e.runner.forward
    moes = [l.mlp for l in e.runner.model.layers if l.is_moe]

    def recording(step):
        out = fwd(step)
        rec.append((out.float().cpu(), [m.last_ids.sort(-1).values.cpu() for m in moes]))
        return out
    e.runner.forward = recording
    e.runner.record_routing = True  # eager steps: last_ids belong to this step
    g = torch.Generator().manual_seed(0)
    V = e.model_cfg.vocab_size
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (N_SEQS,), generator=g)]
    return e.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True)), rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-kimi-linear")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args(argv)
    t32, r32 = generate(a.model, "fp32", a.device, a.steps)
    t16, r16 = generate(a.model, "bf16", a.device, a.steps)
    print(f"{a.model} on {a.device}: BF16 vs FP32 logits, same dummy weights, {N_SEQS} sequences (step 0 = prefill)")
    for i, ((x, ix), (y, iy)) in enumerate(zip(r32, r16)):
        if i and [t[:i] for t in t32] != [t[:i] for t in t16]:
            print(f"step {i}: greedy histories differ from here on")
            break
        rows = [rel_rmse(y[j], x[j]) for j in range(x.shape[0])]
        if i == 0:  # prefill: routing rows are tokens, not sequences; say in how many layers any differs
            n = sum(int(not torch.equal(l32, l16)) for l32, l16 in zip(ix, iy))
            print(f"step 0: whole step {rel_rmse(y, x):.3f}; per sequence " + " ".join(f"{e:.3f}" for e in rows)
                  + f"   (routed experts differ for some token in {n} of {len(ix)} MoE layers)")
            continue
        flips = [any(not torch.equal(l32[j], l16[j]) for l32, l16 in zip(ix, iy)) for j in range(x.shape[0])]
        print(f"step {i}: whole step {rel_rmse(y, x):.3f}; per sequence " +
              " ".join(f"{e:.3f}{'*' * f}" for e, f in zip(rows, flips)) + "   (* = routed experts differ)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
