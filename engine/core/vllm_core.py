"""`VllmEngineCore`: vLLM's `EngineCore` as a shoal rank's engine (`RankEngine`).

The rank's busy loop steps vLLM's own engine core — its scheduler, KV cache manager, executor
and model runner, with every model, kernel and quantization vLLM has — in the rank's process.
Around it this adapter keeps what a shoal rank promises whatever its engine: the intake
(`shoal.engine.core.request_intake`), requests and outputs in shoal's wire types
(`shoal.engine.core.vllm_mapping`), cumulative stats, and the prefix cache as shoal's KV
events (`shoal.engine.core.vllm_kv_events`). vLLM's config comes from shoal's flags
(`shoal.engine.core.vllm_args`); under `-tp N` vLLM's own executor runs the workers.

vLLM is imported when an adapter is built, never at module level, so shoal works without it.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from shoal.engine.config import EngineConfig
from shoal.engine.core.request_intake import RequestIntake, RequestLimits
from shoal.engine.core.vllm_args import make_vllm_config
from shoal.engine.core.vllm_kv_events import VllmKVEvents
from shoal.engine.core.vllm_mapping import RequestMapper, VllmStats, from_vllm_output
from shoal.engine.loader.hub import local_model_config
from shoal.engine.model.worker import WorkerInfo
from shoal.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFacts,
    KVCacheEvents,
    KVCacheSnapshot,
    SchedulerStats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


class VllmEngineCore:
    """One rank's vLLM engine core, behind shoal's `RankEngine` interface.

    Args:
        config: the cluster's engine configuration (`config.rank_engine.engine == "vllm"`).
        engine_index: this rank's index, stamped on every `EngineCoreOutputs`.

    Raises:
        ImportError: vLLM is not installed (the message says how to install it).
        ValueError: vLLM refused the configuration (its message).
    """

    name = "vllm"

    def __init__(self, config: EngineConfig, *, engine_index: int = 0) -> None:
        from vllm.v1.engine.core import EngineCore as VllmCore
        from vllm.v1.executor import Executor

        # A Hub id becomes its snapshot folder here, as in shoal's engine (--revision and
        # --download-dir hold for both), and vLLM loads that folder.
        self.config = config = local_model_config(config)
        self.engine_index = engine_index
        vllm_config = make_vllm_config(config)
        self._core = VllmCore(vllm_config, Executor.get_class(vllm_config), log_stats=True)
        self.vllm_config = vllm_config
        scheduler: Any = self._core.scheduler
        self.block_size: int = scheduler.block_size
        self.num_kv_blocks: int = vllm_config.cache_config.num_gpu_blocks or 0
        self.max_model_len = vllm_config.model_config.max_model_len
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.kv_events = VllmKVEvents(self.block_size)
        # The scheduler publishes each step's cache changes into this process, not a socket.
        scheduler.kv_event_publisher = self.kv_events
        self._tokenizer: Any = self._core.structured_output_manager.tokenizer
        eos = getattr(self._tokenizer, "eos_token_id", None)
        generation_config = vllm_config.model_config.try_get_generation_config()
        self._mapper = RequestMapper(self.max_model_len, generation_config, eos)
        self._stats = VllmStats()
        limits = RequestLimits(
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            max_logprobs=vllm_config.model_config.max_logprobs,
            num_kv_cache_tokens=self.num_kv_blocks * self.block_size,
        )
        self.intake = RequestIntake(engine_index, limits)
        logger.info(
            "engine %d ready (vLLM): %d KV blocks of %d tokens, max_model_len %d",
            engine_index,
            self.num_kv_blocks,
            self.block_size,
            self.max_model_len,
        )

    @property
    def requests_seen(self) -> dict[int, int]:
        """client index → ADDs taken in from that client (`RequestIntake`)."""
        return self.intake.requests_seen

    # --- requests -------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Hands a request to vLLM's scheduler, or queues an ERROR output for it (an invalid
        request, or one vLLM refuses). Never raises for one."""
        if not self.intake.admit(request, self._is_live):
            return
        try:
            vllm_request = self._mapper.to_vllm(request)
            _check_structured_outputs(
                self.vllm_config, self._tokenizer, vllm_request.sampling_params
            )
            engine_request, _ = self._core.preprocess_add_request(vllm_request)
            self._core.add_request(engine_request)
        except Exception as e:  # vLLM's refusal of this request (VLLMValidationError, ...)
            self.intake.reject(request, str(e))

    def abort_requests(self, request_ids: list[str], *, client_index: int | None = None) -> None:
        """Aborts requests in any state; with `client_index`, only that client's own."""
        requests = self._requests()
        live = [
            r
            for r in request_ids
            if r in requests and client_index in (None, requests[r].client_index)
        ]
        if live:
            self._core.abort_requests(live)

    def abort_client_requests(self, client_index: int) -> list[str]:
        """Aborts every live request of one client (it detached or died)."""
        request_ids = self.request_ids_of_client(client_index)
        if request_ids:
            self._core.abort_requests(request_ids)
        self.intake.forget_client(client_index)
        return request_ids

    def request_ids_of_client(self, client_index: int) -> list[str]:
        """The live requests of one client."""
        return [
            request_id
            for request_id, request in self._requests().items()
            if request.client_index == client_index and not request.is_finished()
        ]

    def has_unfinished_requests(self) -> bool:
        return self.intake.has_rejected() or self._core.scheduler.has_requests()

    # --- the step ---------------------------------------------------------------------------

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Runs one vLLM step and returns each client's outputs of it, with this rank's stats."""
        per_client = self.intake.take_rejected()
        if self._core.scheduler.has_requests():
            vllm_outputs, model_executed = self._core.step_fn()
            self._core.post_step(model_executed)
            for client_index, outputs in (vllm_outputs or {}).items():
                self._stats.absorb(outputs.scheduler_stats)
                converted = [from_vllm_output(o) for o in outputs.outputs]
                self._stats.num_generation_tokens_total += sum(
                    len(o.new_token_ids) for o in converted
                )
                if converted:
                    per_client.setdefault(client_index, []).extend(converted)
        return self.intake.pack(per_client, self.make_stats)

    # --- stats, the prefix cache and utility calls --------------------------------------------

    def make_stats(self) -> SchedulerStats:
        return self._stats.snapshot(self._core.scheduler, self.kv_events.num_cached_blocks)

    def reset_prefix_cache(self) -> bool:
        is_reset = self._core.reset_prefix_cache()
        # The cleared blocks' events wait in vLLM's cache manager until a step takes them.
        scheduler: Any = self._core.scheduler
        self.kv_events.apply(scheduler.kv_cache_manager.take_events())
        return bool(is_reset)

    def get_kv_cache_snapshot(self) -> KVCacheSnapshot:
        """Every cached block's routing key, as of the KV-events batch it names."""
        return self.kv_events.snapshot()

    def take_kv_events(self) -> list[KVCacheEvents]:
        """The prefix-cache changes since the last call, as numbered batches."""
        return self.kv_events.log.take()

    def has_kv_events(self) -> bool:
        return self.kv_events.log.has_pending()

    def collective_rpc(self, method: str, args: tuple[Any, ...] | list[Any] = ()) -> list[Any]:
        """Runs a method on every vLLM worker (`vllm.v1.executor`); one result per worker."""
        return list(self._core.collective_rpc(method, args=tuple(args)))

    def describe_workers(self) -> list[WorkerInfo]:
        """The engine's own process (the driver); vLLM's workers of a TP rank beside it."""
        device = str(self.vllm_config.device_config.device)
        workers = [WorkerInfo(0, os.getpid(), device)]
        executor: Any = self._core.model_executor
        for tp_rank, worker in enumerate(getattr(executor, "workers", None) or []):
            pid = getattr(getattr(worker, "proc", None), "pid", None)
            if pid is not None and pid != os.getpid():
                workers.append(WorkerInfo(tp_rank, pid, device))
        return workers

    def facts(self, identity: bytes) -> EngineFacts:
        return EngineFacts(
            engine_index=self.engine_index,
            identity=identity,
            model=self.config.model.model,
            max_model_len=self.max_model_len,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            vocab_size=self.vocab_size,
            eos_token_ids=sorted(_eos_token_ids(self._mapper)),
            data_parallel_size=self.config.parallel.data_parallel_size,
            enable_prefix_caching=self.vllm_config.cache_config.enable_prefix_caching,
            engine=self.name,
        )

    def shutdown(self) -> None:
        self._core.shutdown()

    # --- internals ---------------------------------------------------------------------------

    def _requests(self) -> dict[str, Any]:
        scheduler: Any = self._core.scheduler
        requests: dict[str, Any] = scheduler.requests
        return requests

    def _is_live(self, request_id: str) -> bool:
        return request_id in self._requests()


def _check_structured_outputs(vllm_config: VllmConfig, tokenizer: Any, params: Any) -> None:
    """vLLM's own validation of a constraint, as its front end runs it before the engine
    compiles the grammar (a bad one is that request's error)."""
    if params.structured_outputs is None:
        return
    params._validate_structured_outputs(
        vllm_config.model_config, vllm_config.structured_outputs_config, tokenizer
    )


def _eos_token_ids(mapper: RequestMapper) -> set[int]:
    """The tokenizer's end-of-sequence id and the generation config's, as clients stop on."""
    ids = set()
    if mapper.eos_token_id is not None:
        ids.add(mapper.eos_token_id)
    configured = mapper.generation_config.get("eos_token_id")
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return ids
