"""Control calls are typed: mypy checks every `.remote` call on an actor handle against the
actor's method (name, arguments, result), so a wrong call fails the type check, not a cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.ray_utils import REPO_ROOT

CALLS = """
import ray
from shoal.actors.registry import RegistryHandle

def resize(registry: RegistryHandle) -> None:
    epoch: int = ray.get(registry.end_scale.remote(3, "committed", ""))
    ray.get(registry.end_scale.remote("3", "committed", ""))
    ray.get(registry.no_such_method.remote())
    name: str = ray.get(registry.commit_scale.remote(3))
"""


@pytest.mark.slow
def test_mypy_refuses_a_wrong_argument_a_missing_method_and_a_wrong_result(
    tmp_path: Path,
) -> None:
    calls = tmp_path / "calls.py"
    calls.write_text(CALLS)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", str(calls)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 3, result.stdout + result.stderr
    assert 'Argument 1 to "remote"' in errors[0] and '"int | ObjectRef[int]"' in errors[0]
    assert "no_such_method" in errors[1]
    assert "Incompatible types in assignment" in errors[2]
