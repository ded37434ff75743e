"""The command line as a user meets it: every mistake in an argument is one "error:" line naming it, before
any model is built; every option explains itself; --help names the presets."""
from __future__ import annotations

import argparse
import re

import pytest

from peregrine import cli
from peregrine.config import preset_names


@pytest.mark.parametrize("argv,names", [
    (["generate", "--max-tokens", "-1"], "max-tokens"),
    (["generate", "--max-tokens", "0"], "max-tokens"),
    (["generate", "--top-p", "2"], "top-p"),
    (["generate", "--top-k", "-5"], "top-k"),
    (["generate", "--temperature", "-1"], "temperature"),
    (["generate", "--prompt", ""], "prompt"),
    (["generate", "--prompt-ids", "1,x"], "prompt-ids"),
    (["generate", "--prompt-ids", "1,999"], "prompt-ids"),
    (["generate", "--model", "no-such-model"], "no-such-model"),
    (["generate", "--max-num-seqs", "0"], "max-num-seqs"),
    (["generate", "--additional-config", "{bad json"], "additional-config"),
    (["generate", "--additional-config", '{"decode_backend": "fast"}'], "decode_backend"),
    (["serve", "--port", "70000"], "port"),
    (["serve", "--max-queue", "-1"], "max-queue"),
    (["serve", "--drain-timeout", "-1"], "drain-timeout"),
    (["eval", "--task", "add", "--n", "0"], "--n"),
])
def test_a_bad_argument_is_one_error_line_before_the_model_is_built(no_build, capsys, argv, names):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and names.replace("-", "_") in err.replace("-", "_"), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def _actions(parser: argparse.ArgumentParser, path: str = "peregrine"):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _actions(sub, f"{path} {name}")
        elif not isinstance(a, argparse._HelpAction):
            yield path, a


def test_every_option_has_help_text():
    missing = [f"{path} {'/'.join(a.option_strings) or a.dest}" for path, a in _actions(cli.build_parser())
               if not (a.help or "").strip()]
    assert not missing, "options without help: " + ", ".join(missing)


def test_help_names_the_presets(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    top = capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    gen = re.sub(r"-\n\s*", "-", capsys.readouterr().out)  # argparse wraps long help lines at hyphens
    for name in preset_names():
        assert name in top and name in gen, name
