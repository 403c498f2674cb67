"""The layer rule of docs/architecture.md: `shoal`'s subpackages import only downward."""

from __future__ import annotations

import ast
import subprocess
import sys
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
    module.write_text("from shoal.client.api.llm import LLM\nimport ray.util\n")
    assert _imported(module) & FORBIDDEN["engine"] == {"shoal.client", "ray"}


def test_client_transport_needs_no_ray() -> None:
    """The MP clients work without Ray (architecture, client/): all of `transport/`, and all of
    `routing/` but the cluster link."""
    modules = _modules("client/transport") + _modules("client/routing")
    offenders = [
        str(path.relative_to(ROOT))
        for path in modules
        if path.name != "cluster_link.py" and "ray" in _imported(path)
    ]
    assert len(modules) > 10 and not offenders, offenders


# Inside client/: each part imports only the parts before it (client/__init__.py).
CLIENT_PARTS = ("transport", "routing", "api")


def _client_part(dotted: str) -> str | None:
    """`shoal.client.x.y` -> the part of client/ that holds it; None for the package itself."""
    parts = dotted.split(".")
    if parts[:2] != ["shoal", "client"] or len(parts) < 3 or parts[2] not in CLIENT_PARTS:
        return None
    return parts[2]


def _client_offenders(root: Path) -> list[str]:
    offenders = []
    for part in CLIENT_PARTS:
        allowed = set(CLIENT_PARTS[: CLIENT_PARTS.index(part) + 1])
        for path in sorted((root / part).rglob("*.py")):
            for name in sorted(_all_imports(path, "shoal.client")):
                other = _client_part(name)
                if other is None:  # the package's own names load every part
                    offenders.append(f"{path.relative_to(root)} imports {name} (the package)")
                elif other not in allowed:
                    offenders.append(f"{path.relative_to(root)} ({part}) imports {name} ({other})")
    return offenders


def test_client_parts_import_only_earlier_parts() -> None:
    assert not _client_offenders(ROOT / "client")


def test_the_client_rule_catches_transport_importing_routing(tmp_path: Path) -> None:
    for part in CLIENT_PARTS:
        (tmp_path / part).mkdir()
    (tmp_path / "transport" / "x.py").write_text(
        "def f():\n    from shoal.client.routing.router import RequestRouter\n"
    )
    (tmp_path / "routing" / "y.py").write_text("from shoal.client.transport import x\n")
    (tmp_path / "api" / "z.py").write_text("from shoal.client import LLM\n")
    assert _client_offenders(tmp_path) == [
        "transport/x.py (transport) imports shoal.client.routing.router (routing)",
        "api/z.py imports shoal.client.LLM (the package)",
    ]


# Inside engine/: each part imports only the parts before it (engine/__init__.py).
ENGINE_PARTS = ("kernels", "shared", "parallel", "model", "core")
TORCH_FREE = ("scheduler", "kv_cache", "block_pool", "request", "protocol", "tokenizer")


def _engine_part(dotted: str) -> str | None:
    """`shoal.engine.x.y` -> the part of engine/ that holds it; None outside engine/."""
    parts = dotted.split(".")
    if parts[:2] != ["shoal", "engine"]:
        return None
    if len(parts) > 2 and parts[2] in ("kernels", "parallel", "model", "core"):
        return parts[2]
    return "shared"


def _all_imports(path: Path, package: str) -> set[str]:
    """Every module of `package` a file imports, local imports included; `from package import
    name` counts `package.name`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == package:
                names.update(f"{package}.{alias.name}" for alias in node.names)
            else:
                names.add(node.module)
    return {name for name in names if name.startswith(package)}


def _engine_offenders(root: Path) -> list[str]:
    offenders = []
    for path in sorted(root.rglob("*.py")):
        dotted = "shoal.engine." + ".".join(path.relative_to(root).with_suffix("").parts)
        own = _engine_part(dotted)
        assert own is not None
        allowed = set(ENGINE_PARTS[: ENGINE_PARTS.index(own) + 1])
        for name in sorted(_all_imports(path, "shoal.engine")):
            part = _engine_part(name)
            if part is not None and part not in allowed:
                offenders.append(f"{path.relative_to(root)} ({own}) imports {name} ({part})")
    return offenders


def test_engine_parts_import_only_earlier_parts() -> None:
    assert not _engine_offenders(ROOT / "engine")


def test_the_engine_rule_catches_a_model_importing_core(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "runner.py").write_text(
        "def f():\n    from shoal.engine.core.core_io import X\n"
    )
    (tmp_path / "scheduler.py").write_text("from shoal.engine import model_arch\n")
    assert _engine_offenders(tmp_path) == [
        "model/runner.py (model) imports shoal.engine.core.core_io (core)"
    ]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_scheduling_and_the_kv_cache_need_no_torch(module: str) -> None:
    """The scheduler's side of the engine runs without torch, in a fresh interpreter."""
    code = f"import sys, shoal.engine.{module}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
