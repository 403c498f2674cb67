"""`EngineCore`: shoal's own engine for one rank — validate, schedule, run the model, emit
outputs. One of the two `RankEngine`s (`shoal.engine.core.rank_engine`).

It knows nothing of sockets, processes or Ray: `EngineCoreProc` wraps it with ZMQ IO threads,
and `LLM` drives it directly. Outputs are grouped by the client index of each request so that a
transport can deliver them to the client that owns them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from shoal.engine.config import EngineConfig
from shoal.engine.core.request_intake import (
    MAX_REQUEST_ID_CHARS,
    RequestIntake,
    RequestLimits,
)
from shoal.engine.errors import ModelLoadError
from shoal.engine.loader import load_model_arch
from shoal.engine.loader.hub import local_model_config
from shoal.engine.lora.requests import adapter_key
from shoal.engine.lora.slots import AdapterKey
from shoal.engine.model.executor import Executor, make_executor
from shoal.engine.model.tp_links import WorkerLauncher
from shoal.engine.model.worker import WorkerInfo
from shoal.engine.model_arch import ModelArch
from shoal.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFacts,
    KVCacheEvents,
    KVCacheSnapshot,
    SchedulerStats,
)
from shoal.engine.request import Request
from shoal.engine.scheduler import Scheduler
from shoal.engine.scheduler_output import ModelRunnerOutput
from shoal.engine.structured_output import LazyGrammarCompiler

logger = logging.getLogger(__name__)

__all__ = ["MAX_REQUEST_ID_CHARS", "EngineCore", "resolve_max_model_len"]


def resolve_max_model_len(requested: int | None, arch: ModelArch) -> int:
    """The context length to serve: the user's limit, never past what the model supports.

    Raises:
        ValueError: if the requested length exceeds the model's or is not positive.
    """
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    if not 0 < requested <= limit:
        raise ValueError(f"max_model_len={requested} is outside (0, {limit}] for this model")
    return requested


class EngineCore:
    """Scheduler + executor (its workers run the model) for one rank.

    Args:
        config: the engine's configuration.
        engine_index: this rank's index, stamped on every `EngineCoreOutputs`.
        worker_launcher: starts a tensor-parallel rank's other workers (default: children of
            this process).

    Raises:
        ModelLoadError: when the checkpoint cannot be loaded.
        ValueError: for an impossible configuration (context length, KV budget).
    """

    name = "shoal"

    def __init__(
        self,
        config: EngineConfig,
        *,
        engine_index: int = 0,
        worker_launcher: WorkerLauncher | None = None,
    ) -> None:
        # A Hub id becomes its snapshot folder here, on the node that loads it.
        self.config = config = local_model_config(config)
        self.engine_index = engine_index
        path = config.model.model
        self.arch = load_model_arch(path)
        self.max_model_len = resolve_max_model_len(config.model.max_model_len, self.arch)
        self.executor: Executor = make_executor(
            config, self.arch, max_model_len=self.max_model_len, worker_launcher=worker_launcher
        )
        self.executor.load_model()
        self.num_kv_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(self.num_kv_blocks)
        self.block_size = config.cache.kv_block_size
        # MEAN pooling needs every prompt token's state: nothing may come from the prefix cache.
        self.cache_config = config.cache
        if config.model.is_pooling and config.model.pooler.pooling_type == "MEAN":
            self.cache_config = dataclasses.replace(config.cache, enable_prefix_caching=False)
        self.scheduler = Scheduler(
            config.scheduler,
            self.cache_config,
            num_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len,
            sliding_window=self.arch.kv_window,
            lora=config.lora,
        )
        self.eos_token_ids = self.arch.eos_token_ids
        self.grammars = LazyGrammarCompiler(
            config.model.tokenizer or path, self.arch.vocab_size, self.eos_token_ids
        )
        limits = RequestLimits(
            max_model_len=self.max_model_len,
            vocab_size=self.arch.vocab_size,
            max_logprobs=config.model.max_logprobs,
            num_kv_cache_tokens=self.num_kv_blocks * self.block_size,
            is_pooling=config.model.is_pooling,
        )
        self.intake = RequestIntake(engine_index, limits)
        logger.info(
            "engine %d ready: %s, %d KV blocks of %d tokens, max_model_len %d",
            engine_index,
            self.arch.architecture,
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
        """Queues a request, or an ERROR output for it if it is invalid. Never raises for one."""
        if not self.intake.admit(request, self._is_live):
            return
        error = lora_error(self.executor, request)
        if error is not None:
            self.intake.reject(request, error)
            return
        engine_request = Request.from_engine_core_request(request, self.eos_token_ids)
        error = self._attach_grammar(engine_request)
        if error is not None:
            self.intake.reject(request, error)
            return
        self.scheduler.add_request(engine_request)

    def abort_requests(self, request_ids: list[str], *, client_index: int | None = None) -> None:
        """Aborts requests in any state; with `client_index`, only that client's own."""
        if client_index is not None:
            request_ids = [r for r in request_ids if self._is_owned_by(r, client_index)]
        self.scheduler.abort_requests(request_ids)

    def abort_client_requests(self, client_index: int) -> list[str]:
        """Aborts every live request of one client (it detached or died)."""
        request_ids = self.request_ids_of_client(client_index)
        self.scheduler.abort_requests(request_ids)
        self.intake.forget_client(client_index)
        return request_ids

    def request_ids_of_client(self, client_index: int) -> list[str]:
        """The live requests of one client."""
        return self.scheduler.request_ids_of_client(client_index)

    def has_unfinished_requests(self) -> bool:
        return self.intake.has_rejected() or self.scheduler.has_unfinished_requests()

    # --- the step ---------------------------------------------------------------------------

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Runs one scheduling step and returns each client's outputs of it.

        Returns:
            client index → `EngineCoreOutputs` carrying that client's outputs and this rank's
            scheduler stats; clients with nothing new are absent.
        """
        per_client = self.intake.take_rejected()
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            runner_output = (
                self.executor.execute_model(scheduler_output)
                if not scheduler_output.is_empty
                else ModelRunnerOutput()
            )
            self.scheduler.lora_load_s += runner_output.lora_load_s
            fail_lora_requests(self.scheduler, runner_output.lora_errors)
            updates = self.scheduler.update_from_output(scheduler_output, runner_output)
            for client_index, outputs in updates.items():
                per_client.setdefault(client_index, []).extend(outputs)
        return self.intake.pack(per_client, self.scheduler.make_stats)

    # --- utility methods (callable by name through EngineCoreProc's allow-list) ---------------

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def get_kv_cache_snapshot(self) -> KVCacheSnapshot:
        """Every cached block's routing key, as of the KV-events batch it names
        (`shoal.engine.kv_events`); pending changes are sealed into that batch first."""
        pool = self.scheduler.kv_cache_manager.block_pool
        seq = pool.kv_events.seal()
        return KVCacheSnapshot(seq, pool.cached_routing_keys(), self.block_size)

    def take_kv_events(self) -> list[KVCacheEvents]:
        """The prefix-cache changes since the last call, as numbered batches."""
        return self.scheduler.kv_cache_manager.block_pool.kv_events.take()

    def has_kv_events(self) -> bool:
        return self.scheduler.kv_cache_manager.block_pool.kv_events.has_pending()

    def collective_rpc(self, method: str, args: tuple[Any, ...] | list[Any] = ()) -> list[Any]:
        """Runs a public model-runner method on every worker, through the executor.

        Returns:
            One result per worker.

        Raises:
            AttributeError: if the runner has no such public method.
        """
        return self.executor.collective_rpc(method, tuple(args))

    def describe_workers(self) -> list[WorkerInfo]:
        """Each worker's TP rank, process and device, the driver's first."""
        return self.executor.describe_workers()

    def facts(self, identity: bytes) -> EngineFacts:
        return EngineFacts(
            engine_index=self.engine_index,
            identity=identity,
            model=self.config.model.model,
            max_model_len=self.max_model_len,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            vocab_size=self.arch.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            data_parallel_size=self.config.parallel.data_parallel_size,
            enable_prefix_caching=self.cache_config.enable_prefix_caching,
            device=self.executor.device.type,
            engine=self.name,
        )

    def shutdown(self) -> None:
        self.scheduler.abort_requests(self.scheduler.all_request_ids())
        self.executor.shutdown()
        self.grammars.close()

    # --- internals ---------------------------------------------------------------------------

    def _is_live(self, request_id: str) -> bool:
        return self.scheduler.get_request(request_id) is not None

    def _attach_grammar(self, request: Request) -> str | None:
        """Compiles a constrained request's grammar; the error message if it cannot."""
        constraint = request.sampling_params.structured_outputs
        if constraint is None:
            return None
        try:
            request.attach_grammar(self.grammars.get().compile(constraint))
        except (ValueError, ModelLoadError) as e:  # RequestError is a ValueError
            return str(e)
        return None

    def _is_owned_by(self, request_id: str, client_index: int) -> bool:
        request = self.scheduler.get_request(request_id)
        return request is not None and request.client_index == client_index


def fail_lora_requests(scheduler: Scheduler, errors: dict[AdapterKey, str]) -> None:
    """Fails every request of each adapter that could not be loaded (before the step's
    outputs are read, so none of theirs is emitted), and forgets the adapter's slot."""
    for key, message in errors.items():
        ids = [r.request_id for r in scheduler.requests.values() if adapter_key(r) == key]
        scheduler.abort_requests(ids, error=message)
        if scheduler.lora_slots is not None:
            scheduler.lora_slots.forget(key)


def lora_error(executor: Executor, request: EngineCoreRequest) -> str | None:
    """Why the request's adapter cannot serve on this rank (every worker reads its folder's
    config and header), or None; a request without one always passes."""
    lora = request.lora_request
    if lora is None:
        return None
    if not lora.lora_name:
        return "lora_name must not be empty"
    errors = executor.collective_rpc("check_lora_adapter", (lora.lora_path,))
    return next((e for e in errors if e is not None), None)
