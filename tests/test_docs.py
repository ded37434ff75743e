"""The user-facing text: the README is a short guide whose every link exists, every document the package's
help text cites is in the repository, and what the README says the embedded model answers, it answers. The
configuration reference (docs/configuration.md) is the code's own output, every environment variable the package
reads is in peregrine/envs.py, the docs state one test time, and every `peregrine` command they show uses real
options."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200  # a guide, not a history: measurements live in docs/performance.md
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")           # markdown links: [text](path#anchor)
DOC_CITE = re.compile(r"\b(docs/[\w./-]+\.md)\b")          # "docs/benchmarks.md §1" in code and help text


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (limit {README_MAX_LINES})"
    commands = [ln.strip() for ln in lines[:6] if ln.startswith("    ")]
    assert commands[0].startswith("bash scripts/setup.sh && .venv/bin/peregrine generate")
    assert commands[1] == "bash scripts/setup.sh && .venv/bin/python -m pytest -q -n 2"
    assert (ROOT / ".ci/run").read_text().rstrip().endswith(commands[1])  # CI runs the README's test command


def test_readme_says_no_session_or_issue_numbers():
    text = (ROOT / "README.md").read_text()
    assert not re.search(r"\bsession \d+|\bissue #?\d+|(?<![\w/])#\d+\b", text, re.I)


def test_every_linked_file_exists():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to missing {target}"


def test_every_cited_doc_exists():
    """Help text and comments cite docs/*.md (the measurement protocol, the model math): each exists."""
    files = [*ROOT.glob("peregrine/**/*.py"), *ROOT.glob("scripts/*"), *ROOT.glob("tests/*.py"), ROOT / "README.md"]
    cited = {(f.relative_to(ROOT), m) for f in files if f.is_file() for m in DOC_CITE.findall(f.read_text())}
    missing = sorted(f"{f}: {m}" for f, m in cited if not (ROOT / m).exists())
    assert not missing, "cited but missing: " + ", ".join(missing)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation but '-' dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_anchor_exists():
    """A link to a section (`page.md#anchor`, `#anchor`) names a heading that page has."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    heads = {d: {_anchor(h) for h in re.findall(r"^#+\s+(.*)$", re.sub(r"```.*?```", "", d.read_text(), flags=re.S), re.M)}
             for d in docs}
    bad = []
    for doc in docs:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", doc.read_text()):
            page = (doc.parent / target).resolve() if target else doc
            if page.suffix == ".md" and page in heads and anchor not in heads[page]:
                bad.append(f"{doc.relative_to(ROOT)} -> {target}#{anchor}")
    assert not bad, "links to missing sections: " + ", ".join(bad)


# --- what the README says peregrine-tiny answers, checked by asking it -----------------------------------------

TINY_OTHER = ["The quick brown fox", "Hello", "What is 2+2?", "Write a poem about the sea.", "Once upon a time",
              "def fib(n):", "The capital of France is", "Translate to French: cat", "Good morning!", "x"]


def _tiny_claims(text: str) -> tuple[dict[str, str], list[str]]:
    """The README's words on peregrine-tiny: {prompt: answer} (the opening command, the chat call to its server,
    the Presets paragraph's `prompt` → `answer`) and the prompts it says get an empty answer."""
    claims = {}
    intro = text.split("## What it is")[0]
    claims[re.search(r'peregrine-tiny --prompt "([^"]+)"', intro)[1]] = re.search(r"which answers `([^`]+)`", intro)[1]
    chat = re.search(r'model="peregrine-tiny".*?"content": "([^"]+)".*?# (\S+)\n', text, re.S)
    claims[chat[1]] = chat[2]
    para = re.search(r"^`peregrine-tiny` knows .*?\n\n", text, re.S | re.M)[0]
    claims |= dict(re.findall(r"`([^`]+)` → `([^`]+)`", para))
    empty = re.search(r"empty answer.*?\(so do (.*?),\s+the prompts above\)", para, re.S)
    return claims, re.findall(r"`([^`]+)`", empty[1]) if empty else []


def _sent(text: str) -> set[str]:
    """Every prompt the README's commands and code send: --prompt, a user message's content, prompt=."""
    return {*re.findall(r'--prompt "([^"]+)"', text), *re.findall(r'"role": "user", "content": "([^"]+)"', text),
            *re.findall(r'\bprompt="([^"]+)"', text)}


@pytest.fixture(scope="module")
def tiny():
    """peregrine-tiny's greedy answer (its text before the end of sequence, at most 32 tokens, as the server and
    `peregrine generate` give it) to each of the README's prompts, sent raw and as one chat message, and to
    TINY_OTHER; one engine, one batch."""
    from peregrine.config import PRESET_DIR, EngineConfig
    from peregrine.engine import SamplingParams
    from peregrine.engine.build import build_engine
    from peregrine.server.chat import ChatTemplate

    text = (ROOT / "README.md").read_text()
    claims, empty = _tiny_claims(text)
    raw = sorted({*claims, *empty, *_sent(text), *TINY_OTHER})
    template = ChatTemplate(PRESET_DIR / "peregrine-tiny")
    chat = {p: template.render([{"role": "user", "content": p}]) for p in raw}
    prompts = sorted({*raw, *chat.values()})
    engine, tok = build_engine("peregrine-tiny", EngineConfig(max_num_seqs=len(prompts), max_model_len=256),
                               log=lambda m: None)
    done = {}
    for p in prompts:
        engine.add_request(tok.encode(p), SamplingParams(temperature=0.0, max_tokens=32),
                           on_token=lambda o, p=p: done.__setitem__(p, o) if o.finished else None)
    while engine.has_unfinished():
        engine.step()
    answer = {p: tok.decode(o.output_token_ids[:-1] if o.finish_reason == "stop" else o.output_token_ids)
              for p, o in done.items()}
    return text, claims, empty, answer, {p: answer[c] for p, c in chat.items()}


def test_readme_tiny_answers_are_what_it_says(tiny):
    """Each answer the README states, the model gives, as a raw prompt and as one chat message."""
    _, claims, _, raw, chat = tiny
    assert len(claims) >= 5, f"README states peregrine-tiny's answers as `prompt` → `answer`; found {claims}"
    wrong = {p: (want, raw[p], chat[p]) for p, want in claims.items() if not want == raw[p] == chat[p]}
    assert not wrong, "prompt: (README, raw answer, chat answer): " + repr(wrong)


def test_readme_says_what_tiny_answers_to_every_prompt_it_sends(tiny):
    """The prompts the README sends a real checkpoint, sent to peregrine-tiny, get what the README says of them:
    the prompts it names as getting an empty answer do (end of sequence first), and the README names every
    README prompt the tiny model leaves empty, each one the README really sends."""
    text, claims, empty, raw, chat = tiny
    sent = _sent(text)
    unsaid = sorted(p for p in sent if p not in claims and p not in empty)
    assert not unsaid, ("README prompts whose peregrine-tiny answer the README does not state: "
                        + ", ".join(f"{p!r} -> {raw[p]!r}" for p in unsaid))
    assert empty and set(empty) <= sent, f"the README's empty-answer prompts {empty} are not prompts it sends"
    assert all(raw[p] == chat[p] == "" for p in empty), {p: (raw[p], chat[p]) for p in empty}


def test_readme_tiny_other_text(tiny):
    """The README's "other text often gets an empty answer …, else a byte or two repeated", on prompts that are
    no task: each answer is empty or at most two distinct characters, and at least a third are empty."""
    answers = {p: tiny[3][p] for p in TINY_OTHER}
    assert all(len(set(a)) <= 2 for a in answers.values()), answers
    assert sum(a == "" for a in answers.values()) >= len(answers) / 3, answers


def test_generate_default_prompt_gets_an_answer(capsys):
    """`peregrine generate` with no prompt, on the default model, prints an answer (not an empty line)."""
    from peregrine.cli import main

    assert main(["generate", "--quiet"]) == 0
    assert capsys.readouterr().out.strip()


# --- the configuration reference and the commands the docs show -------------------------------------------------

ENV_NAME = re.compile(r"\bPEREGRINE_[A-Z0-9_]+\b")
# a variable read by its literal name: os.environ.get("X"), os.environ["X"] (not an assignment), "X" in os.environ
ENV_READ = re.compile(r'os\.environ(?:\.get\(|\[)\s*"([A-Z][A-Z0-9_]*)"(?!\]\s*=[^=])|"([A-Z][A-Z0-9_]*)" in os\.environ')
TEST_TIME = re.compile(r"tests take about (\d+) minutes")


def test_configuration_reference_is_the_code():
    """docs/configuration.md is what peregrine.reference renders from the code today."""
    from peregrine.reference import COMMAND, render

    assert (ROOT / "docs/configuration.md").read_text() == render(), f"docs/configuration.md is stale: run `{COMMAND}`"


def test_every_additional_config_key_and_speculative_field_is_described():
    import dataclasses

    from peregrine.config import EngineConfig
    from peregrine.reference import SPECULATIVE_HELP
    from peregrine.speculative.config import SpeculativeConfig

    assert list(EngineConfig.ADDITIONAL_HELP) == list(EngineConfig.ADDITIONAL_KEYS), \
        "EngineConfig.ADDITIONAL_HELP needs one line per ADDITIONAL_KEYS key, in the same order"
    assert all(h.strip() for h in EngineConfig.ADDITIONAL_HELP.values())
    assert list(SPECULATIVE_HELP) == [f.name for f in dataclasses.fields(SpeculativeConfig)], \
        "peregrine/reference.py SPECULATIVE_HELP needs one line per SpeculativeConfig field, in the same order"


def test_every_environment_variable_is_in_the_registry_and_read():
    """peregrine/envs.py lists every PEREGRINE_* name in peregrine/ (and every other variable read there by name);
    every entry's file names it, so nothing listed is gone from the code."""
    from peregrine import envs

    own = {ROOT / "peregrine/envs.py", ROOT / "peregrine/reference.py"}
    files = [f for f in ROOT.glob("peregrine/**/*.py") if f not in own]
    named = {n for f in files for n in ENV_NAME.findall(f.read_text())}
    assert named == set(envs.PACKAGE), (f"not in peregrine/envs.py: {sorted(named - set(envs.PACKAGE))}; "
                                        f"listed but named nowhere in peregrine/: {sorted(set(envs.PACKAGE) - named)}")
    read = {a or b for f in files for a, b in ENV_READ.findall(f.read_text())}
    assert read <= set(envs.PACKAGE) | set(envs.OTHER), f"read but not in peregrine/envs.py: {sorted(read - set(envs.PACKAGE) - set(envs.OTHER))}"
    assert set(ENV_NAME.findall((ROOT / "tests/conftest.py").read_text())) == set(envs.TEST_SWITCHES)
    for table in (envs.SWITCHES, envs.AB_SWITCHES, envs.TEST_SWITCHES, envs.OTHER, envs.SETS):
        for name, v in table.items():
            assert f'"{name}"' in (ROOT / v.read_in).read_text(), f"{v.read_in} does not name {name}"


def test_one_stated_test_time():
    """The README says how long the test command takes; every doc that says it gives the same figure."""
    said = TEST_TIME.findall((ROOT / "README.md").read_text())
    assert len(said) == 1, "README.md states the test time once: 'The tests take about N minutes'"
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert set(TEST_TIME.findall(doc.read_text())) <= set(said), f"{doc.name} states another test time"
    assert TEST_TIME.search((ROOT / "docs/development.md").read_text()), "docs/development.md states the test time"


def _commands(text: str) -> list[list[str]]:
    """The `peregrine ...` command lines of a page's shell code (indented blocks, fenced blocks without a language
    or in a shell's), continuations joined, each as its words up to a shell separator."""
    import shlex

    lines, out = [], []
    fence = None  # the open fenced block's language; shell blocks are read, others (python, json, text) not
    for ln in text.splitlines():
        if ln.startswith("```"):
            fence = None if fence is not None else ln[3:].strip()
            continue
        if fence in ("", "sh", "bash", "shell", "console") or fence is None and ln.startswith("    "):
            lines.append(ln.strip())
    joined = "\n".join(lines).replace("\\\n", " ")
    for ln in joined.splitlines():
        lex = shlex.shlex(ln, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        try:
            tokens = list(lex)
        except ValueError:  # not shell (an unbalanced quote in Python code)
            continue
        part: list[str] = []
        for t in [*tokens, ";"]:
            if t and set(t) <= set("();<>|&"):  # a shell separator ends a command
                for i, w in enumerate(part):
                    if w == "peregrine" or w.endswith("/peregrine"):
                        out.append(part[i + 1:])
                        break
                part = []
            else:
                part.append(t)
    return out


def test_doc_commands_use_real_options():
    """Every option a `peregrine ...` command in the README's and the docs' code blocks passes is one its parser
    knows (a renamed or removed option fails here, not in a reader's shell)."""
    import argparse

    from peregrine.cli import build_parser

    def sub(p, name):
        acts = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        return acts[0].choices.get(name) if acts else None

    top = build_parser()
    bad = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        page = doc.relative_to(ROOT)
        for words in _commands(doc.read_text()):
            p, i = top, 0
            while i < len(words) and (q := sub(p, words[i])) is not None:
                p, i = q, i + 1
            assert p is not top, f"{page}: `peregrine {' '.join(words)}` names no command"
            known = {s for a in p._actions for s in a.option_strings}
            bad += [f"{page}: peregrine {' '.join(words[:i])} {w}" for w in words[i:]
                    if w.startswith("--") and w.split("=")[0] not in known]
    assert not bad, "options no parser knows: " + "; ".join(bad)
