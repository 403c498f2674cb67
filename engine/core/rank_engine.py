"""`RankEngine`: what schedules and runs the model in one rank, behind shoal's busy loop.

A rank is shoal's `EngineCoreProc` — the busy loop, ZMQ IO with CURVE, the HELLO handshake,
stats reports, KV events on the clients' frames, utility calls, resize notices, the step
watchdog — around one engine. Two engines fit: shoal's own `EngineCore`
(`shoal.engine.core.engine_core`) and `VllmEngineCore` (`shoal.engine.core.vllm_core`), which
hosts vLLM's `EngineCore`. `make_rank_engine` builds the one the config names and imports vLLM
only then. Nothing above the rank (routing, migration, resizes, front ends) knows which runs.
"""

from __future__ import annotations

from typing import Any, Protocol

from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.model.tp_links import WorkerLauncher
from shoal.engine.model.worker import WorkerInfo
from shoal.engine.parallel.expert_parallel import ExpertWorkers
from shoal.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFacts,
    KVCacheEvents,
    KVCacheSnapshot,
    SchedulerStats,
)


class RankEngine(Protocol):
    """One rank's engine: it takes requests, steps the model and reports its load and cache.

    What an engine must provide (all called from the busy loop's thread, except
    `describe_workers`, which is fixed once built):

    - `name` ("shoal", "vllm"), `engine_index`, `config`, and `requests_seen` (client index →
      ADDs taken in, the intake's count: `shoal.engine.core.request_intake`).
    - `facts(identity)`: what a HELLO answers — context length, KV blocks and the block size
      the engine really uses, vocabulary, EOS ids, whether its prefix cache is on.
    - `add_request(request)`: take a request (ids already scoped by client), or queue an ERROR
      output for it; never raise for one. A request with `resumed_output_token_ids` continues
      another rank's stream after those tokens.
    - `abort_requests(request_ids, client_index=)`, `abort_client_requests(client_index)` (the
      ids aborted) and `request_ids_of_client(client_index)` (a leaving rank releases them).
    - `has_unfinished_requests()` and `step()`: one step, each client's outputs of it, with
      the rank's `SchedulerStats`.
    - `make_stats()`: the load as `SchedulerStats`, counters cumulative since start.
    - The prefix cache as KV events (`shoal.engine.kv_events`): `take_kv_events()`,
      `has_kv_events()` and `get_kv_cache_snapshot()`, keyed by
      `shoal.engine.block_hash.routing_key` over blocks of `facts().block_size` tokens.
    - The data plane's utility calls (`shoal.engine.core.core_io.UTILITY_METHODS`) that are
      the engine's: `reset_prefix_cache`, `get_kv_cache_snapshot`, and a read-only
      `collective_rpc` (the rank answers `echo` and `get_stats`, from `make_stats()`, itself).
    - `describe_workers()` (each worker's TP rank, process, device) and `shutdown()`.
    """

    name: str
    engine_index: int
    config: EngineConfig

    @property
    def requests_seen(self) -> dict[int, int]: ...
    def facts(self, identity: bytes) -> EngineFacts: ...
    def add_request(self, request: EngineCoreRequest) -> None: ...
    def abort_requests(
        self, request_ids: list[str], *, client_index: int | None = None
    ) -> None: ...
    def abort_client_requests(self, client_index: int) -> list[str]: ...
    def request_ids_of_client(self, client_index: int) -> list[str]: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> dict[int, EngineCoreOutputs]: ...
    def make_stats(self) -> SchedulerStats: ...
    def reset_prefix_cache(self) -> bool: ...
    def take_kv_events(self) -> list[KVCacheEvents]: ...
    def has_kv_events(self) -> bool: ...
    def get_kv_cache_snapshot(self) -> KVCacheSnapshot: ...
    def collective_rpc(self, method: str, args: tuple[Any, ...] | list[Any] = ()) -> list[Any]: ...
    def describe_workers(self) -> list[WorkerInfo]: ...
    def shutdown(self) -> None: ...


def make_rank_engine(
    config: EngineConfig,
    *,
    engine_index: int = 0,
    worker_launcher: WorkerLauncher | None = None,
) -> RankEngine:
    """The engine `config.rank_engine.engine` names, loaded and ready to step.

    Raises:
        ModelLoadError, ValueError: from the engine.
        ImportError: vLLM's engine was asked for and vLLM is not installed.
    """
    if config.rank_engine.engine == "vllm":
        from shoal.engine.core.vllm_core import VllmEngineCore

        return VllmEngineCore(config, engine_index=engine_index)
    return EngineCore(config, engine_index=engine_index, worker_launcher=worker_launcher)


def expert_workers_of(engine: RankEngine) -> ExpertWorkers | None:
    """The rank's sides of the MoE exchange (DP waves, resizes): only shoal's engine shards
    experts across ranks."""
    return engine.executor.expert_workers if isinstance(engine, EngineCore) else None
