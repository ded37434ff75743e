"""The configuration reference, rendered from the code: `python -m peregrine.reference > docs/configuration.md`.

It lists every option of `peregrine serve` and `peregrine generate` (their argparse help and defaults), every
`--additional-config` key (EngineConfig.ADDITIONAL_KEYS and ADDITIONAL_HELP), every `--speculative-config` field
(SpeculativeConfig's fields, described in SPECULATIVE_HELP below) and every environment variable (peregrine/envs.py).
tests/test_docs.py checks that docs/configuration.md equals this output, so the page cannot drift from the code.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from . import envs
from .config import EngineConfig
from .speculative.config import METHODS, SpeculativeConfig

COMMAND = "python -m peregrine.reference > docs/configuration.md"

# one description per SpeculativeConfig field (tests/test_docs.py checks that the two lists are the same)
SPECULATIVE_HELP = {
    "method": "How drafts are made: " + ", ".join(METHODS) + ". A \"model\" without a method means draft_model.",
    "num_speculative_tokens": "Drafts per request per step, 1 to 15. suffix: the tree depth, at most 15. "
                              "dflash / dspark: the drafter's block. Other methods need it.",
    "prompt_lookup_max": "ngram: the longest n-gram of the request's own text that is matched.",
    "prompt_lookup_min": "ngram: the shortest n-gram that is matched.",
    "model": "draft_model: a preset or model folder with the target's vocabulary. dflash / dspark: the drafter's "
             "folder (z-lab's DFlash or DeepSpec's layout), or peregrine-tiny-dspark.",
    "dummy_weights": "draft_model: seeded random weights, for presets without a checkpoint.",
    "rejection_sample_method": "standard, or synthetic for benchmarks: accepted counts are drawn by chance, so the "
                               "output is not the model's.",
    "synthetic_acceptance_length": "synthetic: the mean tokens a verify step yields, the bonus token counted.",
    "synthetic_acceptance_rates": "synthetic: instead of the length, the chance that each draft position is "
                                  "accepted (non-increasing).",
    "suffix_decoding_max_tree_depth": "suffix: the longest context that is matched.",
    "suffix_decoding_max_cached_requests": "suffix: finished requests whose outputs stay in the global tree.",
    "suffix_decoding_max_spec_factor": "suffix: drafts per matched token.",
    "suffix_decoding_min_token_prob": "suffix: a draft path stops below this probability.",
}


def _cell(text) -> str:
    """Text for one Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`".replace("|", "\\|")


def _json(v) -> str:
    return _code(json.dumps(v))


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _option(a: argparse.Action) -> str:
    flags = ", ".join(a.option_strings)
    if a.nargs == 0:
        return _code(flags)
    meta = a.metavar or ("{" + ",".join(map(str, a.choices)) + "}" if a.choices else a.dest.upper())
    return _code(f"{flags} {meta}")


def _default(a: argparse.Action) -> str:
    if a.nargs == 0:  # a flag: say what it does when given, and the default only where it is on
        return "on" if a.default is True and isinstance(a, argparse._StoreTrueAction) else ""
    if a.default is None or a.default == "":
        return ""
    return _code(str(a.default))


def _help(a: argparse.Action, prog: str) -> str:
    text = a.help or ""
    if "%(" in text:
        text = text % {**vars(a), "prog": prog}
    return _cell(text)


def _options(parser: argparse.ArgumentParser, groups: list[str] | None = None, skip: set[str] = frozenset()):
    rows = []
    for g in parser._action_groups:
        if groups is not None and g.title not in groups:
            continue
        for a in g._group_actions:
            if isinstance(a, argparse._HelpAction) or a.dest in skip:
                continue
            rows.append([_option(a), _default(a), _help(a, parser.prog)])
    return _table(["option", "default", "what it does"], rows)


def _additional() -> list[str]:
    base = EngineConfig()
    rows = []
    for key, values in EngineConfig.ADDITIONAL_KEYS.items():
        shown = " or ".join(_json(v) for v in values) if isinstance(values, tuple) else _cell(values)
        rows.append([_code(key), shown, _json(getattr(base, key)), _cell(EngineConfig.ADDITIONAL_HELP[key])])
    return _table(["key", "values", "default", "what it does"], rows)


def _speculative() -> list[str]:
    rows = []
    for f in dataclasses.fields(SpeculativeConfig):
        if f.default is not dataclasses.MISSING:
            default = _json(f.default)
        else:
            default = "see text" if f.name == "num_speculative_tokens" else "required"
        rows.append([_code(f.name), default, _cell(SPECULATIVE_HELP[f.name])])
    return _table(["field", "default", "what it does"], rows)


def _variables(table: dict) -> list[str]:
    rows = [[_code(name), _cell(v.values), _cell(v.default), _cell(v.help), _code(v.read_in)]
            for name, v in table.items()]
    return _table(["variable", "values", "unset", "what it does", "read in"], rows)


def _set_variables(table: dict) -> list[str]:
    rows = [[_code(name), _code(v.values), _cell(v.help), _code(v.read_in)] for name, v in table.items()]
    return _table(["variable", "value", "what it does", "set in"], rows)


def render() -> str:
    from .cli import build_parser

    top = build_parser()
    serve, generate = _subparser(top, "serve"), _subparser(top, "generate")
    engine_dests = {a.dest for g in serve._action_groups if g.title == "engine" for a in g._group_actions}
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated from the code by `{COMMAND}`.",
        "Do not edit this page by hand: tests/test_docs.py fails when it and the code differ.",
        "Edit the help text, EngineConfig.ADDITIONAL_HELP (peregrine/config.py), peregrine/reference.py or",
        "peregrine/envs.py, then run the command again. -->",
        "",
        "Every setting peregrine takes. They come in four kinds:",
        "",
        "- command-line options of `peregrine serve` and `peregrine generate`",
        "- `--additional-config '{...}'`: more engine options, as one JSON object",
        "- `--speculative-config '{...}'`: speculative decoding, in vLLM's spelling",
        "- environment variables, mostly for measurements",
        "",
        "`peregrine COMMAND --help` prints the same options with their defaults.",
        "The Python API takes the engine options by the same names, for example",
        "`LLM(model=\"peregrine-tiny\", max_model_len=4096, additional_config={...})`.",
        "This page is generated from the code, so it always matches it.",
        "Where to start: [quickstart.md](quickstart.md). When something fails: [troubleshooting.md](troubleshooting.md).",
        "",
        "## Engine options",
        "",
        "`peregrine serve`, `peregrine generate` and `peregrine eval` take these.",
        "",
        *_options(serve, ["engine"]),
        "## Server options",
        "",
        "`peregrine serve` only.",
        "",
        *_options(serve, ["server"]),
        "## `peregrine generate` options",
        "",
        "`peregrine generate` runs one prompt without a server and prints the text and its token timing.",
        "",
        *_options(generate, skip=engine_dests),
        "## `--additional-config` keys",
        "",
        "One JSON object, for example `--additional-config '{\"decode_backend\": \"latency_specialized\"}'`.",
        "An unknown key or a wrong value is an error that names it, before the model loads.",
        "",
        *_additional(),
        "## `--speculative-config` fields",
        "",
        "One JSON object in vLLM's spelling, for example `{\"method\": \"ngram\", \"num_speculative_tokens\": 4}`.",
        "Speculative decoding does not combine with `--tensor-parallel-size` above 1 yet.",
        "",
        *_speculative(),
        "## Environment variables",
        "",
        "### Switches",
        "",
        *_variables(envs.SWITCHES),
        "### A/B switches",
        "",
        "Each is kept only until a queued GPU measurement decides it. `scripts/gpu_pending.sh` names the run.",
        "Removed experiments and their switches: [experiments.md](experiments.md).",
        "",
        *_variables(envs.AB_SWITCHES),
        "### Test switches",
        "",
        "Read by the test suite (`tests/conftest.py`), not by the package.",
        "",
        *_variables(envs.TEST_SWITCHES),
        "### Other variables peregrine reads",
        "",
        *_variables(envs.OTHER),
        "### Variables peregrine sets",
        "",
        "Every tensor-parallel rank sets these before NCCL or CUDA starts: the lent machines need NVLink multicast "
        "off.",
        "",
        *_set_variables(envs.SETS),
    ]
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
