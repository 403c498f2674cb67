"""`DPAsyncMPClient`: an asyncio client over many engine ranks, with the coordinator's stats.

It subscribes to the coordinator's stats (`_ensure_stats_update_task`), answers `lb_engines`,
the ranks that may take new requests, from its engine set, and hears the ranks' elastic
notifications. How a request picks its rank is `shoal.client.routing`'s
(`DPLBAsyncMPClient`). It knows no Ray: the cluster link tells it when ranks come and go.
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

from shoal.client.transport.async_mp_client import AsyncMPClient
from shoal.client.transport.events import AsyncEvent, Event
from shoal.engine.parallel.elastic import RECONFIGURED, SHUTDOWN_COMPLETE, ScaleNotice
from shoal.engine.protocol import (
    DPStatsSnapshot,
    EngineEndpoint,
    EngineStatsReport,
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
        # After an elastic notification is handled: (kind, notice) (a cluster link listens).
        self.scaled: Event[[str, ScaleNotice]] = Event()
        # A rank that left released these requests of this client (a router moves them).
        self.rank_released: AsyncEvent[[int, list[str]]] = AsyncEvent()
        # The elastic notifications received, oldest first: (kind, epoch, rank).
        self.scale_notices: deque[tuple[str, int, int]] = deque(maxlen=_NOTICES_KEPT)
        # The most clients any rank's latest report lists as attached (this one included).
        self.num_attached_clients = 1
        super().__init__(endpoints, **kwargs)
        self.events.engine_dead.subscribe(self._forget_stats)
        self.events.engine_removed.subscribe(self._forget_removed_stats)
        self.events.scale_notice.subscribe(self._on_scale_notice)
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
        reports it to the registry at once): the `engine_dead` event."""
        self.events.engine_dead.subscribe(listener)

    def set_rank_draining(self, engine_index: int, is_draining: bool) -> None:
        """Stops (or, for a resize rolled back, resumes) routing new requests to a rank; its
        requests in flight keep streaming (see `EngineSet`)."""
        self.engine_set.set_draining(engine_index, is_draining)

    def add_scale_listener(self, listener: Callable[[str, ScaleNotice], None]) -> None:
        """Calls `listener(kind, notice)` for every elastic notification, once handled (a
        cluster link reads the membership again at once)."""
        self.scaled.subscribe(listener)

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
                self._attach.let_go(rank, "its stats no longer list this client")
                continue
            self.num_attached_clients = max(1, len(report.attached_clients))
            self._latest_stats[rank] = report.stats
            seen = report.requests_seen.get(self.client_index, 0)
            self.events.stats.emit(rank, report.stats, seen)

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

    def _forget_stats(self, engine_index: int) -> None:
        """A rank died: its published load is no longer its."""
        self._latest_stats.pop(engine_index, None)

    def _forget_removed_stats(self, engine_index: int, was_dead: bool) -> None:
        self._forget_stats(engine_index)

    def _on_scale_notice(self, notification: Sequence[Any]) -> None:
        """Handles an elastic notification in a side task (it may wait for hand-overs)."""
        side_tasks = self.resources.side_tasks
        task = asyncio.create_task(self.eep_process_engine_core_notification(notification))
        side_tasks.add(task)
        task.add_done_callback(side_tasks.discard)

    async def eep_process_engine_core_notification(self, notification: Sequence[Any]) -> None:
        """Handles an elastic notification `(kind, ScaleNotice)` sent on
        `EEP_NOTIFICATION_CALL_ID` (the protocol is in `shoal.engine.parallel.elastic`).

        SHUTDOWN_COMPLETE: the rank takes no new requests, and `rank_released` is emitted for
        the requests it released (a router hands them over). RECONFIGURED: a resize
        committed. Either way `scaled` is emitted (a cluster link follows the registry's
        membership from there).
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
            await self.rank_released.emit(notice.rank, notice.request_ids)
        self.scaled.emit(kind, notice)
