"""`Executor`: the interface `EngineCore` reaches its workers through (implementations in
`shoal.engine.model.executor` and `shoal.engine.model.multiproc_executor`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from shoal.engine.model.worker import WorkerInfo
from shoal.engine.parallel.expert_parallel import ExpertWorkers
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """The engine core's one handle on its workers."""

    # This rank's sides of the MoE exchange, one per worker (MoE under
    # --enable-expert-parallel over several ranks), else None: how the DP waves and resizes
    # reach every worker.
    expert_workers: ExpertWorkers | None = None

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device of the worker whose outputs the engine core reads (the driver worker)."""

    @abstractmethod
    def describe_workers(self) -> list[WorkerInfo]:
        """Each worker's TP rank, process and device, the driver's first. Fixed once the
        executor is built (a worker that ends ends the rank), so it is safe from any thread.
        """

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
