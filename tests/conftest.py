"""Shared test setup: quiet Ray, few torch threads, GPU tests skipped without a GPU."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from collections.abc import Iterator

import pytest
import torch

from tests.engine.core_proc_utils import ServedEngine, running_engine, tiny_config
from tests.factories import make_tiny_checkpoint

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
