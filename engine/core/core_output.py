"""The output IO thread of an `EngineCoreProc`: encodes outputs and pushes them to their client.

It owns the per-client PUSH sockets and the stats PUSH, and lends them to the busy loop while it
is idle (`send_or_submit`). The input side is `shoal.engine.core.core_io` (the ROUTER) and
`shoal.engine.core.client_table` (the client connection state machine).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import zmq

from shoal.engine.core.client_table import close_monitored
from shoal.engine.core.curve import CurveKeyPair, EngineKeys, curve_client
from shoal.engine.core.rate_limit import LogRateLimiter
from shoal.engine.core.work_items import (
    AttachClient,
    DetachClient,
    EngineDead,
    MoveStats,
    OutputItem,
    ReportStats,
    SendOutputs,
)
from shoal.engine.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineStatsReport,
    UtilityOutput,
)
from shoal.engine.serial import MsgpackEncoder

logger = logging.getLogger(__name__)

# Stats reports queued for a slow coordinator before new ones are dropped.
STATS_SNDHWM = 64
# A client whose PUSH queue is full (OUTPUT_SNDHWM in `shoal.engine.core.client_table`) gets a backlog
# of at most this many messages, kept for as long as its socket takes a message at least
# this often; past either, the client is detached and its requests aborted.
MAX_BACKLOG_MESSAGES = 1000
SEND_TIMEOUT_S = 5.0
# How often a backlog is offered to its socket again.
_BACKLOG_RETRY_S = 0.02
_NOBLOCK = int(zmq.NOBLOCK)


def make_stats_socket(
    ctx: zmq.Context, address: str, keys: tuple[CurveKeyPair, bytes] | None = None
) -> zmq.Socket:
    """The PUSH an engine sends its stats reports on, connected to the coordinator.

    Reports are best effort and the latest wins: with no live coordinator (dead, restarting,
    paused) they are dropped — IMMEDIATE queues nothing for a connection not up, and the send
    does not block — never queued until a send blocks the output thread, and with it the
    outputs of every client. With `keys` (the engine's key pair, the coordinator's public
    key) it is a CURVE client: only the coordinator can take the reports, and it takes them
    only from the cluster's engines.
    """
    socket = ctx.socket(zmq.PUSH)
    if keys is not None:
        curve_client(socket, *keys)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IMMEDIATE, 1)
    socket.setsockopt(zmq.SNDHWM, STATS_SNDHWM)
    socket.connect(address)
    return socket


class OutputThread(threading.Thread):
    """Encodes and pushes outputs to the client that owns them; sends stats reports.

    The busy loop hands it work with `submit`, or with `send_or_submit`, which sends at once
    from the calling thread when nothing submitted is still unsent: that saves a thread hop
    (tens of microseconds) on every idle engine's reply. A lock held around every use of the
    sockets keeps one thread at a time on them and is the memory barrier ZMQ asks for when a
    socket changes threads; the counters keep the order of sends.

    Args:
        engine_index: stamped on the death notice.
        work_queue: the busy loop's `OutputItem`s (`shoal.engine.core.work_items`).
        ctx: the engine's ZMQ context.
        stats_address: where to push stats reports (`make_stats_socket`); None: no reports.
        lagging_clients: where to post (client index, attach serial) of a client that does
            not take its outputs in time; the input thread detaches it.
        stats_keys: with CURVE, the engine's key pair and the coordinator's public key.

    No send blocks: a client's messages that its socket does not take wait in a bounded
    backlog of their own, in order, and a client whose backlog overflows or does not move for
    SEND_TIMEOUT_S is let go. Every other client streams on meanwhile.
    """

    def __init__(
        self,
        engine_index: int,
        work_queue: queue.SimpleQueue[OutputItem],
        ctx: zmq.Context,
        stats_address: str | None = None,
        lagging_clients: queue.SimpleQueue[tuple[int, int | None]] | None = None,
        stats_keys: tuple[CurveKeyPair, bytes] | None = None,
    ) -> None:
        super().__init__(name=f"EngineCoreOutput_{engine_index}", daemon=True)
        self._engine_index = engine_index
        self._work_queue = work_queue
        self._stats_socket = (
            None if stats_address is None else make_stats_socket(ctx, stats_address, stats_keys)
        )
        self._stats_address = stats_address
        self._num_stats_dropped = 0
        self._encoder = MsgpackEncoder()
        self._pushes: dict[int, zmq.Socket] = {}
        self._attach_serials: dict[int, int] = {}
        # client index → frames its socket did not take yet, and when it last took any.
        self._backlogs: dict[int, deque[list[Any]]] = {}
        self._backlog_moved_at: dict[int, float] = {}
        self._lagging: set[int] = set()  # reported, not yet detached: their outputs are dropped
        self._lagging_clients = lagging_clients
        self._warnings = LogRateLimiter(logger)
        # (tracker, frames) of zero-copy sends: the frames must outlive ZMQ's use of them.
        self._pending: deque[tuple[zmq.MessageTracker, list[Any]]] = deque()
        self._socket_lock = threading.Lock()
        # Each written by one thread only (the submitter, this thread): equal when every
        # submitted item was handled, so a send from the submitter cannot overtake one.
        self._num_submitted = 0
        self._num_handled = 0

    @classmethod
    def for_engine(
        cls,
        engine_index: int,
        ctx: zmq.Context,
        stats_address: str | None,
        lagging_clients: queue.SimpleQueue[tuple[int, int | None]],
        keys: EngineKeys | None,
    ) -> OutputThread:
        """An engine's output thread; with CURVE keys, its stats go only to the coordinator."""
        stats_keys = None
        if keys is not None and keys.coordinator is not None:
            stats_keys = (keys.engine, keys.coordinator)
        return cls(
            engine_index,
            queue.SimpleQueue(),
            ctx,
            stats_address,
            lagging_clients=lagging_clients,
            stats_keys=stats_keys,
        )

    def submit(self, item: OutputItem) -> None:
        """Queues an item for this thread. Call from one thread only (the busy loop)."""
        self._num_submitted += 1
        self._work_queue.put(item)

    def send_or_submit(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        """Sends `outputs` from the calling thread if this one is idle, else queues them.

        Call from the thread that calls `submit`.
        """
        if self._num_handled == self._num_submitted and self._socket_lock.acquire(blocking=False):
            try:
                self._send(client_index, outputs)
            finally:
                self._socket_lock.release()
            return
        self.submit(SendOutputs(client_index, outputs))

    def run(self) -> None:
        linger_ms = 0
        try:
            while True:
                try:
                    item = self._work_queue.get(
                        timeout=_BACKLOG_RETRY_S if self._backlogs else None
                    )
                except queue.Empty:
                    with self._socket_lock:
                        self._flush_backlogs()
                    continue
                with self._socket_lock:
                    if not self._handle(item):
                        linger_ms = 200
                        return
                    self._num_handled += 1
                    if self._backlogs:
                        self._flush_backlogs()
        except Exception:
            logger.exception("engine %d output thread failed", self._engine_index)
        finally:
            with self._socket_lock:
                for push in self._pushes.values():
                    # Readers of attached clients' monitors close with the context.
                    close_monitored(push, None, linger_ms)
                if self._stats_socket is not None:
                    self._stats_socket.close(linger=0)

    def _handle(self, item: OutputItem) -> bool:
        """Carries out one item; False after the death notice (the thread stops)."""
        match item:
            case SendOutputs(client_index, outputs):
                self._send(client_index, outputs)
            case AttachClient(client_index, push, reply, attach_serial):
                self._forget(client_index)
                self._pushes[client_index] = push
                self._attach_serials[client_index] = attach_serial
                self._send(client_index, reply)
            case DetachClient(client_index, monitor):
                close_monitored(self._pushes.pop(client_index, None), monitor)
                self._forget(client_index)
            case ReportStats(report):
                self._send_stats(report)
            case MoveStats(address):
                self._move_stats(address)
            case EngineDead():
                notice = [ENGINE_CORE_DEAD, str(self._engine_index).encode()]
                for push in self._pushes.values():
                    # A client that takes nothing now learns it from its own monitor.
                    with contextlib.suppress(zmq.ZMQError):
                        push.send_multipart(notice, _NOBLOCK)
                # Enough for connected clients; one that is away learns from its own monitor.
                return False
        return True

    def _send(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        push = self._pushes.get(client_index)
        if push is None or client_index in self._lagging:
            return  # the client detached (or is being let go); nobody is waiting for these
        try:
            frames = self._encoder.encode(outputs)
        except TypeError as e:
            utility = outputs.utility_output
            if utility is None:
                raise
            message = f"the result of this call cannot be sent: {e}"
            outputs.utility_output = UtilityOutput(call_id=utility.call_id, failure_message=message)
            frames = self._encoder.encode(outputs)
        backlog = self._backlogs.get(client_index)
        if backlog is not None:  # behind older messages: in order, after them
            backlog.append(frames)
            if len(backlog) > MAX_BACKLOG_MESSAGES:
                self._let_go(client_index, f"more than {MAX_BACKLOG_MESSAGES} messages behind")
            return
        if not self._try_send(push, frames):
            self._backlogs[client_index] = deque([frames])
            self._backlog_moved_at[client_index] = time.monotonic()

    def _try_send(self, push: zmq.Socket, frames: list[Any]) -> bool:
        """Sends without blocking; False if the socket takes nothing now (its queue is full)."""
        try:
            if len(frames) == 1:
                push.send(frames[0], _NOBLOCK)
                return True
            tracker = push.send_multipart(frames, _NOBLOCK, copy=False, track=True)
        except zmq.Again:
            return False
        assert tracker is not None, "track=True always returns a tracker"
        self._pending.append((tracker, frames))
        while self._pending and self._pending[0][0].done:
            self._pending.popleft()
        return True

    def _flush_backlogs(self) -> None:
        """Offers every backlog to its socket again; lets go of clients whose did not move."""
        now = time.monotonic()
        for client_index, backlog in list(self._backlogs.items()):
            push = self._pushes[client_index]
            moved = False
            while backlog and self._try_send(push, backlog[0]):
                backlog.popleft()
                moved = True
            if not backlog:
                self._backlogs.pop(client_index)
                self._backlog_moved_at.pop(client_index)
            elif moved:
                self._backlog_moved_at[client_index] = now
            elif now - self._backlog_moved_at[client_index] > SEND_TIMEOUT_S:
                self._let_go(client_index, f"its socket took nothing for {SEND_TIMEOUT_S:.0f} s")

    def _let_go(self, client_index: int, reason: str) -> None:
        """Drops a lagging client's backlog and asks the input thread to detach it."""
        self._warnings.warning(
            "lagging",
            "engine %d lets client %d go: %s",
            self._engine_index,
            client_index,
            reason,
        )
        self._backlogs.pop(client_index, None)
        self._backlog_moved_at.pop(client_index, None)
        self._lagging.add(client_index)
        if self._lagging_clients is not None:
            self._lagging_clients.put((client_index, self._attach_serials[client_index]))

    def _forget(self, client_index: int) -> None:
        self._attach_serials.pop(client_index, None)
        self._backlogs.pop(client_index, None)
        self._backlog_moved_at.pop(client_index, None)
        self._lagging.discard(client_index)

    def _send_stats(self, report: EngineStatsReport) -> None:
        if self._stats_socket is None:
            return
        try:
            self._stats_socket.send(self._encoder.encode(report)[0], zmq.NOBLOCK)
        except zmq.Again:
            if not self._num_stats_dropped:
                logger.warning(
                    "engine %d: the coordinator does not take stats reports; dropping them",
                    self._engine_index,
                )
            self._num_stats_dropped += 1
            return
        if self._num_stats_dropped:
            logger.info(
                "engine %d: stats reports flow again (%d dropped)",
                self._engine_index,
                self._num_stats_dropped,
            )
            self._num_stats_dropped = 0

    def _move_stats(self, address: str) -> None:
        if self._stats_socket is None or address == self._stats_address:
            return
        if self._stats_address is not None:
            self._stats_socket.disconnect(self._stats_address)
        self._stats_socket.connect(address)
        logger.info("engine %d: stats reports now go to %s", self._engine_index, address)
        self._stats_address = address
