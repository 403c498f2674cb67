"""The executor seam: `EngineCore → Executor → Worker → ModelRunner`, and `collective_rpc` through it."""

from __future__ import annotations

import pytest
import torch

from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.loader import load_model_arch
from shoal.engine.model.executor import Executor, UniProcExecutor, make_executor
from tests.factories import make_tiny_checkpoint


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    return EngineConfig.from_kwargs(path, max_model_len=64, num_gpu_blocks_override=8)


def test_the_engine_core_reaches_its_model_only_through_the_executor(config: EngineConfig) -> None:
    core = EngineCore(config)
    assert isinstance(core.executor, Executor)
    assert not hasattr(core, "model_runner")
    # collective_rpc runs on every worker: one result each, read from the worker's own runner.
    [bytes_per_block] = core.collective_rpc("bytes_per_block")
    assert isinstance(core.executor, UniProcExecutor)
    assert bytes_per_block == core.executor.worker.model_runner.bytes_per_block()
    assert core.num_kv_blocks == 8


def test_collective_rpc_refuses_private_and_missing_methods(config: EngineConfig) -> None:
    executor = make_executor(config, load_model_arch(config.model.model), max_model_len=64)
    for method in ("_bind_kv_cache", "no_such_method", "__init__"):
        with pytest.raises(AttributeError, match="no public method"):
            executor.collective_rpc(method)


def test_a_worker_sets_the_cpu_thread_count_it_was_given(config: EngineConfig) -> None:
    threads = torch.get_num_threads()
    try:
        limited = EngineConfig.from_kwargs(config.model.model, max_model_len=64, cpu_threads=1)
        make_executor(limited, load_model_arch(config.model.model), max_model_len=64)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
