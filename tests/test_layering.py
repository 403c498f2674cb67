"""The layer rule of docs/architecture.md: packages import only downward."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {
    "engine": {"ray", "actors", "cluster", "client", "deploy"},
    "actors": {"cluster", "client", "deploy"},
    "cluster": {"client", "deploy"},
    "client": {"deploy"},
    "deploy": set(),
}


def _imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_downward(package: str) -> None:
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _imported_roots(path) & FORBIDDEN[package]
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, "\n".join(offenders)


def test_client_transport_needs_no_ray() -> None:
    """MPClient and its async/sync variants must work without Ray (architecture, client/)."""
    for name in ("core_client.py", "serial.py"):
        path = ROOT / "client" / name
        if path.exists():
            assert "ray" not in _imported_roots(path), f"client/{name} imports ray"
