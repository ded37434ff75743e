"""The user-facing text: the README is a short guide whose every link exists, every document the package's
help text cites is in the repository, and what the README says the embedded model answers, it answers."""
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
