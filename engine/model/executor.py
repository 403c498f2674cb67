"""Executors: how an `EngineCore` reaches its workers — `EngineCore → Executor → Worker → ModelRunner`.

`EngineCore` only ever talks to an `Executor`: load the model, size and bind the KV cache, run
a scheduled step, and `collective_rpc` (one call on every worker, one result per worker). How
many workers there are and where they live is the executor's business, so executors with
several workers (tensor parallelism: one per device, in other processes) fit behind the same
interface without touching the engine core. One executor is built today: `UniProcExecutor`,
one worker in the engine's own process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from shoal.engine.config import EngineConfig
from shoal.engine.model.worker import Worker
from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.expert_parallel import (
    ExpertParallel,
    ExpertPlacement,
    check_expert_parallel,
)
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """The engine core's one handle on its workers."""

    # This rank's expert-parallel context (MoE under --enable-expert-parallel), else None.
    expert_parallel: ExpertParallel | None = None

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device of the worker whose outputs the engine core reads (the driver worker)."""

    @abstractmethod
    def load_model(self) -> None:
        """Every worker loads its weights."""

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks every worker can hold (the minimum over workers)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Every worker allocates `num_blocks` KV blocks."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step on every worker; returns the driver worker's sampled tokens."""

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Calls a public model-runner method on every worker; one result per worker.

        Raises:
            AttributeError: the runner has no such public method.
        """

    def shutdown(self) -> None:  # noqa: B027 - a no-op is right for executors with no processes
        """Releases the workers (processes, devices); idempotent."""


class UniProcExecutor(Executor):
    """One worker, in the engine core's own process and thread.

    Args:
        config: the engine's configuration.
        arch: the checkpoint's architecture facts.
        max_model_len: the context length served.
    """

    def __init__(self, config: EngineConfig, arch: ModelArch, *, max_model_len: int) -> None:
        self.expert_parallel = make_expert_parallel(config, arch)
        self.worker = Worker(
            config, arch, max_model_len=max_model_len, expert_parallel=self.expert_parallel
        )

    @property
    def device(self) -> torch.device:
        return self.worker.device

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


def make_executor(config: EngineConfig, arch: ModelArch, *, max_model_len: int) -> Executor:
    """The executor for `config`: today always one in-process worker."""
    return UniProcExecutor(config, arch, max_model_len=max_model_len)


def make_expert_parallel(config: EngineConfig, arch: ModelArch) -> ExpertParallel | None:
    """This rank's expert-parallel context when `config` asks for expert parallelism.

    Raises:
        ValueError: expert parallelism on a dense model, or over more ranks than experts.
    """
    parallel = config.parallel
    if not parallel.enable_expert_parallel:
        return None
    check_expert_parallel(arch, parallel.data_parallel_size)
    if parallel.data_parallel_size == 1:
        return None  # one rank holds every expert: nothing to exchange
    placement = ExpertPlacement.contiguous(arch.num_local_experts, parallel.data_parallel_size)
    return ExpertParallel(placement, parallel.data_parallel_rank)
