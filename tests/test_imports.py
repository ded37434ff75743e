"""No import circles inside peregrine/, and the layers' rules (read from the source with ast; nothing is imported).

A module's edges are the peregrine modules its imports load: `import a.b` loads a.b, `from X import n`
loads X.n when that is a module file, else X; loading a module also runs its packages' __init__, except
the packages the importer itself sits in (already loading: `from . import sibling` is no circle).
Imports inside functions count as much as those at the top: a late import hides a circle, it does not break
it. `if TYPE_CHECKING:` blocks never run and are skipped."""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in (ROOT / "peregrine").rglob("*.py")}

# package -> the packages none of its modules may import, at the top or in a function: speculative/ sits below
# the engine that imports it (and so below bench/, which drives the engine); kernels never import model code
LAYERS = {
    "peregrine.speculative": ("peregrine.bench", "peregrine.server", "peregrine.cli", "peregrine.eval",
                              "peregrine.train"),
    "peregrine.kernels": ("peregrine.models",),
}


def _imports(node: ast.AST, functions: bool):
    """The import statements under node: those that run at import time, or with functions all of them."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            continue
        elif functions or not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _imports(child, functions)


def _targets(mod: str, stmt: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(stmt, ast.Import):
        return [a.name for a in stmt.names]
    base = mod if MODULES[mod].name == "__init__.py" else mod.rpartition(".")[0]
    for _ in range(stmt.level - 1):
        base = base.rpartition(".")[0]
    src = ".".join(filter(None, [base if stmt.level else "", stmt.module]))
    return [f"{src}.{a.name}" if f"{src}.{a.name}" in MODULES else src for a in stmt.names]


@cache
def graph(functions: bool) -> dict[str, set[str]]:
    g = {}
    for mod, path in MODULES.items():
        own = {mod.rsplit(".", i)[0] for i in range(1, mod.count(".") + 1)}  # the packages mod sits in
        deps = set()
        for stmt in _imports(ast.parse(path.read_text()), functions):
            for t in _targets(mod, stmt):
                parts = t.split(".")
                deps |= {t} | ({".".join(parts[:i]) for i in range(1, len(parts))} - own)
        g[mod] = {d for d in deps if d in MODULES and d != mod}
    return g


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module."""
    reach = {}
    for m in g:
        seen, todo = set(), [m]
        while todo:
            new = g[todo.pop()] - seen
            seen |= new
            todo += new
        reach[m] = seen
    return sorted({tuple(sorted(w for w in reach[m] if m in reach[w])) for m in g if m in reach[m]})


def _within(mod: str, package: str) -> bool:
    return mod == package or mod.startswith(package + ".")


def breaches(g: dict[str, set[str]], layers: dict[str, tuple[str, ...]]) -> list[str]:
    """Each edge from a module of a package in layers to a module of a package that package may not import."""
    return sorted(f"{m} -> {d}" for m, deps in g.items() for pkg, banned in layers.items() if _within(m, pkg)
                  for d in deps if any(_within(d, b) for b in banned))


def _show(found) -> str:
    return "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_find_what_they_look_for():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]
    assert breaches({"peregrine.speculative.x": {"peregrine.bench.y", "peregrine.config"}, "peregrine.bench.y": set()},
                    LAYERS) == ["peregrine.speculative.x -> peregrine.bench.y"]
    assert "peregrine.config" in graph(functions=False)["peregrine.engine.build"]  # the scan sees imports
    late = "peregrine.speculative.draft_model"  # imported inside make_drafter
    assert late in graph(functions=True)["peregrine.speculative.decoder"]
    assert late not in graph(functions=False)["peregrine.speculative.decoder"]


def test_no_import_circles():
    found = circles(graph(functions=True))
    assert not found, "import circles (imports inside functions counted):\n" + _show(found)


def test_layers_import_nothing_above_them():
    found = breaches(graph(functions=True), LAYERS)
    assert not found, "imports against a layer's rule (LAYERS):\n" + "\n".join(found)
