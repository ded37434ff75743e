"""The package as pyproject.toml declares it: what a user gets from `pip install`.

- Every third-party package peregrine/ imports is declared: at import time (a module's top level, a class body)
  in `dependencies`; inside a function or a guarded try also in an extra (gpu, cute), or named in OPTIONAL.
  Read from the source with ast; nothing is imported.
- requirements-cpu.txt (the pinned set CI tests) lies inside pyproject's ranges.
- A clean venv gets the package from pyproject.toml alone (no requirements file), resolved from this machine's
  own package indexes (the file:// ones pip is configured with: offline), then `peregrine --help`,
  `peregrine generate --model peregrine-tiny` and `peregrine serve --help` run in it.
"""
from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# import name -> distribution, for packages not installed here (the gpu extra's fla-core is GPU-only)
KNOWN = {"fla": "fla-core", "cutlass": "nvidia-cutlass-dsl", "nvidia_cutlass_dsl": "nvidia-cutlass-dsl"}
# imported only in a guarded try, never declared: where it is missing the code goes on without it
OPTIONAL = {"nvidia": "the nvidia-* CUDA libraries a CUDA build of torch brings (kernels/cute/launch.py's search path)"}


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(reqs: list[str]) -> set[str]:
    return {_canon(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in reqs}


DEPENDENCIES = _declared(PROJECT["dependencies"])
EXTRAS = {extra: _declared(reqs) for extra, reqs in PROJECT["optional-dependencies"].items()}


def _guarded(node: ast.Try) -> bool:
    """A try one of whose handlers catches a failed import (a bare except, ImportError or a base of it)."""
    return any(h.type is None or re.search(r"\b(ImportError|ModuleNotFoundError|Exception|BaseException)\b",
                                           ast.unparse(h.type)) for h in node.handlers)


def imports(tree: ast.AST):
    """(top-level module name, runs at import time) for each absolute import under tree. `if TYPE_CHECKING:`
    never runs; a function's body runs when called; a guarded try's body may fail without harm."""
    def walk(node, eager):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for a in child.names:
                    yield a.name.split(".")[0], eager
            elif isinstance(child, ast.ImportFrom):
                if child.level == 0:
                    yield child.module.split(".")[0], eager
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, False)
            elif isinstance(child, ast.Try) and _guarded(child):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), False)
                for part in (child.handlers, child.orelse, child.finalbody):
                    for stmt in part:
                        yield from walk(ast.Module(body=[stmt], type_ignores=[]), eager)
            else:
                yield from walk(child, eager)
    yield from walk(tree, True)


@cache
def _providers() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distribution(module: str) -> str | None:
    if module in KNOWN:
        return KNOWN[module]
    dists = _providers().get(module)
    return _canon(dists[0]) if dists else None


def undeclared() -> list[str]:
    """Each third-party import peregrine/ makes that pyproject.toml does not cover, in words."""
    bad = []
    for path in sorted((ROOT / "peregrine").rglob("*.py")):
        for module, eager in imports(ast.parse(path.read_text())):
            if module in sys.stdlib_module_names or module == "peregrine":
                continue
            where = f"{path.relative_to(ROOT)}: {module}"
            if module in OPTIONAL and not eager:
                continue
            dist = distribution(module)
            if dist is None:
                bad.append(f"{where} (no installed distribution provides it: declare it, or add it to KNOWN)")
            elif dist in DEPENDENCIES:
                continue
            elif eager:
                bad.append(f"{where} at import time, but {dist} is not in `dependencies`"
                           + (f" (only in the {extra} extra)" if (extra := next((e for e, d in EXTRAS.items() if dist in d), None)) else ""))
            elif not any(dist in d for d in EXTRAS.values()):
                bad.append(f"{where} ({dist}) is in neither `dependencies` nor an extra")
    return bad


def test_the_scan_tells_import_time_from_late():
    tree = ast.parse("import a.b\nfrom c import d\nfrom . import e\nclass K:\n    import f\n"
                     "def g():\n    import h\ntry:\n    import i\nexcept ImportError:\n    import j\n"
                     "if TYPE_CHECKING:\n    import k\nif x:\n    import m\n")
    assert sorted(imports(tree)) == [("a", True), ("c", True), ("f", True), ("h", False), ("i", False),
                                     ("j", True), ("m", True)]


def test_every_import_is_declared():
    bad = undeclared()
    assert not bad, "third-party imports pyproject.toml does not declare:\n" + "\n".join(bad)


def test_the_scan_finds_an_undeclared_import(monkeypatch):
    """The check fails where it should: httpx taken out of `dependencies` (as before this test) is caught at
    bench/serve.py's and bench/soak.py's top level."""
    monkeypatch.setattr(sys.modules[__name__], "DEPENDENCIES", DEPENDENCIES - {"httpx"})
    bad = undeclared()
    assert any(b.startswith("peregrine/bench/soak.py: httpx at import time") for b in bad), bad


def pins() -> dict:
    """requirements-cpu.txt: distribution -> the Version CI installs and tests."""
    from packaging.version import Version
    out = {}
    for line in (ROOT / "requirements-cpu.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, _, version = line.partition("==")
            out[_canon(name)] = Version(version)
    return out


# the packages whose minor releases the kernels and the interpreter have broken on (triton 3.9 with numpy 2.3 failed
# a kernel test and the sm_90 compile check): a clean install must get the minor series CI tests
SAME_MINOR = ("torch", "triton", "numpy")


def test_the_tested_pins_lie_inside_the_declared_ranges():
    from packaging.requirements import Requirement
    pins_ = pins()
    reqs = [Requirement(r) for r in PROJECT["dependencies"] + sum(PROJECT["optional-dependencies"].values(), [])]
    outside = [f"{r} (pinned {pins_[_canon(r.name)]})" for r in reqs
               if _canon(r.name) in pins_ and not r.specifier.contains(pins_[_canon(r.name)], prereleases=True)]
    assert not outside, "requirements-cpu.txt pins versions pyproject.toml does not admit: " + ", ".join(outside)
    missing = sorted(DEPENDENCIES - set(pins_))
    assert not missing, f"dependencies CI does not pin (so does not test a known version of): {missing}"


def local_indexes() -> list[str] | None:
    """pip's arguments that resolve from the file:// package indexes pip is configured with on this machine
    (its extra-index-url and index-url) and from them alone: an install that needs no network. None when pip
    knows no local index."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    urls = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.rsplit(".", 1)[-1] in ("index-url", "extra-index-url"):
            urls += [u for u in value.strip().strip("'\"").split() if u.startswith("file:") and u not in urls]
    if not urls:
        return None
    return ["--index-url", urls[0], *[a for u in urls[1:] for a in ("--extra-index-url", u)]]


# Run in the clean venv: `peregrine ARGS` with every import statement peregrine's own modules execute recorded,
# then the server's app module imported; writes the third-party imports whose distribution is not among the
# installed package's declared requirements (its metadata, extras left out) to the file named by argv[1].
AUDIT = """
import builtins, importlib.metadata as md, json, re, sys
seen, real = set(), builtins.__import__
def hook(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and globals and str(globals.get("__name__", "")).startswith("peregrine"):
        seen.add((name.split(".")[0], globals["__name__"]))
    return real(name, globals, locals, fromlist, level)
builtins.__import__ = hook
from peregrine.cli import main
rc = main(sys.argv[2:])
import peregrine.server.app
canon = lambda n: re.sub(r"[-_.]+", "-", n).lower()
declared = {canon(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in md.requires("peregrine") or [] if "extra ==" not in r}
providers = md.packages_distributions()
bad = sorted(f"{importer}: {name}" for name, importer in seen if name not in sys.stdlib_module_names
             and name != "peregrine" and not {canon(d) for d in providers.get(name, [])} & declared)
json.dump({"undeclared": bad, "imports": sorted({n for n, _ in seen})}, open(sys.argv[1], "w"))
sys.exit(rc)
"""


def test_clean_venv_from_pyproject_runs_the_cli(tmp_path):
    """The documented install in a venv of its own: pyproject.toml and peregrine/ only (copied, so nothing is
    written into the work tree), every dependency resolved by pip from what pyproject.toml declares. Each
    command must exit 0 without a traceback, and every import peregrine makes on their way must be of a declared
    requirement, not of one that some dependency happens to bring (httpx came with huggingface_hub 1.x through
    tokenizers, not with 2.x). About 30 s on the CPU machine (its torch wheel lies on its disk)."""
    index = local_indexes()
    if index is None:
        pytest.skip("pip knows no local (file://) package index here: the install would download torch")
    src, env_dir = tmp_path / "src", tmp_path / "venv"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copytree(ROOT / "peregrine", src / "peregrine",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    # the user's environment, less what points into this test's own venv or sets up the tests' kernels
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TRITON_INTERPRET") and not k.startswith("PYTEST")}
    env.update(PIP_NO_INPUT="1", OMP_NUM_THREADS="1")
    try:
        subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, env=env)
        t0 = time.monotonic()
        r = subprocess.run([str(env_dir / "bin/python"), "-m", "pip", "install", "-q", "--no-compile", *index, str(src)],
                           capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, f"pip install failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        print(f"clean install: {time.monotonic() - t0:.0f} s")
        from packaging.version import Version
        r = subprocess.run([str(env_dir / "bin/python"), "-c", "import importlib.metadata as md; "
                            f"print(*(md.version(d) for d in {SAME_MINOR!r}))"], capture_output=True, text=True, env=env)
        got = dict(zip(SAME_MINOR, map(Version, r.stdout.split())))
        tested = pins()
        untested = [f"{d} {got[d]} (CI tests {tested[d]})" for d in SAME_MINOR if got[d].release[:2] != tested[d].release[:2]]
        assert not untested, "the declared ranges let a clean install take untested releases: " + ", ".join(untested)
        exe = str(env_dir / "bin/peregrine")
        for args, want in [(["--help"], "generate"),
                           (["generate", "--model", "peregrine-tiny", "--prompt", "rev:peregrine|"], "enirgerep"),
                           (["serve", "--help"], "--max-num-seqs"),
                           (["bench", "serve", "--help"], "--max-concurrency")]:
            r = subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
            said = f"peregrine {' '.join(args)} (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
            assert r.returncode == 0 and "Traceback" not in r.stderr, said
            assert (r.stdout.splitlines()[0] == want) if args[0] == "generate" else (want in r.stdout), said
        (tmp_path / "audit.py").write_text(AUDIT)
        r = subprocess.run([str(env_dir / "bin/python"), str(tmp_path / "audit.py"), str(tmp_path / "audit.json"),
                            "generate", "--model", "peregrine-tiny", "--prompt", "rev:peregrine|", "--quiet"],
                           capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
        assert r.returncode == 0 and r.stdout.startswith("enirgerep"), f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        audit = json.loads((tmp_path / "audit.json").read_text())
        assert {"torch", "fastapi"} <= set(audit["imports"]), audit  # the hook saw peregrine's imports
        assert not audit["undeclared"], "imports of packages the installed peregrine does not require: " + \
            ", ".join(audit["undeclared"])
    finally:
        shutil.rmtree(env_dir, ignore_errors=True)  # 1.6 GB, mostly torch
