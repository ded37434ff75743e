"""Train a DSpark-style drafter (speculative/dflash.py) for a target on the target's own greedy outputs, DeepSpec's recipe.

    python -m peregrine.train.drafter --target peregrine-tiny --out DIR [--minutes 30] [--problems copy=300,...]
    python -m peregrine.train.drafter --eval DIR --out results/X.json [--n 500] [--tasks copy,reverse,add,recall]

Data: problems of every task (tasks.py, a seed apart from the eval set), answered greedily by the target through
the engine; a sequence is prompt + the target's answer. One teacher-forced forward of the target per sequence
gives the tapped layers' outputs and its logits at every position (train/forward.py, FP32).
Anchors: every answer position a (the last token the drafter knows), its block [x_a, mask, ...] at a .. a+Bk-1
seeing the context before a; slot j drafts x_{a+j+1} (DeepSpec's convention), the Markov head reading the true
previous token (teacher forcing). Loss (DeepSpec's DSpark: deepspec/modeling/dspark/loss.py):
    w_j = exp(-j / GAMMA) over each block's valid slots,  p_d = softmax(Markov-corrected logits),
    p_t = the target's next-token distribution at a+j,  L1 = ||p_d - p_t||_1,
    loss = 0.1 CE(x*) + 0.9 L1 + 1.0 BCE(confidence, clamp(1 - L1 / 2, 0, 1)), each weighted by w, over sum(w).
The drafter shares the target's embedding and lm_head (frozen, not saved); DIR receives config.json (DeepSpec's
flat layout), model.safetensors and train_log.json.
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

from ..speculative.dflash import DFlashConfig, DFlashModel
from . import tasks
from .forward import hidden_states

GAMMA = 4.0              # DeepSpec's loss_decay_gamma: slot j weighs exp(-j / 4)
ALPHA_CE, ALPHA_L1, ALPHA_CONF = 0.1, 0.9, 1.0  # DeepSpec's DSpark loss mix
WARMUP, CLIP = 0.04, 1.0  # DeepSpec's warm-up fraction and gradient clip (AdamW, no weight decay)
# DeepSpec's lr is 6e-4 at 512 sequences a step; here a step is one sequence's anchors and the copy circuit appears
# only after a plateau (an overfit check on 64 copy answers: loss flat at 2.14 for ~750 steps at 1e-3, then 0.45)
LR = 1e-3
TRAIN_SEED = 0xD5  # problems for training: tasks.generate's stream apart from the eval set's
TASKS = ("copy", "reverse", "add", "recall")
RECALL_CONTEXT = 512  # recall prompts in training: the lookup is the same at any length, shorter is cheaper
COLLECT_CHUNK = 250  # problems per engine call: bounded memory, and progress between calls


def log(msg: str) -> None:
    print(f"[drafter] {msg}", flush=True)


def drafter_config(target_cfg, layers: int, block: int, markov_rank: int, taps: list[int]) -> dict:
    """DeepSpec's flat config.json for a drafter of this target: the target's width, 64-wide heads."""
    H = target_cfg.hidden_size
    heads = max(1, H // 64)
    return dict(architectures=["Qwen3DSparkModel"], model_type="qwen3", hidden_size=H, intermediate_size=2 * H,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=target_cfg.vocab_size,
                num_target_layers=target_cfg.num_hidden_layers, block_size=block,
                mask_token_id=target_cfg.pad_token_id if target_cfg.pad_token_id is not None else target_cfg.vocab_size - 1,
                target_layer_ids=taps, markov_rank=markov_rank, markov_head_type="vanilla",
                enable_confidence_head=True, confidence_head_with_markov=True, tie_word_embeddings=False,
                layer_types=["full_attention"] * layers, attention_bias=False)


def load_init(folder: Path, fresh: dict) -> dict:
    """A saved drafter's tensors as trainable FP32, checked against the shapes this run builds."""
    from safetensors.torch import load_file
    saved = load_file(str(folder / "model.safetensors"))
    if set(saved) != set(fresh) or any(saved[k].shape != fresh[k].shape for k in fresh):
        raise SystemExit(f"--init {folder}: its tensors do not match --layers/--block/--markov-rank of this run")
    return {k: saved[k].float().clone().requires_grad_(True) for k in fresh}


def init_weights(model: DFlashModel, seed: int) -> dict:
    """Trainable FP32 tensors under the checkpoint's names: norms at 1, matrices N(0, 1/fan_in), biases 0."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in model.names().items():
        if "norm" in name:
            t = torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        out[name] = t.requires_grad_(True)
    return out


def collect(target: str, per_task: dict, log=log) -> list[tuple[list[int], int]]:
    """(prompt + the target's greedy answer, prompt length) for per_task[task] problems of each task."""
    from ..config import EngineConfig
    from ..eval import answers
    out = []
    for task, n in per_task.items():
        probs = tasks.generate(task, n, TRAIN_SEED, RECALL_CONTEXT)
        t0 = time.time()
        got = []
        for i in range(0, len(probs), COLLECT_CHUNK):
            got += answers(target, probs[i:i + COLLECT_CHUNK], EngineConfig(max_num_seqs=32), dummy_weights=False)
        out += [(p.prompt_ids() + a, len(p.prompt_ids())) for p, a in zip(probs, got)]
        log(f"{task}: {len(probs)} answers in {time.time() - t0:.0f}s")
    return out


@torch.no_grad()
def features(tmodel, seq: list[int], taps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's taps [L, n·H] and logits [L, V] over one sequence (teacher-forced, FP32)."""
    rec: list = []
    h = hidden_states(tmodel, torch.tensor([seq]), record=rec)
    return torch.cat([rec[L + 1][0] for L in taps], -1), tmodel.compute_logits(h)[0].float()


def sequence_loss(m: DFlashModel, taps, tlogits, seq: list[int], prompt_len: int, anchors: int, rng) -> tuple:
    """DeepSpec's loss over up to `anchors` answer anchors of one sequence -> (weighted sums of CE, L1, BCE, the
    weights, accepted-length proxy): divided by the summed weights by the caller."""
    cfg = m.cfg
    L, Bk = len(seq), cfg.block_size
    cand = list(range(prompt_len - 1, L - 1))  # anchor a: x_{a+1} exists
    if len(cand) > anchors:
        cand = sorted(rng.sample(cand, anchors))
    a = torch.tensor(cand)
    x = torch.tensor(seq)
    kv = m.context_kv(m.context(taps), torch.arange(L))
    ids = torch.full((len(cand), Bk), cfg.mask_token_id, dtype=torch.long)
    ids[:, 0] = x[a]
    h = m.hidden(ids, a, kv)                                    # [A, Bk, H]
    j = torch.arange(Bk)
    tpos = a[:, None] + j[None, :] + 1                          # the token slot j drafts
    valid = tpos < L
    tgt = x[tpos.clamp(max=L - 1)]
    prev = x[(tpos - 1).clamp(max=L - 1)]                       # teacher forcing: the true previous token
    e = m.w["markov_head.markov_w1.weight"][prev]               # [A, Bk, r]
    logits = m.logits(h) + e @ m.w["markov_head.markov_w2.weight"].T
    pt = tlogits[(tpos - 1).clamp(max=L - 1)].softmax(-1)       # the target's distribution for that token
    pd = logits.softmax(-1)
    l1 = (pd - pt).abs().sum(-1)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none").view_as(l1)
    conf = (torch.cat([h, e], -1) @ m.w["confidence_head.proj.weight"].T + m.w["confidence_head.proj.bias"])[..., 0]
    bce = F.binary_cross_entropy_with_logits(conf, (1 - l1 / 2).clamp(0, 1).detach(), reduction="none")
    w = torch.exp(-j.float() / GAMMA)[None, :] * valid
    hit = (logits.argmax(-1) == tgt) & valid
    acc_len = torch.cumprod(hit.float(), 1).sum(1).mean()       # drafts a verify would keep, teacher-forced
    return (w * ce).sum(), (w * l1).sum(), (w * bce).sum(), w.sum(), acc_len


def train(target: str, out: Path, minutes: float, problems: dict, layers: int, block: int, markov_rank: int,
          anchors: int, seed: int, lr: float = LR, init: Path | None = None) -> dict:
    from ..config import resolve_model
    from ..models.kimi import KimiModel
    from ..models.loader import load_weights
    tcfg, folder = resolve_model(target)
    tmodel = KimiModel(tcfg, torch.float32).eval()
    load_weights(tmodel, folder, log=lambda m: None)
    for p in tmodel.parameters():
        p.requires_grad_(False)
    n = tcfg.num_hidden_layers
    taps = sorted({-1, n // 2 - 1, n - 2})  # the embedding, the middle and next-to-last layers
    d = drafter_config(tcfg, layers, block, markov_rank, taps)
    cfg = DFlashConfig.from_dict(d, "drafter")
    shapes = DFlashModel(cfg, {}, tmodel.embed_tokens, tmodel.lm_head)
    w = init_weights(shapes, seed)
    if init is not None:  # continue from a drafter of the same shape (e.g. more data for one task)
        w = load_init(Path(init), w)
    m = DFlashModel(cfg, w, tmodel.embed_tokens, tmodel.lm_head)
    data = collect(target, problems)
    log(f"target features of {len(data)} sequences")
    feats = [features(tmodel, s, taps) for s, _ in data]
    opt = torch.optim.AdamW(list(w.values()), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    t_end, t0, step, hist = time.time() + 60 * minutes, time.time(), 0, []
    order = list(range(len(data)))
    while time.time() < t_end:
        rng.shuffle(order)
        for i in order:
            if time.time() >= t_end:
                break
            # warm-up over the first WARMUP of the wall time, then a cosine to zero at its end: step times differ
            # by sequence length (a recall sequence costs ~50 short ones), so the schedule follows the clock
            frac = min(1.0, (time.time() - t0) / (60 * minutes))
            for gr in opt.param_groups:
                gr["lr"] = lr * min(1.0, (frac + 1e-3) / WARMUP) * 0.5 * (1 + math.cos(math.pi * frac))
            ce, l1, bce, ws, acc = sequence_loss(m, feats[i][0], feats[i][1], data[i][0], data[i][1], anchors, rng)
            loss = (ALPHA_CE * ce + ALPHA_L1 * l1 + ALPHA_CONF * bce) / ws.clamp(min=1e-6)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(w.values()), CLIP)
            opt.step()
            hist.append((loss.item(), (ce / ws).item(), (l1 / ws).item(), acc.item()))
            step += 1
            if step % 200 == 0:
                k = hist[-200:]
                log(f"step {step} ({time.time() - t0:.0f}s): loss {sum(x[0] for x in k) / len(k):.3f} "
                    f"ce {sum(x[1] for x in k) / len(k):.3f} l1 {sum(x[2] for x in k) / len(k):.3f} "
                    f"teacher-forced accepted {sum(x[3] for x in k) / len(k):.2f}")
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(d, indent=1) + "\n")
    save_file({k: v.detach().contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    k = hist[-200:] or [(0, 0, 0, 0)]
    summary = {"target": target, "steps": step, "seconds": round(time.time() - t0, 1), "sequences": len(data),
               "problems_per_task": problems, "layers": layers, "block_size": block, "markov_rank": markov_rank,
               "anchors_per_sequence": anchors, "target_layer_ids": taps, "seed": seed, "lr": lr,
               "init": str(init) if init is not None else None,
               "final_loss": sum(x[0] for x in k) / len(k), "final_ce": sum(x[1] for x in k) / len(k),
               "final_l1": sum(x[2] for x in k) / len(k),
               "final_teacher_forced_accepted": sum(x[3] for x in k) / len(k),
               "curve": [[i, round(sum(x[0] for x in hist[i:i + 100]) / len(hist[i:i + 100]), 4)]
                         for i in range(0, len(hist), 100)]}
    (out / "train_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"wrote {out}: {step} steps, teacher-forced drafts accepted per anchor "
        f"{summary['final_teacher_forced_accepted']:.2f}")
    return summary


EVAL_METHODS = ("dspark", "suffix", "ngram")
GPU_SEQS = 8   # requests at once on the fast path: the batch sizes it serves, each with its measured verify costs
CPU_SEQS = 32  # on the CPU: more rows a step for throughput (full width, no cost table)


def divergences(engine, prompts, plain, got, top: int = 5) -> list[dict]:
    """Each answer unlike plain greedy's: where it first differs, both tokens, and the plain engine's top
    logprobs there (prompt + the common prefix, one step; docs/correctness.md's near-tie rule: each token in
    the other's top 5). An empty list: every answer identical."""
    from ..engine import SamplingParams
    out = []
    for i, (a, b) in enumerate(zip(plain, got)):
        if a == b:
            continue
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        d = {"problem": i, "at": at, "plain": a[at] if at < len(a) else None, "spec": b[at] if at < len(b) else None}
        res = []
        engine.add_request(prompts[i] + a[:at], SamplingParams(temperature=0.0, max_tokens=1, logprobs=top),
                           on_token=lambda o: o.finished and res.append(o))
        while not res:
            engine.step()
        tops = res[0].logprobs[0].top if res[0].logprobs else []
        d["top"] = [[t, round(lp, 4)] for t, lp in tops]
        d["near_tie"] = all(x in {t for t, _ in tops} for x in (d["plain"], d["spec"]) if x is not None)
        out.append(d)
    return out


def evaluate(target: str, drafter: str, n: int, task_names, k: int, recall_context: int, results: Path | None,
             log=log, backend: str | None = None, methods=EVAL_METHODS) -> dict:
    """Per task: the target's plain greedy answers, then with each drafter (this one, suffix, n-gram; k drafts at
    most) -> acceptance length (1 + accepted / verifies, vLLM's), answers identical to plain, accuracy; into
    results/ as JSON. On a GPU (backend latency_specialized, B <= GPU_SEQS) the verify width chooser reads the cost
    table measured from the verify graphs; without one (CPU, standard) every draft is verified."""
    from ..config import EngineConfig
    from ..engine import SamplingParams
    from ..engine.build import build_engine
    from ..eval import EVAL_SEED, _engine_cfg
    specs = {"dspark": {"method": "dspark", "model": drafter, "num_speculative_tokens": k},
             "suffix": {"method": "suffix", "num_speculative_tokens": k},
             "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}}
    import torch
    backend = backend or ("latency_specialized" if torch.cuda.is_available() else "standard")
    seqs = GPU_SEQS if backend == "latency_specialized" else CPU_SEQS
    from ..bench import gpu
    out = {"target": target, "drafter": drafter, "k": k, "n": n, "recall_context": recall_context,
           "backend": backend, "max_num_seqs": seqs, "metadata": gpu.run_metadata(), "tasks": {}}
    for task in task_names:
        probs = tasks.generate(task, n, EVAL_SEED, recall_context)
        prompts = [p.prompt_ids() for p in probs]
        params = [SamplingParams(temperature=0.0, max_tokens=tasks.max_new_tokens(p)) for p in probs]
        row = {}
        for method in ("plain",) + tuple(methods):
            ecfg = _engine_cfg(EngineConfig(max_num_seqs=seqs, decode_backend=backend,
                                            speculative_config=specs.get(method)), probs)
            e, _ = build_engine(target, ecfg, log=lambda m: None)
            if e.spec is not None and not e.spec.costs:
                e.spec.measure_costs(log)  # the width chooser's table: empty without verify graphs (full width)
                out.setdefault("cost_table_ms", {})[f"{task}/{method}"] = e.spec.costs
            t0 = time.time()
            got = e.generate(prompts, params)
            dt = time.time() - t0
            r = {"seconds": round(dt, 1), "accuracy": sum(tasks.check(p, a) for p, a in zip(probs, got)) / n}
            if method == "plain":
                plain, plain_engine = got, e
            else:
                st = e.stats["spec"]
                r |= {"acceptance_length": round(e.spec.mean_acceptance_length, 3), "verifies": st["num_drafts"],
                      "drafted": st["num_draft_tokens"], "accepted": st["num_accepted_tokens"],
                      "identical_to_plain": sum(a == b for a, b in zip(got, plain)), "n": n,
                      "width": "auto" if e.spec.costs else "full (no cost table)",
                      "width_steps": st["width_steps"],  # decode steps by chosen width (0: plain); all 0 at full
                      "drafter_stats": dict(getattr(e.spec.drafter, "stats", {})),  # DSpark: blocks in / apart from verify
                      "differs": divergences(plain_engine, prompts, plain, got)}
            row[method] = r
            log(f"{task} {method}: " + ", ".join(f"{key} {v}" for key, v in r.items()))
        out["tasks"][task] = row
    if results is not None:
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(json.dumps(out, indent=1) + "\n")
        log(f"wrote {results}")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="peregrine-tiny", help="target preset or model folder (default peregrine-tiny)")
    ap.add_argument("--out", required=True, help="folder to write the drafter into")
    ap.add_argument("--minutes", type=float, default=30.0, help="training wall time (default 30)")
    ap.add_argument("--problems", default="copy=300,reverse=300,add=300,recall=300",
                    help="problems per task answered by the target, task=N,... (default 300 each). peregrine-tiny-dspark: "
                         "30 min at the default, then 30 min more with --init and copy=600,reverse=600,add=3000,recall=100 "
                         "--lr 5e-4 (300 additions alone were memorised, not learnt)")
    ap.add_argument("--layers", type=int, default=2, help="drafter layers (default 2)")
    ap.add_argument("--block", type=int, default=8, help="block size = drafts per block (default 8)")
    ap.add_argument("--markov-rank", type=int, default=32, help="rank of the Markov head (default 32)")
    ap.add_argument("--anchors", type=int, default=32, help="anchors per sequence and step (default 32)")
    ap.add_argument("--seed", type=int, default=0, help="weights' and sampling seed (default 0)")
    ap.add_argument("--init", metavar="DIR", default=None, help="start from this drafter folder's weights (same shape)")
    ap.add_argument("--lr", type=float, default=LR, help=f"peak learning rate (default {LR})")
    ap.add_argument("--eval", metavar="DIR", help="evaluate the drafter in DIR instead of training: acceptance per "
                    "task against suffix and n-gram, answers against plain greedy (--out: the results JSON)")
    ap.add_argument("--n", type=int, default=500, help="--eval: problems per task (default 500)")
    ap.add_argument("--tasks", default=",".join(TASKS), help="--eval: comma-separated tasks (default all four)")
    ap.add_argument("--k", type=int, default=7, help="--eval: drafts a verify (default 7)")
    ap.add_argument("--recall-context", type=int, default=RECALL_CONTEXT, help="--eval: recall prompt tokens")
    ap.add_argument("--methods", default=",".join(EVAL_METHODS),
                    help=f"--eval: drafters to compare with plain greedy (default {','.join(EVAL_METHODS)})")
    ap.add_argument("--backend", choices=("standard", "latency_specialized"), default=None,
                    help="--eval: decode backend (default latency_specialized on a GPU, where the verify width is "
                         "chosen per step from measured costs; standard on the CPU, every draft verified)")
    a = ap.parse_args(argv)
    if a.eval:
        names = [t for t in a.tasks.split(",") if t]
        methods = [m for m in a.methods.split(",") if m]
        if not methods or any(m not in EVAL_METHODS for m in methods):
            ap.error(f"--methods from {', '.join(EVAL_METHODS)}, got {a.methods!r}")
        bad = [t for t in names if t not in TASKS]
        if bad or a.n <= 0 or a.k <= 0:
            ap.error(f"--tasks from {', '.join(TASKS)}, --n and --k positive (got tasks {bad}, n {a.n}, k {a.k})")
        evaluate(a.target, a.eval, a.n, names, a.k, a.recall_context, Path(a.out), backend=a.backend,
                 methods=methods)
        return
    try:
        mix = {t: int(n) for t, n in (kv.split("=") for kv in a.problems.split(",") if kv)}
    except ValueError:
        ap.error(f"--problems must look like copy=1000,add=5000, got {a.problems!r}")
    if not mix or any(t not in TASKS or n <= 0 for t, n in mix.items()):
        ap.error(f"--problems: tasks from {', '.join(TASKS)} with positive counts, got {a.problems!r}")
    for name in ("minutes", "layers", "block", "markov_rank", "anchors"):
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if a.lr <= 0:
        ap.error("--lr must be positive")
    init = None
    if a.init:
        from ..speculative.dflash import drafter_dir
        init = drafter_dir(a.init)
    train(a.target, Path(a.out), a.minutes, mix, a.layers, a.block, a.markov_rank, a.anchors, a.seed, a.lr, init)


if __name__ == "__main__":
    main()
