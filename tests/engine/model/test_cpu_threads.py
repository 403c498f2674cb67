"""`cpu_threads` sets torch's intra-op threads when an engine starts on CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from shoal.engine.core.engine_core import EngineCore
from tests.engine.core_proc_utils import tiny_config


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_cpu_threads_sets_the_intra_op_threads(engine_checkpoint: str) -> None:
    EngineCore(tiny_config(engine_checkpoint, cpu_threads=1))
    assert torch.get_num_threads() == 1


def test_without_cpu_threads_torch_keeps_its_own(engine_checkpoint: str) -> None:
    EngineCore(tiny_config(engine_checkpoint))
    assert torch.get_num_threads() == 2


def test_cpu_threads_must_be_positive(engine_checkpoint: str) -> None:
    with pytest.raises(ValueError, match="cpu_threads must be positive"):
        EngineCore(tiny_config(engine_checkpoint, cpu_threads=0))
