"""`EngineCore`: one engine rank in-process — validate, schedule, run the model, emit outputs.

It knows nothing of sockets, processes or Ray: `EngineCoreProc` wraps it with ZMQ IO threads,
and `LLM` drives it directly. Outputs are grouped by the client index of each request so that a
transport can deliver them to the client that owns them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from shoal.engine.config import EngineConfig
from shoal.engine.core.rate_limit import LogRateLimiter
from shoal.engine.errors import ModelLoadError
from shoal.engine.loader import load_model_arch
from shoal.engine.model.executor import Executor, make_executor
from shoal.engine.model.tp_links import WorkerLauncher
from shoal.engine.model_arch import ModelArch
from shoal.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFacts,
    FinishReason,
    KVCacheEvents,
    KVCacheSnapshot,
    SchedulerStats,
)
from shoal.engine.request import Request
from shoal.engine.scheduler import Scheduler
from shoal.engine.scheduler_output import ModelRunnerOutput
from shoal.engine.structured_output import LazyGrammarCompiler

logger = logging.getLogger(__name__)
_duplicates = LogRateLimiter(logger)

# A request id longer than this is refused; logs show at most `_LOGGED_ID_CHARS` of any id.
MAX_REQUEST_ID_CHARS = 256
_LOGGED_ID_CHARS = 64


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

    def __init__(
        self,
        config: EngineConfig,
        *,
        engine_index: int = 0,
        worker_launcher: WorkerLauncher | None = None,
    ) -> None:
        self.config = config
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
        self.block_size = config.cache.block_size
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            num_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len,
        )
        self.eos_token_ids = self.arch.eos_token_ids
        self.grammars = LazyGrammarCompiler(
            config.model.tokenizer or path, self.arch.vocab_size, self.eos_token_ids
        )
        # Error outputs of rejected requests, delivered with the next step.
        self._rejected: dict[int, list[EngineCoreOutput]] = {}
        # client index → ADDs taken in from that client (accepted or rejected), reported with
        # the stats so a load balancer knows which of its sends they include.
        self.requests_seen: dict[int, int] = {}
        logger.info(
            "engine %d ready: %s, %d KV blocks of %d tokens, max_model_len %d",
            engine_index,
            self.arch.architecture,
            self.num_kv_blocks,
            self.block_size,
            self.max_model_len,
        )

    # --- requests -------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues a request, or an ERROR output for it if it is invalid. Never raises for one."""
        client = request.client_index
        self.requests_seen[client] = self.requests_seen.get(client, 0) + 1
        if self.scheduler.get_request(request.request_id) is not None:
            # An answer would carry the live request's id and finish it a second time: the
            # duplicate is dropped, and the live request finishes exactly once.
            _duplicates.warning(
                "duplicate-id",
                "engine %d dropped an ADD whose request_id %r is live already",
                self.engine_index,
                _loggable(request.request_id),
            )
            return
        error = self._validate(request)
        if error is not None:
            logger.info("rejected request %r: %s", _loggable(request.request_id), error)
            self._reject(request.client_index, request.request_id, error)
            return
        engine_request = Request.from_engine_core_request(request, self.eos_token_ids)
        error = self._attach_grammar(engine_request)
        if error is not None:
            logger.info("rejected request %r: %s", _loggable(request.request_id), error)
            self._reject(request.client_index, request.request_id, error)
            return
        self.scheduler.add_request(engine_request)

    def abort_requests(self, request_ids: list[str], *, client_index: int | None = None) -> None:
        """Aborts requests in any state; with `client_index`, only that client's own."""
        if client_index is not None:
            request_ids = [r for r in request_ids if self._is_owned_by(r, client_index)]
        self.scheduler.abort_requests(request_ids)

    def abort_client_requests(self, client_index: int) -> list[str]:
        """Aborts every live request of one client (it detached or died)."""
        request_ids = self.scheduler.request_ids_of_client(client_index)
        self.scheduler.abort_requests(request_ids)
        self._rejected.pop(client_index, None)
        self.requests_seen.pop(client_index, None)  # if it attaches again, it counts afresh
        return request_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self._rejected) or self.scheduler.has_unfinished_requests()

    # --- the step ---------------------------------------------------------------------------

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Runs one scheduling step and returns each client's outputs of it.

        Returns:
            client index → `EngineCoreOutputs` carrying that client's outputs and this rank's
            scheduler stats; clients with nothing new are absent.
        """
        per_client, self._rejected = self._rejected, {}
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            runner_output = (
                self.executor.execute_model(scheduler_output)
                if not scheduler_output.is_empty
                else ModelRunnerOutput()
            )
            updates = self.scheduler.update_from_output(scheduler_output, runner_output)
            for client_index, outputs in updates.items():
                per_client.setdefault(client_index, []).extend(outputs)
        if not per_client:
            return {}
        stats = self.scheduler.make_stats()
        now = time.time()
        return {
            client_index: EngineCoreOutputs(
                engine_index=self.engine_index,
                outputs=outputs,
                scheduler_stats=stats,
                timestamp=now,
                requests_seen=self.requests_seen.get(client_index, 0),
            )
            for client_index, outputs in per_client.items()
        }

    # --- utility methods (callable by name through EngineCoreProc's allow-list) ---------------

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def get_stats(self) -> SchedulerStats:
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

    def echo(self, value: Any) -> Any:
        return value

    def collective_rpc(self, method: str, args: tuple[Any, ...] | list[Any] = ()) -> list[Any]:
        """Runs a public model-runner method on every worker, through the executor.

        Returns:
            One result per worker.

        Raises:
            AttributeError: if the runner has no such public method.
        """
        return self.executor.collective_rpc(method, tuple(args))

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
            enable_prefix_caching=self.config.cache.enable_prefix_caching,
        )

    def shutdown(self) -> None:
        self.scheduler.abort_requests(self.scheduler.all_request_ids())
        self.executor.shutdown()

    # --- internals ---------------------------------------------------------------------------

    def _validate(self, request: EngineCoreRequest) -> str | None:
        if not request.request_id:
            return "request_id must not be empty"
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            return f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters"
        prompt = request.prompt_token_ids
        if not prompt:
            return "the prompt is empty"
        if len(prompt) >= self.max_model_len:
            return (
                f"the prompt has {len(prompt)} tokens, but the maximum context length is "
                f"{self.max_model_len} and at least one token must be generated"
            )
        vocab_size = self.arch.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            return f"prompt token ids must be in [0, {vocab_size})"
        params = request.sampling_params
        try:
            params.__post_init__()  # fields may have been changed after construction
        except ValueError as e:
            return str(e)
        max_logprobs = min(self.config.model.max_logprobs, vocab_size)
        if params.logprobs is not None and params.logprobs > max_logprobs:
            return f"logprobs={params.logprobs} exceeds the maximum of {max_logprobs}"
        if any(t >= vocab_size for t in params.stop_token_ids):
            return f"stop_token_ids must be in [0, {vocab_size})"
        if request.resumed_output_token_ids:
            return self._validate_resumed(request)
        return None

    def _validate_resumed(self, request: EngineCoreRequest) -> str | None:
        """A resumed request's output so far: valid ids, room for one more token, under
        max_tokens (the rank that generated it would have finished it otherwise)."""
        resumed = request.resumed_output_token_ids
        vocab_size = self.arch.vocab_size
        if min(resumed) < 0 or max(resumed) >= vocab_size:
            return f"resumed output token ids must be in [0, {vocab_size})"
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and len(resumed) >= max_tokens:
            return (
                f"the request resumes with {len(resumed)} output tokens, which already reach "
                f"max_tokens={max_tokens}"
            )
        num_tokens = len(request.prompt_token_ids) + len(resumed)
        # The scheduler ends a request that fills the context or the whole KV pool, so a
        # resumed one must leave room for at least one more token in both.
        max_num_tokens = min(self.max_model_len, self.num_kv_blocks * self.block_size)
        if num_tokens >= max_num_tokens:
            return (
                f"the prompt and the resumed output have {num_tokens} tokens, but at most "
                f"{max_num_tokens - 1} leave room for a generated token (max_model_len="
                f"{self.max_model_len}, KV cache {self.num_kv_blocks * self.block_size} tokens)"
            )
        return None

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

    def _reject(self, client_index: int, request_id: str, message: str) -> None:
        output = EngineCoreOutput(
            request_id=request_id, finish_reason=FinishReason.ERROR, error_message=message
        )
        self._rejected.setdefault(client_index, []).append(output)


def _loggable(request_id: str) -> str:
    """`request_id` cut to what a log line shows: a peer's 10 MB id costs the log 64 chars."""
    if len(request_id) <= _LOGGED_ID_CHARS:
        return request_id
    return f"{request_id[:_LOGGED_ID_CHARS]}...({len(request_id)} chars)"
