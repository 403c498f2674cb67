"""`Worker`: one device's share of an engine — its torch settings, its `ModelRunner`, its weights.

The executor (`shoal.engine.model.executor`) owns how many workers there are and where they run; a
worker owns what happens on its device: the intra-op thread count on CPU, loading the weights
into the runner, sizing and binding the KV cache, and running a scheduled step. Under tensor
parallelism it holds its shard only; the collectives that join it to the other workers live in
the model's layers. It knows nothing of the scheduler's state, sockets or processes.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from shoal.engine.config import EngineConfig
from shoal.engine.loader import load_blocks, load_lazy_weights, num_weights
from shoal.engine.loader.progress import with_progress
from shoal.engine.model.model_runner import ModelRunner
from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.distributed import Rendezvous
from shoal.engine.parallel.expert_parallel import (
    ExpertParallel,
    ExpertPlacement,
    StagedExperts,
    exchange_rendezvous,
)
from shoal.engine.parallel.tensor_parallel import TensorParallel
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class WorkerInfo:
    """Where one worker of a rank runs: fixed for the life of its process.

    Attributes:
        tp_rank: its rank in the rank's tensor-parallel group (0: the driver worker).
        pid: its process.
        device: its torch device ("cpu", "cuda:1"); a CUDA device the process sees through
            `CUDA_VISIBLE_DEVICES` is followed by the physical GPU it names ("cuda:1 (GPU 5)").
    """

    tp_rank: int
    pid: int
    device: str


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
        self.expert_parallel = expert_parallel
        self._stage: Future[StagedExperts] | None = None  # experts staged for a resize
        self.model_runner = ModelRunner(
            config.model,
            config.cache,
            config.scheduler,
            arch,
            max_model_len=max_model_len,
            expert_parallel=expert_parallel,
            tensor_parallel=tensor_parallel,
            device=device,
            lora_config=config.lora,
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

    def info(self) -> WorkerInfo:
        """This worker's TP rank, process and device."""
        return WorkerInfo(self.model_runner.tp.rank, os.getpid(), describe_device(self.device))

    def load_model(self) -> None:
        """Loads the checkpoint's weights into the runner's model, reading from a safetensors
        checkpoint only the tensors (and the blocks of them) this worker holds.

        Raises:
            ModelLoadError: the checkpoint cannot be read.
        """
        path = self.config.model.model
        weights = with_progress(load_lazy_weights(path), num_weights(path))
        blocks = load_blocks(path)
        if blocks is not None:  # a GGUF's quantized projections, for the CPU kernel
            blocks = with_progress(blocks, 0, what="GGUF blocks", unit="projections")
        self.model_runner.load_model(weights, blocks=blocks)

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    # --- the MoE exchange: the DP waves' calls on every worker (`TPExpertWorkers`) -----------

    def join_expert_groups(
        self,
        rendezvous: dict[str, Any],
        world_size: int,
        timeout_s: float,
        join_timeout_s: float,
        generation: int | None,
        abort_key: str | None,
    ) -> None:
        """Forms (does not bind) this worker's exchange group: the workers of its TP index in
        every rank, at `exchange_rendezvous`. Only TP index 0 joins a given `generation` (the
        waves' groups); the others count generations of their own and choose theirs.

        Args:
            rendezvous: the set's `Rendezvous`, as a mapping of its fields.

        Raises:
            GroupJoinError: a peer did not join in time, or the join was aborted.
        """
        tp_rank = self.model_runner.tp.rank
        self._experts().join_groups(
            exchange_rendezvous(msgspec.convert(rendezvous, Rendezvous), tp_rank),
            world_size,
            timeout_s=timeout_s,
            join_timeout_s=join_timeout_s,
            generation=generation if tp_rank == 0 else None,
            abort_key=abort_key,
        )

    def bind_expert_groups(self) -> None:
        self._experts().bind_joined()

    def leave_expert_groups(self) -> None:
        self._experts().leave_groups()

    def run_dummy_forward(self) -> None:
        self._experts().run_dummy_forward()

    def start_staging_experts(
        self, expert_to_rank: list[int], num_ranks: int, rank: int, model_path: str
    ) -> None:
        """Starts staging this worker's experts (its width block of them) for a new placement
        on a thread of its own, while forwards go on (`ExpertParallel.stage`); replaces any
        earlier stage."""
        placement = ExpertPlacement(tuple(expert_to_rank), num_ranks)
        pool = ThreadPoolExecutor(1, thread_name_prefix="shoal-stage-experts")
        self._stage = pool.submit(self._experts().stage, placement, rank, model_path)
        pool.shutdown(wait=False)

    def is_staging_done(self) -> bool:
        """Whether the stage is built.

        Raises:
            ModelLoadError, ValueError: what staging raised.
        """
        assert self._stage is not None, "start_staging_experts first"
        if not self._stage.done():
            return False
        self._stage.result()
        return True

    def commit_staged_experts(self) -> None:
        """Swaps the built stage in (the exchange unbound: `ExpertParallel.commit`)."""
        assert self._stage is not None and self._stage.done(), "nothing staged"
        staged, self._stage = self._stage.result(), None
        self._experts().commit(staged)

    def drop_staged_experts(self) -> None:
        """Forgets the stage (one still building is dropped when it ends)."""
        self._stage = None

    def _experts(self) -> ExpertParallel:
        assert self.expert_parallel is not None, "this worker serves no experts"
        return self.expert_parallel

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        """Runs a public method of this worker's model runner (`collective_rpc`'s target).

        Raises:
            AttributeError: the runner has no such public method.
        """
        if method.startswith("_") or not callable(getattr(self.model_runner, method, None)):
            raise AttributeError(f"model runner has no public method {method!r}")
        return getattr(self.model_runner, method)(*args)


def describe_device(device: torch.device) -> str:
    """`device` as `WorkerInfo` shows it: a CUDA index mapped through `CUDA_VISIBLE_DEVICES`
    (which a scheduler such as Ray sets per process) to the GPU it names."""
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    if index < len(visible):
        return f"cuda:{index} (GPU {visible[index]})"
    return f"cuda:{index}"
