"""Imports show the call graph: no import cycle between the project's files (counting imports inside functions,
which hide a cycle without removing it), and the project's own modules imported at module top, except at the
listed worker boundaries (each with its reason).

How to see the graph yourself: `python -m pytest tests/unit/test_import_graph.py -q` prints nothing when it
holds; on failure it names the files of the cycle or the function that imports lazily."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kimi_pipeline", "tasks", "flows")
# (file, function): the only places a function imports one of this project's modules, and why.
LAZY_BOUNDARIES = {
    # Prefect reads its settings from the environment the CLI sets first; flows/ is the Prefect side
    ("kimi_pipeline/cli.py", "run"): "flows.kimi",
    ("kimi_pipeline/cli.py", "serve"): "flows.serve",
    # megatron's checkpoint writer re-imports the rank's `__main__` in a helper process: the weight-job entry stays
    # light and imports the rank body of the job's kind here
    ("kimi_pipeline/weightjobs/rank.py", "rank_body"): "the rank bodies",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for d in PACKAGES for p in sorted((ROOT / d).rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for n in ast.walk(node))
    return out


def _imports(path: Path, module: str, type_checking: bool = False) -> list[tuple[ast.stmt, list[str], str | None]]:
    """(node, imported dotted names, enclosing function or None) for every import (those under TYPE_CHECKING only
    when `type_checking`)."""
    tree = ast.parse(path.read_text())
    skip = set() if type_checking else _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    owner: dict[int, str] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for n in ast.walk(fn):
                owner.setdefault(id(n), fn.name) if n is not fn else None
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        out.append((node, names, owner.get(id(node))))
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    modules = _sources()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for _, names, _ in _imports(path, module):
            graph[module].update(t for t in (_resolve(n, modules) for n in names) if t and t != module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def lazy_own_imports() -> list[str]:
    """`file:line function: import` for every function-level import of this project's modules outside the
    listed boundaries."""
    bad = []
    for module, path in _sources().items():
        rel = str(path.relative_to(ROOT))
        for node, names, function in _imports(path, module):
            if function is None or not any(n.split(".")[0] in PACKAGES for n in names):
                continue
            if (rel, function) not in LAZY_BOUNDARIES:
                bad.append(f"{rel}:{node.lineno} {function}: {ast.unparse(node)}")
    return bad


def test_no_import_cycle_between_files():
    found = cycles(import_graph())
    assert not found, "import cycles (function-level imports included):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_own_modules_are_imported_at_module_top():
    bad = lazy_own_imports()
    assert not bad, ("imports of this project's modules inside functions (move them to the top, or add a worker "
                     "boundary with its reason):\n" + "\n".join(bad))


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def _package(module: str) -> str:
    """`kimi_pipeline.<package>` (a top-level module counts as its own package), `tasks`, `flows`."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "kimi_pipeline" and len(parts) > 1 else parts[0]


def package_graph() -> dict[str, set[str]]:
    """Which package imports which, TYPE_CHECKING imports included (a type is a dependency a reader follows)."""
    modules = _sources()
    graph: dict[str, set[str]] = {_package(m): set() for m in modules}
    for module, path in modules.items():
        for _, names, _ in _imports(path, module, type_checking=True):
            graph[_package(module)].update(
                _package(t) for t in (_resolve(n, modules) for n in names) if t and _package(t) != _package(module))
    return graph


def test_packages_stand_in_floors_no_import_runs_back_up():
    """No package imports one that imports it back, directly or around a circle: the packages stand in floors and
    every import runs down (so `python -m pytest tests/unit/test_import_graph.py` is the count of imports running
    back up: zero). A type-only import counts: it is a dependency a reader follows."""
    found = cycles(package_graph())
    assert not found, "packages importing each other (directly or around a circle):\n" + "\n".join(
        " <-> ".join(c) for c in found)


# The HF checkpoint vocabulary stands on the ground floor: every package may learn a name, a format or a config
# from it without importing a job.
GROUND = {"kimi_pipeline.hf": {"kimi_pipeline.recipes", "kimi_pipeline.errors", "kimi_pipeline.util"}}


def test_the_hf_vocabulary_imports_only_recipes_errors_and_util():
    graph = package_graph()
    for package, allowed in GROUND.items():
        extra = sorted(graph[package] - allowed)
        assert not extra, f"{package} imports {extra}: only {sorted(allowed)}"
