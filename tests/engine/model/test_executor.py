"""The executor seam: `EngineCore → Executor → Worker → ModelRunner`, and `collective_rpc` through it."""

from __future__ import annotations

import os

import pytest
import torch

from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.loader import load_model_arch
from shoal.engine.model.executor import Executor, UniProcExecutor, make_executor
from shoal.engine.model.worker import WorkerInfo, describe_device
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


def test_the_executor_describes_its_one_worker_here(config: EngineConfig) -> None:
    executor = make_executor(config, load_model_arch(config.model.model), max_model_len=64)
    assert executor.describe_workers() == [WorkerInfo(tp_rank=0, pid=os.getpid(), device="cpu")]


def test_a_cuda_device_is_described_with_the_gpu_it_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert describe_device(torch.device("cuda", 1)) == "cuda:1 (GPU 5)"
    assert describe_device(torch.device("cuda")) == "cuda:0 (GPU 3)"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert describe_device(torch.device("cuda", 1)) == "cuda:1"
    assert describe_device(torch.device("cpu")) == "cpu"
