"""No import circles inside peregrine/ (read from the source with ast; nothing is imported).

A module's edges are the peregrine modules its imports load: `import a.b` loads a.b, `from X import n`
loads X.n when that is a module file, else X; loading a module also runs its packages' __init__, except
the packages the importer itself sits in (already loading: `from . import sibling` is no circle).
`if TYPE_CHECKING:` blocks never run and are skipped."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in (ROOT / "peregrine").rglob("*.py")}

# circles once closed through function-level imports, broken by giving the shared piece its own module
# (peregrine/engine_args.py, server/limits.py, errors.py, decode/capture.py, engine/parts.py, parallel/slicing.py)
BROKEN = [
    {"peregrine.cli", "peregrine.eval", "peregrine.server.cli", "peregrine.server.app"},
    {"peregrine.config", "peregrine.generation_config"},
    {"peregrine.decode.prefill_graphs", "peregrine.decode.standard"},
    {"peregrine.engine.build", "peregrine.parallel.launch", "peregrine.parallel.worker"},
    {"peregrine.models.kimi", "peregrine.models.mla", "peregrine.models.moe", "peregrine.parallel.shard"},
    {"peregrine.kernels.moe_mxfp4", "peregrine.kernels.moe_mxfp4_v3", "peregrine.models.mxfp4"},  # kernels/mxfp4_format.py
]


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


def _show(found) -> str:
    return "\n".join(" <-> ".join(c) for c in found)


def test_circles_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]
    assert "peregrine.config" in graph(functions=False)["peregrine.engine.build"]  # the scan sees imports


def test_no_import_circles_among_module_level_imports():
    found = circles(graph(functions=False))
    assert not found, "import circles among module-level imports:\n" + _show(found)


def test_broken_circles_stay_broken_counting_function_level_imports():
    found = [c for c in circles(graph(functions=True)) if any(len(b & set(c)) > 1 for b in BROKEN)]
    assert not found, "import circles (function-level imports counted) back among modules once untangled:\n" + _show(found)
