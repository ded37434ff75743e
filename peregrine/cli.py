"""peregrine command line: generate | serve | bench | plan | eval.

User mistakes (bad model, config, option or prompt) print one line starting
with "error:" and exit 2; they never show a traceback.
"""
from __future__ import annotations

import argparse
import sys
import time

from .config import ConfigError
from .engine_args import add_engine_args, engine_config

DEFAULT_PROMPT = "rev:peregrine|"  # a task of the default model, peregrine-tiny (README.md, "Presets")


def parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise ConfigError(f"--prompt-ids must be integers separated by commas or spaces, got {text!r}") from None


def generation_request(args, vocab_size: int) -> tuple[list[int] | None, "SamplingParams"]:
    """generate's prompt ids (None: text, encoded once the tokenizer is loaded) and sampling settings,
    checked against the model's config before anything is built; a mistake names its option."""
    from .engine import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.sample_seed,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    params.validate(vocab_size)  # a request's own checks (RequestError names the field), before the model loads
    ids = None
    if args.prompt_ids is not None:
        ids = parse_ids(args.prompt_ids)
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if not ids or bad:
            raise ConfigError(f"--prompt-ids must be 1 or more ids in [0, {vocab_size}), got {bad or 'none'}")
    elif not args.prompt:
        raise ConfigError("--prompt is empty: give some text (or --prompt-ids)")
    return ids, params


def cmd_generate(args) -> int:
    from .config import resolve_model
    from .engine.build import build_engine

    ecfg = engine_config(args)
    ids, params = generation_request(args, resolve_model(args.model)[0].vocab_size)
    log = (lambda *a, **k: None) if args.quiet else (lambda m: print(f"[peregrine] {m}", file=sys.stderr, flush=True))
    engine, tok = build_engine(args.model, ecfg, dummy_weights=args.dummy_weights, log=log)
    if ids is None:
        ids = tok.encode(args.prompt)
    stamps: list[float] = []
    out_ids: list[int] = []

    finish = []

    def on_token(o):
        now = time.perf_counter()
        for t in o.new_token_ids:
            stamps.append(now)
            out_ids.append(t)
            # the token that stopped generation (EOS or a stop id) is not text: like the server, do not print it
            if args.stream and not (o.finished and o.finish_reason == "stop" and t == o.output_token_ids[-1]):
                print(tok.decode([t]), end="", flush=True)
        if o.finished:
            finish.append(o.finish_reason)

    t0 = time.perf_counter()
    engine.add_request(ids, params, on_token=on_token)
    while engine.has_unfinished():
        engine.step()
    if args.stream:
        print()
    else:
        print(tok.decode(out_ids[:-1] if finish == ["stop"] else out_ids))
    if stamps:
        # a step that brings n tokens (speculative decoding) shares its gap among them
        itl = []
        for a, b in zip(stamps, stamps[1:]):
            if b > a:
                n = stamps.count(b)
                itl += [(b - a) * 1e3 / n] * n
        med = sorted(itl)[len(itl) // 2] if itl else float("nan")
        print(f"[peregrine] prompt {len(ids)} tokens, generated {len(out_ids)}; time to first token {(stamps[0] - t0) * 1e3:.1f} ms; "
              f"median inter-token {med:.2f} ms ({1e3 / med if itl else float('nan'):.1f} tok/s); finish {finish[0] if finish else '?'}; "
              f"path {engine.stats.get('steps_by_path')}, lookahead steps {engine.stats.get('lookahead_steps', 0)}",
              file=sys.stderr)
        if engine.spec is not None:
            sp = engine.stats.get("spec", {})
            print(f"[peregrine] speculative: {sp.get('num_accepted_tokens', 0)} of {sp.get('num_draft_tokens', 0)} drafted "
                  f"tokens accepted, mean acceptance length {engine.spec.mean_acceptance_length:.2f}", file=sys.stderr)
        if args.timing:
            print("[peregrine] per-token ms: " + " ".join(f"{x:.2f}" for x in itl), file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .config import preset_names
    p = argparse.ArgumentParser(prog="peregrine", description="Low-latency decode for Kimi-family hybrid MoE models.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="--model takes a model folder (config.json + safetensors + tokenizer) or a preset:\n  "
                                       + "\n  ".join(preset_names())
                                       + "\n\n`peregrine COMMAND --help` explains each command's options.")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    sub.required = True

    g = sub.add_parser("generate", help="generate text for one prompt", description="Generate for one prompt and print the text and token timing.")
    add_engine_args(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=DEFAULT_PROMPT,
                     help=f"prompt text (default {DEFAULT_PROMPT!r}: a task of the default model, peregrine-tiny, "
                          "which answers it 'enirgerep' and other text with little or nothing)")
    src.add_argument("--prompt-ids", default=None, help="prompt as token ids, e.g. '1,2,3'")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens up to this "
                                                            "probability mass (default 1: all)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens only (default 0: off)")
    g.add_argument("--sample-seed", type=int, default=None, help="sampling seed (reproducible sampling)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--stream", action="store_true", help="print tokens as they come")
    g.add_argument("--timing", action="store_true", help="also print every inter-token latency")
    g.add_argument("--quiet", action="store_true", help="no progress output")
    g.set_defaults(func=cmd_generate)

    from .server.cli import add_serve_parser
    add_serve_parser(sub)
    from .eval import add_eval_parser
    add_eval_parser(sub)

    try:
        from .bench import cli as bench_cli
    except ImportError:  # pragma: no cover
        bench_cli = None
    if bench_cli is not None:
        b = sub.add_parser("bench", help="benchmarks: decode step, kernels, serving; report")
        bsub = b.add_subparsers(dest="bench_cmd", metavar="BENCH")
        bsub.required = True
        bench_cli.add_bench_decode_parser(bsub)
        from .bench.spec import add_bench_spec_parser
        add_bench_spec_parser(bsub)
        bench_cli.add_bench_report_parser(bsub)
        from .bench.kernels import add_bench_kernels_parser
        add_bench_kernels_parser(bsub)
        from .server.cli import add_bench_serve_parser
        add_bench_serve_parser(bsub)
        from .bench.ttft import add_bench_ttft_parser
        add_bench_ttft_parser(bsub)
        from .bench.soak import add_bench_soak_parser
        add_bench_soak_parser(bsub)
        bench_cli.add_plan_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from .engine.request import RequestError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ConfigError, RequestError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
