"""Data-parallel clients: `DPAsyncMPClient` (many ranks + stats) and `DPLBAsyncMPClient` (routing).

`DPAsyncMPClient` subscribes to the coordinator's stats (`_ensure_stats_update_task`) and keeps
`lb_engines`, the ranks that may take new requests. `DPLBAsyncMPClient` sends each request to the
rank its `LoadBalancePolicy` picks, remembers request → rank so aborts reach the owner, and
feeds the policy from the outputs it sees (`process_engine_outputs`). Neither knows Ray: the
cluster link tells them when ranks come and go.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from shoal.client.async_engine_set import wait_for_engines
from shoal.client.async_mp_client import AsyncMPClient
from shoal.client.lb_policy import LeastLoadedPolicy, LoadBalancePolicy
from shoal.engine.errors import EngineDeadError, RequestError
from shoal.engine.protocol import (
    DPStatsSnapshot,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineEndpoint,
    EngineFacts,
    EngineStatsReport,
    SchedulerStats,
)

logger = logging.getLogger(__name__)


class DPAsyncMPClient(AsyncMPClient):
    """An `AsyncMPClient` over several engine ranks, with the coordinator's stats stream.

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
        # Elastic-EP events seen on EEP_NOTIFICATION_CALL_ID, latest last.
        self.eep_scaling_cache: list[Sequence[Any]] = []
        # Called with a rank's index when this client learns it lost that rank (a cluster
        # link reports it at once).
        self.on_engine_lost: Callable[[int], None] | None = None
        # Each attached rank's load as the coordinator last published it (`latest_stats`).
        self._latest_stats: dict[int, SchedulerStats] = {}
        super().__init__(endpoints, **kwargs)
        # Ranks that may take new requests: attached and not known dead.
        self.lb_engines: list[int] = sorted(self.engines)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # started lazily, with the output task
        else:
            self._ensure_stats_update_task()

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
            endpoint = self.engines.get(rank)
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
        return {r: s for r, s in self._latest_stats.items() if r in self.engines}

    def _is_detached_by(self, report: EngineStatsReport) -> bool:
        """Whether a report of an engine this client is attached to says it is not (anymore).

        Only a report that reflects this client's attach counts: one measured before it would
        not list the client yet.
        """
        facts = self.engine_facts.get(report.engine_index)
        return (
            facts is not None
            and 0 < facts.attach_serial <= report.attaches_seen
            and self.client_index not in report.attached_clients
            and report.engine_index not in self.resources.dead_engines
        )

    def _on_rank_stats(self, rank: int, stats: SchedulerStats, requests_seen: int) -> None:
        """Hook for subclasses: one rank's load, measured after it had taken in
        `requests_seen` of this client's requests."""

    def _on_engine_lost(self, engine_index: int) -> None:
        self._stop_routing_to(engine_index)
        if self.on_engine_lost is not None:
            self.on_engine_lost(engine_index)
        super()._on_engine_lost(engine_index)

    async def add_engine_async(
        self, endpoint: EngineEndpoint, process: BaseProcess | None = None
    ) -> EngineFacts:
        facts = await super().add_engine_async(endpoint, process)
        self._start_routing_to(endpoint.engine_index)
        return facts

    async def reattach_engine_async(
        self, engine_index: int, *, detach_on_failure: bool = True
    ) -> EngineFacts:
        facts = await super().reattach_engine_async(
            engine_index, detach_on_failure=detach_on_failure
        )
        self._start_routing_to(engine_index)
        return facts

    def _start_routing_to(self, engine_index: int) -> None:
        if engine_index not in self.lb_engines:
            self.lb_engines = sorted([*self.lb_engines, engine_index])

    def remove_engine(self, engine_index: int) -> None:
        self._stop_routing_to(engine_index)
        super().remove_engine(engine_index)

    def _stop_routing_to(self, engine_index: int) -> None:
        """Takes a rank out of `lb_engines` (it died, leaves, or was removed)."""
        self.lb_engines = [r for r in self.lb_engines if r != engine_index]

    async def eep_process_engine_core_notification(self, notification: Sequence[Any]) -> None:
        """Records an elastic-EP event `(kind, payload)` sent by an engine."""
        logger.info("elastic EP notification: %s", notification)
        self.eep_scaling_cache.append(notification)


class DPLBAsyncMPClient(DPAsyncMPClient):
    """Routes each request to the least-loaded rank (the policy's docstring is the algorithm).

    Args:
        endpoints, stats_address, **kwargs: as for `DPAsyncMPClient`.
        policy: the load-balancing policy; default `LeastLoadedPolicy()`.
    """

    def __init__(
        self,
        endpoints: Sequence[EngineEndpoint],
        *,
        policy: LoadBalancePolicy | None = None,
        **kwargs: Any,
    ) -> None:
        self.policy = policy or LeastLoadedPolicy()
        super().__init__(endpoints, **kwargs)

    def get_core_engine_for_request(self, request: EngineCoreRequest) -> int:
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
        routable = self.routable_ranks()
        if not routable:
            raise EngineDeadError("no engine rank is serving")
        return self.policy.choose(routable)

    async def _wait_for_a_rank(self) -> bool:
        """Waits (`wait_for_engines`) for a routable rank, if ranks may come back."""
        resources = self.resources
        return await wait_for_engines(
            lambda: bool(self.routable_ranks()), lambda: resources.engines_can_return
        )

    def routable_ranks(self) -> list[int]:
        """The ranks a new request may go to now: in `lb_engines` and not lost."""
        return [r for r in self.lb_engines if r not in self.resources.dead_engines]

    def rank_of(self, request_id: str) -> int | None:
        """The rank serving an in-flight request of this client."""
        return self.policy.rank_of(request_id)

    async def add_request_async(
        self, request: EngineCoreRequest, engine: bytes | None = None
    ) -> None:
        try:
            rank = self.get_core_engine_for_request(request)
        except EngineDeadError:
            # Every rank is down here; wait for one a cluster link is attaching again.
            if not await self._wait_for_a_rank():
                raise
            rank = self.get_core_engine_for_request(request)
        # The DP wave last published: lets an expert-parallel rank tell a request that raced
        # the end of a wave.
        request.current_wave = self.current_wave
        self.policy.on_sent(request.request_id, rank, len(request.prompt_token_ids))
        try:
            await super().add_request_async(request, self.engines[rank].identity)
        except BaseException:
            self.policy.on_aborted([request.request_id])
            raise

    async def abort_requests_async(
        self, request_ids: list[str], engine: bytes | None = None
    ) -> None:
        """Sends each abort to the rank that owns the request."""
        by_rank: dict[int, list[str]] = defaultdict(list)
        for request_id in request_ids:
            rank = self.policy.rank_of(request_id)
            if rank is not None:
                by_rank[rank].append(request_id)
        self.policy.on_aborted(request_ids)
        for rank, ids in by_rank.items():
            if rank in self.engines and rank not in self.resources.dead_engines:
                await super().abort_requests_async(ids, self.engines[rank].identity)

    async def process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Keeps the in-flight map and the policy's view of the sending rank current."""
        for output in outputs.outputs:
            self.policy.on_output(output.request_id, output.finished)
        if outputs.scheduler_stats is not None:
            self.policy.on_stats(
                outputs.engine_index, outputs.scheduler_stats, outputs.requests_seen
            )

    def _on_rank_stats(self, rank: int, stats: SchedulerStats, requests_seen: int) -> None:
        self.policy.on_stats(rank, stats, requests_seen)

    def _stop_routing_to(self, engine_index: int) -> None:
        super()._stop_routing_to(engine_index)
        self.policy.forget_rank(engine_index)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Calls a utility method on every serving rank; returns the first rank's result."""
        results = await self.call_utility_all_async(method, *args)
        return results[min(results)]

    async def call_utility_all_async(self, method: str, *args: Any) -> dict[int, Any]:
        """Calls a utility method on every serving rank; results by rank.

        Raises:
            EngineDeadError: no rank is serving.
        """
        ranks = self.routable_ranks()
        if not ranks:
            raise EngineDeadError("no engine rank is serving")
        results = await asyncio.gather(
            *(
                self._call_utility_async(method, *args, engine=self.engines[r].identity)
                for r in ranks
            )
        )
        return dict(zip(ranks, results, strict=True))
