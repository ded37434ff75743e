"""The user-facing text: the README is a short guide whose every link exists, and every document the
package's help text cites is in the repository."""
from __future__ import annotations

import re
from pathlib import Path

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
