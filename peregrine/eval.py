"""`peregrine eval`: exact-match accuracy on freshly generated, held-out problems,
and a side-by-side mode that fails loudly when two configurations give any
different greedy answer (docs/correctness.md §3).

    peregrine eval --model peregrine-tiny --task add|copy|reverse|recall [--n 500] [--context 2048]
                   [--additional-config JSON] [--kv-cache-dtype fp8]
                   [--compare '{"decode_backend": "latency_specialized"}']
                   [--compare '{"kv_cache_dtype": "fp8"}' --tolerance-points 1]

Problems come from tasks.generate with EVAL_SEED (training draws from its own
stream), so every run and machine sees the same problems. Decoding is greedy.
"""
from __future__ import annotations

import copy
import json
import sys
import time

from .config import ConfigError, EngineConfig, resolve_model
from .engine_args import add_engine_args, engine_config
from .train import tasks

EVAL_SEED = tasks.EVAL_SEED  # the held-out problem set (train.py evaluates on the same one)
DEFAULT_N = 500
DEFAULT_MODEL = "peregrine-tiny"  # the project's trained checkable model
SHOW_DIFFS = 5            # differing answers printed / recorded in full
# --compare keys outside --additional-config's set: engine fields that may legitimately change answers
COMPARE_FIELDS = {"kv_cache_dtype", "dtype", "seed", "max_num_seqs", "cuda_graphs", "max_decode_batch"}


class AnswerMismatch(AssertionError):
    """Two configurations gave different greedy answers."""


def _problems(task: str, n: int, context: int) -> list[tasks.Problem]:
    if n < 1:
        raise ConfigError(f"--n must be >= 1, got {n}")
    if task == "recall" and context < 32:
        raise ConfigError(f"--context must be >= 32 for recall, got {context}")
    return tasks.generate(task, n, EVAL_SEED, context)


def _engine_cfg(cfg: EngineConfig | None, problems) -> EngineConfig:
    """A copy with room for the longest prompt plus its answer."""
    ecfg = copy.deepcopy(cfg) if cfg is not None else EngineConfig()
    need = max(len(p.prompt_ids()) + tasks.max_new_tokens(p) for p in problems) + 1
    if ecfg.max_model_len is None or ecfg.max_model_len < need:
        ecfg.max_model_len = max(need, ecfg.max_model_len or 0)
    return ecfg


def chat_renderer(model: str):
    """The model's chat template as `render(messages) -> str`, the one `peregrine serve` applies."""
    from .server.chat import ChatTemplate
    return ChatTemplate(resolve_model(model)[1]).render


def answers(model: str, problems: list[tasks.Problem], engine_cfg: EngineConfig | None, dummy_weights: bool,
            log=lambda m: None, chat: bool = False) -> list[list[int]]:
    """Greedy output token ids for each problem (answer length + EOS at most); with chat, each prompt is
    sent as one user message through the model's chat template."""
    from .engine import SamplingParams
    from .engine.build import build_engine

    engine, tok = build_engine(model, _engine_cfg(engine_cfg, problems), dummy_weights=dummy_weights, log=log)
    params = [SamplingParams(temperature=0.0, max_tokens=tasks.max_new_tokens(p)) for p in problems]
    if chat:
        render = chat_renderer(model)
        prompts = [tok.encode(render([{"role": "user", "content": p.prompt}])) for p in problems]
    else:
        prompts = [p.prompt_ids() for p in problems]
    return engine.generate(prompts, params)


def _text(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", "replace") + ("<eos>" if tasks.EOS in ids else "")


def _model_name(model: str) -> str:
    return resolve_model(model)[0].name


def _ecfg_dict(e: EngineConfig | None) -> dict:
    e = e or EngineConfig()
    return {k: getattr(e, k) for k in ("decode_backend", "kv_cache_dtype", "dtype", "device", "seed", "max_num_seqs",
                                       "max_decode_batch", "cuda_graphs")}


def _write(model: str, what: str, payload: dict, results_dir) -> str | None:
    if results_dir is None:
        return None
    from .bench.gpu import result_path, run_metadata, write_result
    return str(write_result(result_path(_model_name(model), what, results_dir), {"meta": run_metadata(), **payload}))


def run_eval(model: str, task: str, n: int = DEFAULT_N, context: int = tasks.DEFAULT_CONTEXT,
             engine_cfg: EngineConfig | None = None, dummy_weights: bool = False,
             results_dir="results", log=lambda m: None, chat: bool = False) -> dict:
    """Exact-match accuracy of greedy answers; writes results/<date>-<gpu|cpu>-<model>-eval-<task>[-chat].json."""
    probs = _problems(task, n, context)
    t0 = time.time()
    outs = answers(model, probs, engine_cfg, dummy_weights, log, chat)
    ok = [tasks.check(p, o) for p, o in zip(probs, outs)]
    res = {"model": _model_name(model), "task": task, "n": n, "context": context if task == "recall" else None,
           "seed": EVAL_SEED, "dummy_weights": dummy_weights, "engine": _ecfg_dict(engine_cfg), "chat": chat,
           "correct": sum(ok), "accuracy": sum(ok) / n, "time_s": round(time.time() - t0, 2),
           "wrong": [{"prompt": p.prompt[-40:], "want": p.answer, "got": _text(o)}
                     for p, o, k in zip(probs, outs, ok) if not k][:SHOW_DIFFS],
           "outputs": outs}
    res["path"] = _write(model, f"eval-{task}" + ("-chat" if chat else ""), res, results_dir)
    return res


def _diff_slug(a: dict, b: dict) -> str:
    """What B changes, for the file name: one comparison's JSON must not overwrite another's."""
    changed = [f"{k}-{b[k]}" for k in sorted(b) if a.get(k) != b[k]]
    slug = "_".join(changed) or "same"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in slug)[:80]


def compare(model: str, task: str, n: int, cfg_a: EngineConfig | None, cfg_b: EngineConfig | None,
            context: int = tasks.DEFAULT_CONTEXT, dummy_weights: bool = False, results_dir="results",
            strict: bool = False, log=lambda m: None) -> dict:
    """Greedy answers of two configurations side by side. result["identical"] is False on any
    differing answer; strict=True raises AnswerMismatch instead."""
    probs = _problems(task, n, context)
    a = answers(model, probs, cfg_a, dummy_weights, log)
    b = answers(model, probs, cfg_b, dummy_weights, log)
    diff = [i for i in range(n) if a[i] != b[i]]
    acc = lambda outs: sum(tasks.check(p, o) for p, o in zip(probs, outs)) / n  # noqa: E731
    res = {"model": _model_name(model), "task": task, "n": n, "context": context if task == "recall" else None,
           "seed": EVAL_SEED, "dummy_weights": dummy_weights, "a": _ecfg_dict(cfg_a), "b": _ecfg_dict(cfg_b),
           "accuracy_a": acc(a), "accuracy_b": acc(b), "num_different": len(diff), "identical": not diff,
           "differences": [{"index": i, "prompt": probs[i].prompt[-40:], "want": probs[i].answer,
                            "a": _text(a[i]), "b": _text(b[i])} for i in diff[:SHOW_DIFFS]]}
    res["path"] = _write(model, f"eval-{task}-compare-{_diff_slug(res['a'], res['b'])}", res, results_dir)
    if diff and strict:
        raise AnswerMismatch(f"{len(diff)}/{n} answers differ between the two configurations; first: {res['differences'][0]}")
    return res


def apply_compare(base: EngineConfig, text: str) -> EngineConfig:
    """The second configuration: base with --compare's JSON applied (engine fields or additional-config keys)."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--compare is not valid JSON: {e.msg}") from None
    if not isinstance(d, dict) or not d:
        raise ConfigError("--compare must be a non-empty JSON object, e.g. '{\"decode_backend\": \"latency_specialized\"}'")
    out = copy.deepcopy(base)
    extra = {k: v for k, v in d.items() if k in EngineConfig.ADDITIONAL_KEYS}
    for k, v in d.items():
        if k in extra:
            continue
        if k not in COMPARE_FIELDS:
            raise ConfigError(f"--compare: unknown key '{k}' (valid: {', '.join(sorted(COMPARE_FIELDS | set(EngineConfig.ADDITIONAL_KEYS)))})")
        setattr(out, k, v)
    out.apply_additional_config(extra)
    out.validate()
    return out


def cmd_eval(args) -> int:
    log = (lambda m: None) if args.quiet else (lambda m: print(f"[peregrine] {m}", file=sys.stderr, flush=True))
    base = engine_config(args)
    rd = args.results_dir or None
    if args.compare and args.chat:
        raise ConfigError("--chat measures one configuration; run it without --compare")
    if args.compare:
        other = apply_compare(base, args.compare)
        r = compare(args.model, args.task, args.n, base, other, args.context, args.dummy_weights, rd, log=log)
        print(f"{r['model']} {args.task} n={args.n}: accuracy A {r['accuracy_a']:.3f}, B {r['accuracy_b']:.3f}; "
              f"{r['num_different']} differing greedy answers" + (f" -> {r['path']}" if r["path"] else ""))
        gap = abs(r["accuracy_a"] - r["accuracy_b"]) * 100
        if not r["identical"] and args.tolerance_points is not None:
            ok = gap <= args.tolerance_points
            print(f"{r['num_different']} answers differ; accuracy gap {gap:.2f} points "
                  f"{'within' if ok else 'OVER'} the allowed {args.tolerance_points}", file=sys.stderr)
            return 0 if ok else 1
        if not r["identical"]:
            print(f"ANSWER MISMATCH: {r['num_different']}/{args.n} greedy answers differ between\n  A {r['a']}\n  B {r['b']}",
                  file=sys.stderr)
            for d in r["differences"]:
                print(f"  #{d['index']} ...{d['prompt']!r} want {d['want']!r}: A {d['a']!r} B {d['b']!r}", file=sys.stderr)
            return 1
        return 0
    r = run_eval(args.model, args.task, args.n, args.context, base, args.dummy_weights, rd, log=log, chat=args.chat)
    print(f"{r['model']} {args.task}{' (chat)' if args.chat else ''} n={args.n}" + (f" context={args.context}" if args.task == "recall" else "") +
          f": accuracy {r['accuracy']:.3f} ({r['correct']}/{args.n})" + (f" -> {r['path']}" if r["path"] else ""))
    for w in r["wrong"][:3]:
        print(f"  wrong: ...{w['prompt']!r} want {w['want']!r} got {w['got']!r}")
    return 0


def add_eval_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="exact-match accuracy on checkable tasks; side-by-side answer comparison",
                              description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.set_defaults(model=DEFAULT_MODEL)
    for a in p._actions:  # the shared engine options name generate's default model
        if a.dest == "model":
            a.help = f"preset name or model folder (default {DEFAULT_MODEL}, the trained tiny model)"
    p.add_argument("--task", required=True, choices=tasks.TASKS, help="which checkable task: " + ", ".join(tasks.TASKS))
    p.add_argument("--n", type=int, default=DEFAULT_N, help=f"problems (default {DEFAULT_N})")
    p.add_argument("--context", type=int, default=tasks.DEFAULT_CONTEXT, help="recall prompt length in tokens (default 2048)")
    p.add_argument("--compare", default=None, metavar="JSON",
                   help='run a second configuration side by side (the first plus these changes), e.g. '
                        '\'{"decode_backend": "latency_specialized"}\' or \'{"kv_cache_dtype": "fp8"}\'; exit 1 on any differing answer')
    p.add_argument("--tolerance-points", type=float, default=None, metavar="P",
                   help="with --compare: pass when the accuracies differ by at most P points even if answers differ "
                        "(for lossy options such as the FP8 cache); default: any differing answer fails")
    p.add_argument("--chat", action="store_true",
                   help="send each problem as one user message through the model's chat template, as a chat client would")
    p.add_argument("--results-dir", default="results", help="where the JSON goes ('' = do not write)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_eval)
