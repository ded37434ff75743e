"""Train the tiny Kimi-Linear model on the checkable tasks (tasks.py).

    python -m peregrine.train.train --out DIR --minutes 8 [--device cuda] [--steps N]

Each step is one short-task batch (add / copy / reverse, ≤ ~40 tokens) plus one
recall batch (several queries over a long "k:v;" context; the context grows
from RECALL_MIN_CONTEXT to --recall-max-context over the first half of the run).
Loss is next-token cross-entropy on answer tokens and their EOS only.

Expert balancing: DeepSeek-style auxiliary-loss-free — after every step each
MoE layer's e_score_correction_bias moves by BALANCE_RATE towards the experts
that got fewer tokens than average (it only changes which experts are chosen,
never the mixing weights, so no extra loss term pulls against the tasks).

DIR receives config.json and model.safetensors (a loadable model folder:
`peregrine generate --model DIR`) plus train_log.json. Weights are saved in
BF16 (A_log, dt_bias and router bias stay FP32 as the model keeps them): ~10.8M
parameters are 21.6 MB in BF16 but 43 MB in FP32, over the 25 MB budget, and
the GPU path runs in BF16 anyway (training uses BF16 autocast, so the model
is trained to tolerate it).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import PRESET_DIR, ModelConfig
from ..models.kimi import KimiModel
from ..models.loader import init_dummy_weights, load_weights, save_weights
from . import tasks
from .forward import CHUNK, train_logits

DEFAULT_CONFIG = PRESET_DIR / "peregrine-tiny.json"
SHORT_MIX = (("add", 0.5), ("copy", 0.25), ("reverse", 0.25))  # addition is the hardest short task
RECALL_MIN_CONTEXT = 96       # curriculum start: short contexts teach the lookup first
RECALL_QUERIES = 16           # queries per recall sequence: more answer tokens per context token
BALANCE_RATE = 1e-3           # aux-free bias step (DeepSeek-V3 uses 1e-3)
WARMUP_STEPS = 200
IGNORE = -100                 # cross_entropy ignore_index


def log(msg: str) -> None:
    print(f"[train] {msg}", flush=True)


# ---- batches -----------------------------------------------------------------
def shift(seq: list[int], scored: list[bool]) -> tuple[list[int], list[int]]:
    """(input ids, targets): target i is seq[i+1] where that token is scored, else IGNORE."""
    return seq[:-1], [t if s else IGNORE for t, s in zip(seq[1:], scored[1:])]


def example(prompt: list[int], answer: list[int]) -> tuple[list[int], list[int]]:
    """One problem: only the answer tokens (and their EOS) are scored."""
    return shift(prompt + answer, [False] * len(prompt) + [True] * len(answer))


def recall_example(r: random.Random, context: int, queries: int) -> tuple[list[int], list[int]]:
    """A long context, then `queries` lookups "?k=" -> "v"+EOS back to back (eval asks one)."""
    pairs = tasks.recall_pairs(r, context)
    seq = list(tasks.recall_context(pairs).encode())
    scored = [False] * len(seq)
    for k, v in r.sample(pairs, min(queries, len(pairs))):
        q, a = list(f"?{k}=".encode()), list(v.encode()) + [tasks.EOS]
        seq += q + a
        scored += [False] * len(q) + [True] * len(a)
    return shift(seq, scored)


def collate(rows: list[tuple[list[int], list[int]]], device, pad: int = tasks.PAD) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(i) for i, _ in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    tgt = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    for b, (i, t) in enumerate(rows):
        ids[b, :len(i)] = torch.tensor(i)
        tgt[b, :len(t)] = torch.tensor(t)
    return ids.to(device), tgt.to(device)


def short_batch(r: random.Random, n: int, device, mix=SHORT_MIX):
    names, weights = zip(*mix)
    make = {"add": tasks.make_add, "copy": tasks.make_copy, "reverse": tasks.make_reverse}
    probs = [make[t](r) for t in r.choices(names, weights, k=n)]
    return collate([example(p.prompt_ids(), p.answer_ids()) for p in probs], device)


def recall_batch(r: random.Random, context: int, token_budget: int, device):
    n = max(1, token_budget // context)
    return collate([recall_example(r, context, RECALL_QUERIES) for _ in range(n)], device)


def parse_mix(text: str) -> tuple[tuple[str, float], ...]:
    try:
        mix = tuple((t, float(w)) for t, w in (part.split("=") for part in text.split(",")))
    except ValueError:
        raise SystemExit(f"--short-mix: expected task=weight,..., got {text!r}")
    bad = [t for t, _ in mix if t not in ("add", "copy", "reverse")]
    if bad or not mix:
        raise SystemExit(f"--short-mix: unknown task(s) {bad} (short tasks: add, copy, reverse)")
    return mix


# ---- model -------------------------------------------------------------------
def autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.device(device).type == "cuda")


def loss_of(model, ids, tgt, loads=None, chunk=CHUNK):
    with autocast(ids.device):
        logits = train_logits(model, ids, loads, chunk)
    return F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=IGNORE)


@torch.no_grad()
def balance(model, loads: list[torch.Tensor]) -> None:
    """Aux-loss-free balancing: raise the bias of under-loaded experts, lower the over-loaded."""
    moes = [layer.mlp for layer in model.layers if layer.is_moe]
    per_layer = len(loads) // max(1, len(moes))
    for j, moe in enumerate(moes):
        load = sum(loads[j + i * len(moes)] for i in range(per_layer)).float()
        moe.bias.add_(BALANCE_RATE * torch.sign(load.mean() - load))


@torch.no_grad()
def teacher_forced_accuracy(model, problems: list[tasks.Problem], device, batch: int = 64) -> float:
    """Fraction of problems whose every answer token (and EOS) is the argmax given the right prefix:
    exactly the problems greedy decoding answers correctly (up to path numerics)."""
    ok = 0
    for i in range(0, len(problems), batch):
        ids, tgt = collate([example(p.prompt_ids(), p.answer_ids()) for p in problems[i:i + batch]], device)
        with autocast(device):
            pred = train_logits(model, ids).argmax(-1)
        m = tgt != IGNORE
        ok += int(((pred == tgt) | ~m).all(1).sum())
    return ok / max(1, len(problems))


def evaluate(model, device, n: int, context: int) -> dict:
    model.eval()
    out = {}
    for t in tasks.TASKS:
        probs = tasks.generate(t, n, tasks.EVAL_SEED, context)
        out[t] = teacher_forced_accuracy(model, probs, device, batch=max(1, 16384 // max(64, context)) if t == "recall" else 256)
    model.train()
    return out


def save(model, cfg_raw: dict, out: Path, extra: dict) -> Path:
    """config.json + BF16 model.safetensors (FP32 where the model keeps FP32) + train_log.json."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(cfg_raw, name=out.name)
    with torch.device("cpu"):
        m16 = KimiModel(cfg, torch.bfloat16)
    with torch.no_grad():
        for (n1, src, _), (n2, dst, _) in zip(model.hf_params(), m16.hf_params()):
            assert n1 == n2
            dst.copy_(src.detach())
    (out / "config.json").write_text(json.dumps(cfg_raw, indent=2) + "\n")
    paths = save_weights(m16, out)
    (out / "train_log.json").write_text(json.dumps(extra, indent=1) + "\n")
    return paths[0]


# ---- loop --------------------------------------------------------------------
def lr_at(step: int, progress: float, base: float, warmup: int = WARMUP_STEPS) -> float:
    warm = min(1.0, (step + 1) / max(1, warmup))
    return base * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    cfg_raw = json.loads(Path(args.config).read_text())
    cfg = ModelConfig.from_dict(cfg_raw, name="peregrine-tiny")
    with torch.device(device):
        model = KimiModel(cfg, torch.float32)
    if args.init:  # continue from a saved model folder (e.g. a second, addition-weighted stage)
        load_weights(model, args.init)
    else:
        init_dummy_weights(model, seed=args.seed)
    mix = parse_mix(args.short_mix)
    for name, p in model.named_parameters():
        p.requires_grad_(not name.endswith(".bias"))  # router bias: moved by balance(), not by gradients
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    nparams = sum(p.numel() for p in model.parameters())
    log(f"{nparams / 1e6:.2f}M parameters on {device}; budget {args.minutes} min, steps {args.steps or 'until time'}")
    r = random.Random(f"train:{args.seed}")
    budget = args.minutes * 60
    t0 = time.time()
    history, step, ntok = [], 0, 0
    model.train()
    while True:
        elapsed = time.time() - t0
        progress = max(step / args.steps if args.steps else 0.0, elapsed / budget)
        if progress >= 1.0:
            break
        ctx = int(RECALL_MIN_CONTEXT + (args.recall_max_context - RECALL_MIN_CONTEXT) * min(1.0, 2 * progress))
        ctx = r.randint(min(RECALL_MIN_CONTEXT, ctx), ctx)
        lr = lr_at(step, progress, args.lr, args.warmup)
        for grp in opt.param_groups:
            grp["lr"] = lr
        loads: list[torch.Tensor] = []
        s_ids, s_tgt = short_batch(r, args.batch, device, mix)
        loss_s = loss_of(model, s_ids, s_tgt, loads, args.chunk)
        loss_s.backward()
        if step % args.recall_every == 0:
            l_ids, l_tgt = recall_batch(r, ctx, args.recall_tokens, device)
            loss_l = loss_of(model, l_ids, l_tgt, loads, args.chunk)
            loss_l.backward()
            ntok += l_ids.numel()
        torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        balance(model, loads)
        step += 1
        ntok += s_ids.numel()
        if step % args.log_every == 0 or step == 1:
            dt = time.time() - t0
            log(f"step {step} loss short {loss_s.item():.4f} recall {loss_l.item():.4f} (ctx {ctx}) lr {lr:.2e} "
                f"{ntok / dt:.0f} tok/s {dt:.0f}s")
        if args.eval_every and step % args.eval_every == 0:
            acc = evaluate(model, device, args.eval_n, args.eval_context)
            history.append({"step": step, "time_s": round(time.time() - t0, 1), **acc})
            log(f"eval step {step}: " + " ".join(f"{k} {v:.3f}" for k, v in acc.items()))
            save(model, cfg_raw, Path(args.out), {"steps": step, "partial": True, "history": history})  # survives a kill
    acc = evaluate(model, device, args.eval_n, args.eval_context)
    history.append({"step": step, "time_s": round(time.time() - t0, 1), **acc})
    log(f"final eval step {step}: " + " ".join(f"{k} {v:.3f}" for k, v in acc.items()))
    summary = {"steps": step, "time_s": round(time.time() - t0, 1), "params": nparams, "tokens": ntok,
               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "final": acc, "history": history, "note": "teacher-forced exact match (== greedy exact match)"}
    path = save(model, cfg_raw, Path(args.out), summary)
    log(f"saved {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return summary


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m peregrine.train.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="model folder to write (config.json + model.safetensors)")
    p.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget for the training loop (default 8)")
    p.add_argument("--steps", type=int, default=0, help="stop after N steps (0: only the time budget)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="model config.json (default: the peregrine-tiny preset)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default=None, help="start from this model folder instead of seeded random weights")
    p.add_argument("--short-mix", default=",".join(f"{t}={w}" for t, w in SHORT_MIX),
                   help="short-task weights, e.g. add=0.8,copy=0.1,reverse=0.1")
    p.add_argument("--recall-every", type=int, default=1, help="a recall batch every N steps (default: every step)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=WARMUP_STEPS, help=f"linear warmup steps (default {WARMUP_STEPS})")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=256, help="short-task sequences per step")
    p.add_argument("--recall-tokens", type=int, default=16384, help="recall tokens per step (sequences = this // context)")
    p.add_argument("--recall-max-context", type=int, default=2560, help="longest recall context of the curriculum")
    p.add_argument("--chunk", type=int, default=CHUNK, help="KDA chunk length of the training forward")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=500, help="steps between held-out evals (0: only at the end)")
    p.add_argument("--eval-n", type=int, default=256, help="held-out problems per task in each eval")
    p.add_argument("--eval-context", type=int, default=tasks.DEFAULT_CONTEXT, help="recall context of the evals")
    return p


def main(argv: list[str] | None = None) -> int:
    train(parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
