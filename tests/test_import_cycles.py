"""No import cycle between shoal's modules, counting imports made inside functions: a cycle kept
alive by a function-local import is still a cycle (two modules that cannot be read apart)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("engine", "actors", "cluster", "client", "deploy")


def _module_files() -> dict[str, Path]:
    """`shoal.<layer>.<...>` name → file, for every module of every layer."""
    files: dict[str, Path] = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            parts = ["shoal", *path.relative_to(ROOT).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of a dotted name that is one of `modules`."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the modules it imports anywhere in its body (top level, functions, TYPE_CHECKING
    blocks excluded: those are not run). `from pkg import sub` counts `pkg.sub` when it is a
    module; importing a package's `__init__` counts as importing it."""
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = {
            id(child)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body
            for child in ast.walk(stmt)
        }
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved and resolved != name:
                    edges.add(resolved)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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


def test_no_module_cycle_counting_function_local_imports() -> None:
    files = _module_files()
    found = cycles(import_graph(files))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_finder_sees_a_cycle_kept_alive_by_a_local_import(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import shoal.engine.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from shoal.engine import a\n")
    (tmp_path / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import shoal.engine.a\n"
    )
    files = {f"shoal.engine.{p.stem}": p for p in sorted(tmp_path.glob("*.py"))}
    graph = import_graph(files)
    assert graph["shoal.engine.c"] == set()
    assert cycles(graph) == [["shoal.engine.a", "shoal.engine.b"]]
