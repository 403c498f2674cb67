"""The built wheel: one import package, `shoal`, usable from outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # setuptools builds in the tree: a stale build/ could carry modules that no longer exist.
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        check=True,
        cwd=out,
    )  # fmt: skip
    (built,) = out.glob("shoal-*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_holds_shoal_and_its_metadata_only(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"shoal", f"{wheel.name.split('-py')[0]}.dist-info"}
    # Every layer is there, with the kernel source the engine compiles on first use.
    for layer in ("engine", "client", "actors", "cluster", "deploy"):
        assert f"shoal/{layer}/__init__.py" in names
    assert "shoal/engine/kernels/csrc/paged_attention.c" in names
    entry_points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith("entry_points.txt"))
    )
    assert b"shoal = shoal.deploy.cli:main" in entry_points


@pytest.mark.slow
def test_a_fresh_venv_with_the_wheel_imports_the_public_api(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    # The runtime dependencies, as this environment resolved them; its own `shoal` (an
    # editable install, hooked in by a .pth that a plain path entry does not run) stays out.
    purelib = Path(
        subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip()
    )
    (purelib / "runtime-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         str(wheel)],
        check=True,
    )  # fmt: skip
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = (
        "import shoal; from shoal import LLM, AsyncLLM, SamplingParams; "
        "import shoal.deploy.cli, shoal.engine.core.core_proc; print(shoal.__file__)"
    )
    result = subprocess.run(
        [str(python), "-c", probe], cwd=outside, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(env_dir)), result.stdout
    for generic in ("engine", "client", "deploy"):
        found = subprocess.run(
            [str(python), "-c", f"import {generic}"], cwd=outside, env=env, capture_output=True
        )
        assert found.returncode != 0, f"the wheel installed a top-level {generic!r}"
