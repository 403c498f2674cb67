"""`Worker`: one device's share of an engine — its torch settings, its `ModelRunner`, its weights.

The executor (`shoal.engine.model.executor`) owns how many workers there are and where they run; a
worker owns what happens on its device: the intra-op thread count on CPU, loading the weights
into the runner, sizing and binding the KV cache, and running a scheduled step. Under tensor
parallelism it holds its shard only; the collectives that join it to the other workers live in
the model's layers. It knows nothing of the scheduler's state, sockets or processes.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.engine.config import EngineConfig
from shoal.engine.loader import load_blocks, load_lazy_weights
from shoal.engine.model.model_runner import ModelRunner
from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.expert_parallel import ExpertParallel
from shoal.engine.parallel.tensor_parallel import TensorParallel
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput


class Worker:
    """Owns one `ModelRunner` and the device settings it runs under.

    Args:
        config: the engine's configuration (model path, device, dtype, cache, scheduler).
        arch: the checkpoint's architecture facts.
        max_model_len: the context length served.
        expert_parallel: this rank's share of an MoE model's experts and their exchange.
        tensor_parallel: this worker's place in its rank's TP group; default: the whole model.
        device: this worker's device; default: the configured one.

    Raises:
        ValueError: a non-positive `cpu_threads`, or what `ModelRunner` refuses.
    """

    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArch,
        *,
        max_model_len: int,
        expert_parallel: ExpertParallel | None = None,
        tensor_parallel: TensorParallel | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.config = config
        self.model_runner = ModelRunner(
            config.model,
            config.cache,
            config.scheduler,
            arch,
            max_model_len=max_model_len,
            expert_parallel=expert_parallel,
            tensor_parallel=tensor_parallel,
            device=device,
        )
        cpu_threads = config.model.cpu_threads
        if cpu_threads is not None and cpu_threads < 1:
            raise ValueError(f"cpu_threads must be positive, got {cpu_threads}")
        if cpu_threads is not None and self.device.type == "cpu":
            # Process-wide: a small engine sharing cores with its IO threads and clients is
            # faster with fewer intra-op threads (idle OpenMP workers spin on those cores).
            torch.set_num_threads(cpu_threads)

    @property
    def device(self) -> torch.device:
        return self.model_runner.device

    def load_model(self) -> None:
        """Loads the checkpoint's weights into the runner's model, reading from a safetensors
        checkpoint only the tensors (and the blocks of them) this worker holds.

        Raises:
            ModelLoadError: the checkpoint cannot be read.
        """
        path = self.config.model.model
        self.model_runner.load_model(load_lazy_weights(path), blocks=load_blocks(path))

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        """Runs a public method of this worker's model runner (`collective_rpc`'s target).

        Raises:
            AttributeError: the runner has no such public method.
        """
        if method.startswith("_") or not callable(getattr(self.model_runner, method, None)):
            raise AttributeError(f"model runner has no public method {method!r}")
        return getattr(self.model_runner, method)(*args)
