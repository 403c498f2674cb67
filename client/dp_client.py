"""Data-parallel clients: `DPAsyncMPClient` (many ranks + stats) and `DPLBAsyncMPClient` (routing).

`DPAsyncMPClient` subscribes to the coordinator's stats (`_ensure_stats_update_task`) and
answers `lb_engines`, the ranks that may take new requests, from its engine set.
`DPLBAsyncMPClient` sends each request to the rank its `LoadBalancePolicy` picks, keeps
request → rank and each rank's load in its `RequestRouter` (so aborts reach the owner whatever
the policy), every rank's prefix cache in its `KVCacheIndex` (fed by the engines' KV events),
and feeds both from the outputs it sees (`process_engine_outputs`). Neither knows Ray: the
cluster link tells them when ranks come and go.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from shoal.client.async_engine_set import wait_for_engines
from shoal.client.async_mp_client import AsyncMPClient
from shoal.client.kv_index import KVCacheIndex
from shoal.client.lb_policy import (
    LoadBalancePolicy,
    RankView,
    RouteRequest,
    RoutingDecision,
    make_policy,
)
from shoal.client.migration import DEFAULT_MIGRATION_LIMIT, RequestMigrator
from shoal.client.routing import RequestRouter
from shoal.engine.block_hash import prompt_routing_keys
from shoal.engine.errors import EngineDeadError, RequestError
from shoal.engine.parallel.elastic import RECONFIGURED, SHUTDOWN_COMPLETE, ScaleNotice
from shoal.engine.protocol import (
    DPStatsSnapshot,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineEndpoint,
    EngineFacts,
    EngineStatsReport,
    KVCacheSnapshot,
    SchedulerStats,
)

logger = logging.getLogger(__name__)

_NOTICES_KEPT = 256


class DPAsyncMPClient(AsyncMPClient):
    """An `AsyncMPClient` over several engine ranks, with the coordinator's stats stream.

    `lb_engines` is, as in vLLM, what the load balancer works over; here it is the list of
    rank indices that may take new requests (attached, HELLO answered, not counted dead),
    derived from the engine set on every read, never kept apart from it. `current_wave` is
    the coordinator's DP wave counter as last published.

    Args:
        endpoints: the ranks to attach to now.
        stats_address: the coordinator's XPUB address; None: no stats subscription.
        stats_server_key: the coordinator's CURVE public key, for a client with CURVE keys.
        **kwargs: as for `AsyncMPClient`.
    """

    def __init__(
        self,
        endpoints: Sequence[EngineEndpoint],
        *,
        stats_address: str | None = None,
        stats_server_key: bytes | None = None,
        **kwargs: Any,
    ) -> None:
        self.current_wave = 0
        self.stats_address = stats_address
        self.stats_server_key = stats_server_key
        self._engine_lost_listeners: list[Callable[[int], None]] = []
        self._scale_listeners: list[Callable[[str, ScaleNotice], None]] = []
        # The elastic notifications received, oldest first: (kind, epoch, rank).
        self.scale_notices: deque[tuple[str, int, int]] = deque(maxlen=_NOTICES_KEPT)
        # Each attached rank's load as the coordinator last published it (`latest_stats`).
        self._latest_stats: dict[int, SchedulerStats] = {}
        super().__init__(endpoints, **kwargs)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # started lazily, with the output task
        else:
            self._ensure_stats_update_task()

    @property
    def lb_engines(self) -> list[int]:
        """The ranks that may take new requests now, sorted (see the class docstring)."""
        return self.engine_set.routable()

    def add_engine_lost_listener(self, listener: Callable[[int], None]) -> None:
        """Calls `listener(rank)` whenever this client learns it lost a rank (a cluster link
        reports it to the registry at once)."""
        self._engine_lost_listeners.append(listener)

    def set_rank_draining(self, engine_index: int, is_draining: bool) -> None:
        """Stops (or, for a resize rolled back, resumes) routing new requests to a rank; its
        requests in flight keep streaming (see `EngineSet`)."""
        self.engine_set.set_draining(engine_index, is_draining)

    def add_scale_listener(self, listener: Callable[[str, ScaleNotice], None]) -> None:
        """Calls `listener(kind, notice)` for every elastic notification (a cluster link
        reads the membership again at once)."""
        self._scale_listeners.append(listener)

    def _ensure_stats_update_task(self) -> None:
        """Starts the stats subscription once; the task holds the client only weakly."""
        resources = self.resources
        if resources.stats_update_task is not None or self.stats_address is None:
            return
        socket = self.ctx.socket(zmq.SUB)
        if self._curve is not None and self.stats_server_key is not None:
            self._curve.secure_stats_socket(socket, self.stats_server_key)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(self.stats_address)
        resources.stats_socket = socket
        decoder = msgspec.msgpack.Decoder(DPStatsSnapshot)
        _self_ref = weakref.ref(self)

        async def run_stats_updates() -> None:
            while True:
                frame = await socket.recv()
                try:
                    snapshot = decoder.decode(frame)
                except msgspec.DecodeError as e:
                    logger.warning("dropping a malformed stats snapshot: %s", e)
                    continue
                _self = _self_ref()
                if _self is None:
                    return
                _self._on_stats_snapshot(snapshot)
                del _self  # hold the client only while handling one snapshot

        resources.stats_update_task = asyncio.create_task(
            run_stats_updates(), name="DPStatsUpdateTask"
        )

    def set_stats_address(self, address: str) -> None:
        """Subscribes at `address` from now on (the coordinator moved)."""
        socket = self.resources.stats_socket
        if socket is not None and self.stats_address is not None:
            socket.disconnect(self.stats_address)
            socket.connect(address)
        self.stats_address = address
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # subscribed lazily, with the output task
        self._ensure_stats_update_task()

    def _ensure_output_queue_task(self) -> None:
        super()._ensure_output_queue_task()
        self._ensure_stats_update_task()

    def _on_stats_snapshot(self, snapshot: DPStatsSnapshot) -> None:
        self.current_wave = snapshot.current_wave
        for report in snapshot.reports:
            rank = report.engine_index
            endpoint = self.engine_set.endpoint(rank)
            if endpoint is None or report.identity != endpoint.identity:
                continue  # a rank not attached here, or the last word of a dead incarnation
            if self._is_detached_by(report):
                self._on_let_go(rank, "its stats no longer list this client")
                continue
            seen = report.requests_seen.get(self.client_index, 0)
            self._latest_stats[rank] = report.stats
            self._on_rank_stats(rank, report.stats, seen)

    def latest_stats(self) -> dict[int, SchedulerStats]:
        """The latest published load of each rank this client is attached to, by rank."""
        return {r: s for r, s in self._latest_stats.items() if r in self.engine_set}

    def _is_detached_by(self, report: EngineStatsReport) -> bool:
        """Whether a report of an engine this client is attached to says it is not (anymore).

        Only a report that reflects this client's attach counts: one measured before it would
        not list the client yet.
        """
        facts = self.engine_set.facts(report.engine_index)
        return (
            facts is not None
            and 0 < facts.attach_serial <= report.attaches_seen
            and self.client_index not in report.attached_clients
            and not self.engine_set.is_dead(report.engine_index)
        )

    def _on_rank_stats(self, rank: int, stats: SchedulerStats, requests_seen: int) -> None:
        """Hook for subclasses: one rank's load, measured after it had taken in
        `requests_seen` of this client's requests."""

    def _on_engine_lost(self, engine_index: int) -> None:
        self._on_rank_unroutable(engine_index)
        for listener in self._engine_lost_listeners:
            listener(engine_index)
        super()._on_engine_lost(engine_index)

    def _on_engine_removed(self, engine_index: int, was_dead: bool) -> None:
        self._on_rank_unroutable(engine_index)
        super()._on_engine_removed(engine_index, was_dead)

    def _on_rank_unroutable(self, engine_index: int) -> None:
        """Hook: a rank died or was removed; it left `lb_engines`."""
        self._latest_stats.pop(engine_index, None)

    async def eep_process_engine_core_notification(self, notification: Sequence[Any]) -> None:
        """Handles an elastic notification `(kind, ScaleNotice)` sent on
        `EEP_NOTIFICATION_CALL_ID` (the protocol is in `shoal.engine.parallel.elastic`).

        SHUTDOWN_COMPLETE: the rank takes no new requests (`_on_rank_released` hands its
        released ones over). RECONFIGURED: a resize committed. Either way the listeners hear
        it (a cluster link follows the registry's membership from there).
        """
        kind, payload = notification
        try:
            notice = msgspec.convert(payload, ScaleNotice)
        except msgspec.ValidationError as e:
            logger.warning("dropping a malformed elastic notification %r: %s", kind, e)
            return
        if kind not in (RECONFIGURED, SHUTDOWN_COMPLETE):
            logger.warning("dropping an elastic notification of unknown kind %r", kind)
            return
        if notice.rank not in self.engine_set:
            return  # a rank this client has let go of already
        self.scale_notices.append((kind, notice.epoch, notice.rank))
        logger.info(
            "elastic notification %s from rank %d (resize %d)", kind, notice.rank, notice.epoch
        )
        if kind == SHUTDOWN_COMPLETE:
            self.engine_set.set_draining(notice.rank)
            await self._on_rank_released(notice.rank, notice.request_ids)
        for listener in self._scale_listeners:
            listener(kind, notice)

    async def _on_rank_released(self, rank: int, request_ids: list[str]) -> None:
        """Hook: a rank that left released these requests of this client."""


class DPLBAsyncMPClient(DPAsyncMPClient):
    """Routes each request by its policy (the policy's docstring is the algorithm).

    Args:
        endpoints, stats_address, **kwargs: as for `DPAsyncMPClient`.
        policy: the routing policy; default `make_policy("cache-aware")`.
        migration_limit: how often one request may move off a failed rank to another
            (`shoal.client.migration`); 0: a rank's failure fails its requests.
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
                keys = prompt_routing_keys(tokens, index.block_size)
            except (OverflowError, TypeError):
                keys = []  # token ids no engine takes: the engine refuses the request itself
        matched = index.match(keys, routable)
        views = [
            RankView(
                rank,
                self.router.load(rank),
                matched[rank] * index.block_size,
                index.num_cached_blocks(rank),
            )
            for rank in routable
        ]
        return self.policy.choose(RouteRequest(len(tokens), session_id), views), keys

    async def _wait_for_a_rank(self) -> bool:
        """Waits (`wait_for_engines`) for a routable rank, if ranks may come back."""
        engines = self.engine_set
        return await wait_for_engines(
            lambda: bool(engines.routable()), lambda: engines.engines_can_return
        )

    def rank_of(self, request_id: str) -> int | None:
        """The rank serving an in-flight request of this client."""
        return self.router.rank_of(request_id)

    def is_moving(self, request_id: str) -> bool:
        """Whether a request left a failed rank and is on its way to another one."""
        return self.migrator.is_moving(request_id)

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

    async def process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:
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
            self._on_rank_stats(
                outputs.engine_index, outputs.scheduler_stats, outputs.requests_seen
            )

    async def _on_rank_released(self, rank: int, request_ids: list[str]) -> None:
        """Hands each released request to another rank (`RequestMigrator.on_rank_released`)."""
        await self.migrator.on_rank_released(self, rank, request_ids)

    def _on_rank_stats(self, rank: int, stats: SchedulerStats, requests_seen: int) -> None:
        if rank in self.engine_set:
            self.router.load(rank).update_stats(stats, requests_seen)
            self.policy.on_stats(rank)

    def _on_rank_unroutable(self, engine_index: int) -> None:
        """The rank died, or was removed while this client still had requests there: they
        move to other ranks (`RequestMigrator.on_rank_failed`) before the consumer hears of
        it; then the rank is forgotten."""
        self.migrator.on_rank_failed(self, engine_index)
        super()._on_rank_unroutable(engine_index)
        self.router.forget_rank(engine_index)
        self.kv_index.drop_rank(engine_index)

    def _decide(
        self, request: EngineCoreRequest, session_id: str | None
    ) -> tuple[RoutingDecision | None, list[int]]:
        """The policy's decision and the prompt's block keys; no decision for a request
        pinned to a serving rank."""
        if request.data_parallel_rank is not None:
            self.get_core_engine_for_request(request)  # checks the pin
            return None, []
        return self._route(request, session_id)

    def _on_attached(self, engine_index: int, facts: EngineFacts) -> None:
        """A rank (a new incarnation) starts with an empty cache view, synced from a snapshot;
        a rank without a prefix cache has no view."""
        super()._on_attached(engine_index, facts)
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
