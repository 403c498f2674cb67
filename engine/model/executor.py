"""Executors: how an `EngineCore` reaches its workers — `EngineCore → Executor → Worker → ModelRunner`.

`EngineCore` only ever talks to an `Executor`: load the model, size and bind the KV cache, run
a scheduled step, and `collective_rpc` (one call on every worker, one result per worker). How
many workers there are and where they live is the executor's business, so executors with
several workers (tensor parallelism: one per device, in other processes) fit behind the same
interface without touching the engine core. Two are built: `UniProcExecutor`, one worker in
the engine's own process, and `MultiprocExecutor` (`shoal.engine.model.multiproc_executor`),
one worker per device of a tensor-parallel rank.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.engine.config import EngineConfig
from shoal.engine.model.executor_base import Executor
from shoal.engine.model.tp_links import WorkerLauncher
from shoal.engine.model.worker import Worker, WorkerInfo
from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.expert_parallel import make_expert_parallel
from shoal.engine.parallel.tensor_parallel import check_tensor_parallel
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor(Executor):
    """One worker, in the engine core's own process and thread.

    Args:
        config: the engine's configuration.
        arch: the checkpoint's architecture facts.
        max_model_len: the context length served.
    """

    def __init__(self, config: EngineConfig, arch: ModelArch, *, max_model_len: int) -> None:
        expert_parallel = make_expert_parallel(config, arch)
        self.expert_workers = expert_parallel  # one worker: its side is the rank's
        self.worker = Worker(
            config, arch, max_model_len=max_model_len, expert_parallel=expert_parallel
        )

    @property
    def device(self) -> torch.device:
        return self.worker.device

    def describe_workers(self) -> list[WorkerInfo]:
        return [self.worker.info()]

    def load_model(self) -> None:
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [self.worker.call(method, tuple(args))]


def make_executor(
    config: EngineConfig,
    arch: ModelArch,
    *,
    max_model_len: int,
    worker_launcher: WorkerLauncher | None = None,
) -> Executor:
    """The executor for `config`: one in-process worker, or one per device under TP, started
    by `worker_launcher` (default: spawned children of this process).

    Raises:
        ValueError: a TP size the model cannot be split by (before any process starts), or
            expert parallelism the model cannot be split by (`make_expert_parallel`).
    """
    tp = config.parallel.tensor_parallel_size
    check_tensor_parallel(arch, tp)
    if tp == 1:
        return UniProcExecutor(config, arch, max_model_len=max_model_len)
    make_expert_parallel(config, arch)  # its refusals, before any process starts
    from shoal.engine.model.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(config, arch, max_model_len=max_model_len, launcher=worker_launcher)
