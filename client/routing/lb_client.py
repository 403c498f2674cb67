"""`DPLBAsyncMPClient`: the DP client that routes each request to the rank its policy picks.

It keeps request → rank and each rank's load in its `RequestRouter` (so aborts reach the owner
whatever the policy), every rank's prefix cache in its `KVCacheIndex` (fed by the engines' KV
events), moves requests off ranks that fail or leave with its `RequestMigrator`, and feeds
them all from the outputs it sees (`process_engine_outputs`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from shoal.client.routing.kv_index import KVCacheIndex
from shoal.client.routing.lb_policy import (
    LoadBalancePolicy,
    RankView,
    RouteRequest,
    RoutingDecision,
    make_policy,
)
from shoal.client.routing.migration import DEFAULT_MIGRATION_LIMIT, RequestMigrator
from shoal.client.routing.router import RequestRouter
from shoal.client.transport.attach_driver import wait_for_engines
from shoal.client.transport.dp_client import DPAsyncMPClient
from shoal.engine.block_hash import ROOT_BLOCK_HASH, adapter_root_hash, prompt_routing_keys
from shoal.engine.errors import EngineDeadError, RequestError
from shoal.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineEndpoint,
    EngineFacts,
    KVCacheSnapshot,
    SchedulerStats,
)

logger = logging.getLogger(__name__)


class DPLBAsyncMPClient(DPAsyncMPClient):
    """Routes each request by its policy (the policy's docstring is the algorithm).

    Args:
        endpoints, stats_address, **kwargs: as for `DPAsyncMPClient`.
        policy: the routing policy; default `make_policy("cache-aware")`.
        migration_limit: how often one request may move off a failed rank to another
            (`shoal.client.routing.migration`); 0: a rank's failure fails its requests.
    """

    wants_kv_events = True

    def __init__(
        self,
        endpoints: Sequence[EngineEndpoint],
        *,
        policy: LoadBalancePolicy | None = None,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
        **kwargs: Any,
    ) -> None:
        self.policy = policy or make_policy("cache-aware")
        self.migrator = RequestMigrator(migration_limit)
        self.kv_index = KVCacheIndex()
        self.router = RequestRouter(on_started=self.kv_index.settle)
        super().__init__(endpoints, **kwargs)
        self.placement = _RoutedPlacement(self.router, self.migrator)
        events = self.events
        events.engine_added.subscribe(self._index_rank)
        events.engine_dead.subscribe(self._drop_rank)
        events.engine_removed.subscribe(self._drop_removed_rank)
        events.outputs.subscribe(self.process_engine_outputs)
        events.stats.subscribe(self._take_rank_stats)
        self.rank_released.subscribe(self._hand_over_released)
        for rank, (_, facts) in self.engine_set.attached_facts().items():
            self._index_rank(rank, facts)  # attached while the client was being built

    def get_core_engine_for_request(
        self, request: EngineCoreRequest, session_id: str | None = None
    ) -> int:
        """The rank for a new request: its explicit `data_parallel_rank`, else the policy's pick.

        Raises:
            RequestError: the requested rank is not serving.
            EngineDeadError: no rank is serving.
        """
        pinned = request.data_parallel_rank
        if pinned is not None:
            if pinned not in self.lb_engines:
                raise RequestError(
                    f"data_parallel_rank {pinned} is not serving (serving: {self.lb_engines})"
                )
            return pinned
        return self.route(request, session_id).rank

    def route(self, request: EngineCoreRequest, session_id: str | None = None) -> RoutingDecision:
        """The policy's choice among the routable ranks, from their load and cached prefix;
        O(ranks + prompt blocks).

        Raises:
            EngineDeadError: no rank is serving.
        """
        return self._route(request, session_id)[0]

    def _route(
        self, request: EngineCoreRequest, session_id: str | None
    ) -> tuple[RoutingDecision, list[int]]:
        """`route`, with the prompt's block keys (empty when no rank caches anything)."""
        routable = self.lb_engines
        if not routable:
            raise EngineDeadError("no engine rank is serving")
        tokens = [*request.prompt_token_ids, *request.resumed_output_token_ids]
        index = self.kv_index
        for rank in index.unsynced(routable):
            self._resync_kv_index(rank)  # attached before the event loop ran
        keys: list[int] = []
        if index.block_size and len(routable) > 1:  # keys cached or expected, or to expect
            try:
                keys = prompt_routing_keys(tokens, index.block_size, _root_hash(request))
            except (OverflowError, TypeError):
                keys = []  # token ids no engine takes: the engine refuses the request itself
        matched = index.match(keys, routable)
        lora = request.lora_request.lora_name if request.lora_request else None
        views = [
            RankView(
                rank,
                load := self.router.load(rank),
                matched[rank] * index.block_size,
                index.num_cached_blocks(rank),
                has_lora=lora is not None and load.holds_lora(lora),
                is_lora_full=lora is not None and load.is_lora_full(),
            )
            for rank in routable
        ]
        return self.policy.choose(RouteRequest(len(tokens), session_id, lora), views), keys

    async def _wait_for_a_rank(self) -> bool:
        """Waits (`wait_for_engines`) for a routable rank, if ranks may come back."""
        engines = self.engine_set
        return await wait_for_engines(
            lambda: bool(engines.routable()), lambda: engines.returns.engines_can_return
        )

    async def add_request_async(
        self,
        request: EngineCoreRequest,
        engine: bytes | None = None,
        *,
        session_id: str | None = None,
        num_migrations: int = 0,
    ) -> None:
        """Sends a request to the rank its pin or the policy picks.

        Args:
            request: the request.
            engine: ignored (the rank is chosen here).
            session_id: keep this session on one rank while its load allows (the policy's
                `SessionAffinityPolicy`); None: no affinity.
            num_migrations: how often it moved off a failed rank already (the migrator's).
        """
        try:
            decision, keys = self._decide(request, session_id)
        except EngineDeadError:
            # Every rank is down here; wait for one a cluster link is attaching again.
            if not await self._wait_for_a_rank():
                raise
            decision, keys = self._decide(request, session_id)
        rank = decision.rank if decision is not None else request.data_parallel_rank
        assert rank is not None
        # The DP wave last published: lets an expert-parallel rank tell a request that raced
        # the end of a wave.
        request.current_wave = self.current_wave
        endpoint = self.engine_set.endpoint(rank)
        assert endpoint is not None, "a routable rank is in the engine set"
        predicted = None
        if decision is not None:
            predicted = decision.predicted_hit_tokens
            self.router.stats.on_decision(decision.reason)
        # The prefill it adds to the rank's load: what the rank is not expected to hold.
        num_tokens = len(request.prompt_token_ids) + len(request.resumed_output_token_ids)
        num_tokens -= predicted or 0
        if keys:
            self.kv_index.expect(rank, keys)
        self.router.on_sent(
            request.request_id,
            rank,
            num_tokens,
            request,
            predicted,
            num_migrations,
            expected_keys=keys or None,
            lora_name=request.lora_request.lora_name if request.lora_request else None,
        )
        self.policy.on_sent(rank)
        try:
            await super().add_request_async(request, endpoint.identity)
        except BaseException:
            self.router.on_aborted([request.request_id])
            raise

    async def abort_requests_async(
        self, request_ids: list[str], engine: bytes | None = None
    ) -> None:
        """Sends each abort to the rank that owns the request."""
        self.migrator.forget(request_ids)
        for rank, ids in self.router.on_aborted(request_ids).items():
            endpoint = self.engine_set.endpoint(rank)
            if endpoint is not None and not self.engine_set.is_dead(rank):
                await super().abort_requests_async(ids, endpoint.identity)

    def process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Keeps the in-flight map, the view of the sending rank's load and its cache current;
        drops outputs of requests not routed to the sending rank (moved off it, or unknown)."""
        rank = outputs.engine_index
        kept = self.router.on_outputs(outputs.outputs, rank)
        if kept is not None:
            outputs.outputs = kept
        events = outputs.kv_events
        if (
            events is not None
            and rank in self.engine_set
            and self.kv_index.apply_events(rank, events)
        ):
            self._resync_kv_index(rank)
        if outputs.scheduler_stats is not None:
            self._take_rank_stats(rank, outputs.scheduler_stats, outputs.requests_seen)

    async def _hand_over_released(self, rank: int, request_ids: list[str]) -> None:
        """Hands each released request to another rank (`RequestMigrator.on_rank_released`)."""
        await self.migrator.on_rank_released(self, rank, request_ids)

    def _take_rank_stats(self, rank: int, stats: SchedulerStats, requests_seen: int) -> None:
        if rank in self.engine_set:
            self.router.load(rank).update_stats(stats, requests_seen)
            self.policy.on_stats(rank)

    def _drop_rank(self, engine_index: int) -> None:
        """The rank died, or was removed while this client still had requests there: they
        move to other ranks (`RequestMigrator.on_rank_failed`) before the consumer hears of
        it; then the rank is forgotten."""
        self.migrator.on_rank_failed(self, engine_index)
        self.router.forget_rank(engine_index)
        self.kv_index.drop_rank(engine_index)

    def _drop_removed_rank(self, engine_index: int, was_dead: bool) -> None:
        self._drop_rank(engine_index)

    def _decide(
        self, request: EngineCoreRequest, session_id: str | None
    ) -> tuple[RoutingDecision | None, list[int]]:
        """The policy's decision and the prompt's block keys; no decision for a request
        pinned to a serving rank."""
        if request.data_parallel_rank is not None:
            self.get_core_engine_for_request(request)  # checks the pin
            return None, []
        return self._route(request, session_id)

    def _index_rank(self, engine_index: int, facts: EngineFacts) -> None:
        """A rank (a new incarnation) starts with an empty cache view, synced from a snapshot;
        a rank without a prefix cache has no view."""
        if not facts.enable_prefix_caching:
            self.kv_index.drop_rank(engine_index)  # nothing to index: routing sees no cache
            return
        self.kv_index.add_rank(engine_index, facts.block_size)
        self._resync_kv_index(engine_index)

    def _resync_kv_index(self, rank: int) -> None:
        """Fetches a snapshot of an UNSYNCED rank's cache, in a task (see `KVCacheIndex`)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop yet: the first batch of events from the rank asks again
        if not self.kv_index.need_snapshot(rank):
            return
        task = asyncio.create_task(self._fetch_kv_snapshot(rank), name=f"KVSnapshot_{rank}")
        self.resources.side_tasks.add(task)  # cancelled when the client closes
        task.add_done_callback(self.resources.side_tasks.discard)

    async def _fetch_kv_snapshot(self, rank: int) -> None:
        endpoint = self.engine_set.endpoint(rank)
        try:
            if endpoint is None:
                raise EngineDeadError(f"rank {rank} left")
            snapshot = await self._call_utility_async(
                "get_kv_cache_snapshot", engine=endpoint.identity
            )
            if not isinstance(snapshot, KVCacheSnapshot):
                raise TypeError(f"not a KV-cache snapshot: {type(snapshot).__name__}")
        except Exception as e:  # the rank died or is an older engine: route without its cache
            logger.info("no KV-cache snapshot from rank %d: %s", rank, e)
            self.kv_index.snapshot_failed(rank)
            return
        if self.kv_index.apply_snapshot(rank, snapshot):
            self._resync_kv_index(rank)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Calls a utility method on every serving rank; returns the first rank's result."""
        results = await self.call_utility_all_async(method, *args)
        return results[min(results)]

    async def call_utility_all_async(self, method: str, *args: Any) -> dict[int, Any]:
        """Calls a utility method on every serving rank; results by rank.

        Raises:
            EngineDeadError: no rank is serving.
        """
        endpoints = self.engine_set.endpoints()
        ranks = self.lb_engines
        if not ranks:
            raise EngineDeadError("no engine rank is serving")
        results = await asyncio.gather(
            *(self._call_utility_async(method, *args, engine=endpoints[r].identity) for r in ranks)
        )
        return dict(zip(ranks, results, strict=True))


class _RoutedPlacement:
    """Where this client's requests are: the router's table, and the migrator's moves."""

    def __init__(self, router: RequestRouter, migrator: RequestMigrator) -> None:
        self._router = router
        self._migrator = migrator

    def rank_of(self, request_id: str) -> int | None:
        return self._router.rank_of(request_id)

    def is_moving(self, request_id: str) -> bool:
        return self._migrator.is_moving(request_id)


def _root_hash(request: EngineCoreRequest) -> int:
    """The parent hash of the request's first KV block, as its engine keys it."""
    lora = request.lora_request
    return ROOT_BLOCK_HASH if lora is None else adapter_root_hash(lora.lora_name, lora.lora_path)
