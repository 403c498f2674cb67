"""The layer rule of docs/architecture.md: `shoal`'s subpackages import only downward."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("engine", "actors", "cluster", "client", "deploy")

FORBIDDEN = {
    "engine": {"ray", "shoal.actors", "shoal.cluster", "shoal.client", "shoal.deploy"},
    "actors": {"shoal.cluster", "shoal.client", "shoal.deploy"},
    "cluster": {"shoal.client", "shoal.deploy"},
    "client": {"shoal.deploy"},
    "deploy": set(),
}


def _imported(path: Path) -> set[str]:
    """What a module imports, as `ray`-style roots or `shoal.<layer>` names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return {
        ".".join(n.split(".")[:2]) if n.startswith("shoal.") else n.split(".")[0] for n in names
    }


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_downward(package: str) -> None:
    modules = _modules(package)
    assert modules, f"no modules found under {package}/"
    offenders = []
    for path in modules:
        bad = _imported(path) & FORBIDDEN[package]
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, "\n".join(offenders)


def test_nothing_imports_a_layer_by_its_bare_name() -> None:
    """Every import goes through the one package: `shoal.engine`, never `engine`."""
    offenders = []
    for path in [p for layer in LAYERS for p in _modules(layer)] + _modules("tests"):
        bare = _imported(path) & set(LAYERS)
        if bare:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bare)}")
    assert not offenders, "\n".join(offenders)


def test_the_rule_catches_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "upward.py"
    module.write_text("from shoal.client.llm import LLM\nimport ray.util\n")
    assert _imported(module) & FORBIDDEN["engine"] == {"shoal.client", "ray"}


def test_client_transport_needs_no_ray() -> None:
    """MPClient and its async/sync variants must work without Ray (architecture, client/)."""
    for name in (
        "core_client.py",
        "mp_client.py",
        "async_mp_client.py",
        "sync_mp_client.py",
        "dp_client.py",
        "engine_set.py",
    ):
        assert "ray" not in _imported(ROOT / "client" / name), f"client/{name} imports ray"
