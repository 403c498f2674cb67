"""The source's shape, measured with `ast` and held to the numbers below from now on.

Four measures over the source layers (engine, actors, cluster, client, deploy):

- functions longer than `MAX_FUNCTION_LINES`, docstrings not counted (a nested function counts
  in its own right and inside its parent);
- classes with more than `MAX_OWN_METHODS` methods of their own (inherited ones not counted);
- modules longer than `MAX_MODULE_LINES`;
- in the client family, the methods defined on more than one level of the class chain.

`python -m tests.test_code_shape` prints every offender and the totals.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("engine", "actors", "cluster", "client", "deploy")

MAX_FUNCTION_LINES = 60
MAX_OWN_METHODS = 20
MAX_MODULE_LINES = 500
# The client family: the seed's chain and its blocking sibling.
CLIENT_FAMILY = (
    "MPClient",
    "SyncMPClient",
    "AsyncMPClient",
    "DPAsyncMPClient",
    "DPLBAsyncMPClient",
)

# What the tree may hold at most.
MAX_LONG_FUNCTIONS = 5
MAX_BIG_CLASSES = 3
MAX_OVERRIDES = 7


@dataclass(frozen=True)
class Finding:
    where: str  # path:line
    name: str
    size: int


def _sources(root: Path = ROOT) -> list[Path]:
    return [p for layer in LAYERS for p in sorted((root / layer).rglob("*.py"))]


def _docstring_lines(node: ast.AST) -> int:
    body = getattr(node, "body", None)
    if not body:
        return 0
    first = body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        assert first.end_lineno is not None
        return first.end_lineno - first.lineno + 1
    return 0


def function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines from its `def` (decorators excluded) to its end, less its docstring."""
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1 - _docstring_lines(node)


def long_functions(paths: list[Path], limit: int = MAX_FUNCTION_LINES) -> list[Finding]:
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = function_lines(node)
                if size > limit:
                    found.append(Finding(f"{_rel(path)}:{node.lineno}", node.name, size))
    return sorted(found, key=lambda f: -f.size)


def big_classes(paths: list[Path], limit: int = MAX_OWN_METHODS) -> list[Finding]:
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                size = len(_own_methods(node))
                if size > limit:
                    found.append(Finding(f"{_rel(path)}:{node.lineno}", node.name, size))
    return sorted(found, key=lambda f: -f.size)


def long_modules(paths: list[Path], limit: int = MAX_MODULE_LINES) -> list[Finding]:
    found = []
    for path in paths:
        size = len(path.read_text().splitlines())
        if size > limit:
            found.append(Finding(_rel(path), path.stem, size))
    return sorted(found, key=lambda f: -f.size)


def client_overrides(paths: list[Path], family: tuple[str, ...] = CLIENT_FAMILY) -> list[str]:
    """The method names defined on more than one level of the client family's chain: each
    class's own methods that one of its ancestors (in the tree) defines too."""
    classes: dict[str, ast.ClassDef] = {}
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, node)
    names: set[str] = set()
    for name in family:
        node = classes.get(name)
        if node is None:
            continue
        own = _own_methods(node)
        for ancestor in _ancestors(node, classes):
            names |= own & _own_methods(ancestor)
    return sorted(names)


def _ancestors(node: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> list[ast.ClassDef]:
    found: list[ast.ClassDef] = []
    todo = [b.id for b in node.bases if isinstance(b, ast.Name)]
    while todo:
        parent = classes.get(todo.pop())
        if parent is not None and parent not in found:
            found.append(parent)
            todo.extend(b.id for b in parent.bases if isinstance(b, ast.Name))
    return found


def _own_methods(node: ast.ClassDef) -> set[str]:
    return {
        child.name
        for child in node.body
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# --- the limits --------------------------------------------------------------------------------


def test_few_long_functions() -> None:
    found = long_functions(_sources())
    assert len(found) <= MAX_LONG_FUNCTIONS, _listing(found)


def test_few_big_classes() -> None:
    found = big_classes(_sources())
    assert len(found) <= MAX_BIG_CLASSES, _listing(found)


def test_no_long_module() -> None:
    found = long_modules(_sources())
    assert not found, _listing(found)


def test_client_family_overrides_few_methods() -> None:
    found = client_overrides(_sources())
    assert len(found) <= MAX_OVERRIDES, found


def _listing(found: list[Finding]) -> str:
    return "\n".join(f"{f.where} {f.name}: {f.size}" for f in found)


# --- the measures measure ----------------------------------------------------------------------


def test_the_measures_count_what_they_say(tmp_path: Path) -> None:
    source = tmp_path / "shape.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    methods = "\n".join(f"    def m{i}(self): ...\n" for i in range(21))
    # 60 lines but for its docstring (not counted); 62 lines with no docstring.
    source.write_text(
        f'def documented():\n    """Doc\n    string."""\n{body[: body.rindex(chr(10))]}\n\n'
        f"def undocumented():\n{body}\n    return 1\n\n"
        f"class Big:\n{methods}\n"
        "class A:\n    def f(self): ...\n    def g(self): ...\n"
        "class B(A):\n    def f(self): ...\n"
        "class C(B):\n    def g(self): ...\n    def h(self): ...\n"
    )
    assert [(f.name, f.size) for f in long_functions([source])] == [("undocumented", 62)]
    assert [(f.name, f.size) for f in big_classes([source])] == [("Big", 21)]
    assert long_modules([source], limit=len(source.read_text().splitlines()) - 1)
    assert client_overrides([source], ("A", "B", "C")) == ["f", "g"]


if __name__ == "__main__":
    sources = _sources()
    for title, findings in (
        (f"functions over {MAX_FUNCTION_LINES} lines", long_functions(sources)),
        (f"classes over {MAX_OWN_METHODS} methods", big_classes(sources)),
        (f"modules over {MAX_MODULE_LINES} lines", long_modules(sources)),
    ):
        print(f"{title}: {len(findings)}")
        for f in findings:
            print(f"  {f.where} {f.name}: {f.size}")
    overrides = client_overrides(sources)
    print(f"client methods defined on more than one level: {len(overrides)}")
    print("  " + ", ".join(overrides))
