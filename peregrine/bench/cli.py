"""argparse glue for `peregrine bench decode`, `peregrine bench report` and `peregrine plan`.

Each add_*_parser(subparsers) adds one sub-command whose func(args) returns an
exit code; bad option values print a one-line error (exit 2), not a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..config import DECODE_BACKENDS, KV_CACHE_DTYPES, ConfigError

EXIT_USAGE = 2  # argparse's own code for bad usage


def positive_list(typ, what: str):
    """argparse type: comma-separated values of typ, each >= 1 (what: the error's name for them)."""
    def parse(text: str) -> list:
        try:
            vals = [typ(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
        if not vals or any(v < 1 for v in vals):
            raise argparse.ArgumentTypeError(f"expected {what} >= 1, got {text!r}")
        return vals
    return parse


int_list = positive_list(int, "integers like 1,2,4,8")


def _backends(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in vals if v not in DECODE_BACKENDS]
    if not vals or bad:
        raise argparse.ArgumentTypeError(f"backends must be from {', '.join(DECODE_BACKENDS)}, got {text!r}")
    return vals


def _positive(typ):
    def parse(text: str):
        try:
            v = typ(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {typ.__name__}, got {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return v
    return parse


def _fail(e: Exception) -> int:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USAGE


# ---- bench decode ----
def add_bench_decode_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("decode", help="decode step time per batch size (docs/benchmarks.md §1)")
    p.add_argument("--model", required=True, help="preset name or model folder")
    p.add_argument("--dummy-weights", action="store_true", help="random weights (no checkpoint needed)")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 2, 4, 8], help="B values, e.g. 1,2,4,8 (default)")
    p.add_argument("--input-len", type=_positive(int), default=1, help="prompt tokens per request (default 1)")
    p.add_argument("--output-len", type=_positive(int), default=1024, help="tokens decoded per request, EOS ignored (default 1024)")
    p.add_argument("--backends", type=_backends, default=list(DECODE_BACKENDS), help="decode paths to time, comma-separated (default both)")
    p.add_argument("--prompt-sets", type=_positive(int), default=4, help="different random prompt sets per B (default 4)")
    p.add_argument("--runs", type=_positive(int), default=3, help="runs per prompt set")
    p.add_argument("--results-dir", default="results", help="where the JSON and Markdown go (default results)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="MLA latent cache dtype (auto = model dtype)")
    p.add_argument("--additional-config", default=None, help="JSON object, as for serve")
    p.add_argument("--tensor-parallel-size", "-tp", type=_positive(int), default=1, help="GPUs (ranks) per engine")
    add_sampling_args(p, "sampled requests (each B is then measured greedy and sampled, same engine)")
    p.add_argument("--also-logprobs", type=int, default=None, metavar="N",
                   help="after the sampled rows, the same rows with logprobs N too (same engine, one more ratio)")
    p.set_defaults(func=run_bench_decode)
    return p


def add_sampling_args(p, title: str) -> None:
    """--temperature, --top-p, --top-k, --min-p, --logprobs: the sampled requests of a benchmark (sampling_settings)."""
    g = p.add_argument_group(title)
    g.add_argument("--temperature", type=float, default=None, help="> 0: requests sampled at this temperature")
    g.add_argument("--top-p", type=float, default=None, help="nucleus mass of the sampled requests (default off)")
    g.add_argument("--top-k", type=int, default=None, help="top-k of the sampled requests (default off)")
    g.add_argument("--min-p", type=float, default=None, help="min-p of the sampled requests (default off)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N", help="each token's logprob and the top N")


def sampling_settings(args) -> dict | None:
    """The sampled rows' SamplingParams fields, checked as a request's would be (ValueError names the field)."""
    kw = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "min_p", "logprobs")
          if getattr(args, k, None) is not None}
    if not kw:
        return None
    if not kw.get("temperature"):
        raise ValueError("--top-p, --top-k, --min-p and --logprobs describe sampled rows: give --temperature > 0 too")
    from ..engine.request import SamplingParams
    SamplingParams(**kw).validate(2**31)
    return kw


def run_bench_decode(args) -> int:
    from .decode import bench_decode
    try:
        if args.additional_config:
            json.loads(args.additional_config)  # fail early with a message, before any model is built
        sampling = sampling_settings(args)
        if args.also_logprobs is not None:
            if not sampling:
                raise ValueError("--also-logprobs measures sampled rows: give --temperature > 0 too")
            from ..engine.request import SamplingParams
            SamplingParams(**{**sampling, "logprobs": args.also_logprobs}).validate(2**31)
        r = bench_decode(args.model, args.batch_sizes, args.input_len, args.output_len, tuple(args.backends),
                         args.dummy_weights, prompt_sets=args.prompt_sets, runs=args.runs,
                         kv_cache_dtype=args.kv_cache_dtype, additional_config=args.additional_config,
                         results_dir=args.results_dir,
                         engine_overrides={"tensor_parallel_size": args.tensor_parallel_size}
                         if args.tensor_parallel_size > 1 else None, sampling=sampling,
                         also_logprobs=args.also_logprobs)
    except json.JSONDecodeError as e:
        return _fail(f"--additional-config is not valid JSON: {e.msg}")
    except (ConfigError, ValueError) as e:
        return _fail(e)
    from .report import markdown_table
    print(markdown_table([r]))
    # "not available" is a reported result; a backend that crashed mid-run is a failure
    return 1 if any(b.get("status") == "error" for b in r["backends"].values()) else 0


# ---- bench report ----
def add_bench_report_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", help="plot and tabulate decode result files")
    p.add_argument("files", nargs="*", help="result JSON files (default: results/*-decode.json)")
    p.add_argument("--out", default="results/decode.png", help="PNG path (the .md table goes next to it)")
    p.add_argument("--readme", default=None, help="replace the perf-table section of this Markdown file (docs/performance.md)")
    p.add_argument("--results-dir", default="results", help="where the result files are read (default results)")
    p.set_defaults(func=run_bench_report)
    return p


def run_bench_report(args) -> int:
    from .report import report
    try:
        report(args.files, out=args.out, readme=args.readme, results_dir=args.results_dir)
    except (ValueError, OSError) as e:
        return _fail(e)
    return 0


# ---- plan ----
def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="memory and decode roofline per rank (no GPU, no weights)")
    p.add_argument("--model", required=True, help="preset name or model folder")
    p.add_argument("--tp", type=_positive(int), default=1, help="tensor-parallel ranks")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="MLA latent cache dtype (auto = model dtype)")
    p.add_argument("--context", type=_positive(int), default=8192, help="tokens per sequence for cache sizes")
    p.add_argument("--measured-gbps", type=_positive(float), default=None, help="measured copy bandwidth, GB/s")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_plan)
    return p


def run_plan(args) -> int:
    from ..config import resolve_model
    from .plan import format_plan, plan
    try:
        cfg, _ = resolve_model(args.model)
        p = plan(cfg, tp=args.tp, kv_cache_dtype=args.kv_cache_dtype, context=args.context,
                 measured_gbps=args.measured_gbps)
    except (ConfigError, ValueError) as e:
        return _fail(e)
    print(json.dumps(p, indent=1) if args.json else format_plan(p))
    return 0
