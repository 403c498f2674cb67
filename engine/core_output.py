"""The output IO thread of an `EngineCoreProc`: encodes outputs and pushes them to their client.

It owns the per-client PUSH sockets and the stats PUSH, and lends them to the busy loop while it
is idle (`send_or_submit`). The input side — the ROUTER and the client connection state
machine — is `shoal.engine.core_io`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Any

import zmq

from shoal.engine.core_io import close_monitored
from shoal.engine.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineStatsReport,
    UtilityOutput,
)
from shoal.engine.serial import MsgpackEncoder
from shoal.engine.work_items import (
    AttachClient,
    DetachClient,
    EngineDead,
    MoveStats,
    OutputItem,
    ReportStats,
    SendOutputs,
)

logger = logging.getLogger(__name__)

# Stats reports queued for a slow coordinator before new ones are dropped.
STATS_SNDHWM = 64


def make_stats_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    """The PUSH an engine sends its stats reports on, connected to the coordinator.

    Reports are best effort and the latest wins: with no live coordinator (dead, restarting,
    paused) they are dropped — IMMEDIATE queues nothing for a connection not up, and the send
    does not block — never queued until a send blocks the output thread, and with it the
    outputs of every client.
    """
    socket = ctx.socket(zmq.PUSH)
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
        work_queue: the busy loop's `OutputItem`s (`shoal.engine.work_items`).
        ctx: the engine's ZMQ context.
        stats_address: where to push stats reports (`make_stats_socket`); None: no reports.
    """

    def __init__(
        self,
        engine_index: int,
        work_queue: queue.SimpleQueue[OutputItem],
        ctx: zmq.Context,
        stats_address: str | None = None,
    ) -> None:
        super().__init__(name=f"EngineCoreOutput_{engine_index}", daemon=True)
        self._engine_index = engine_index
        self._work_queue = work_queue
        self._stats_socket = (
            None if stats_address is None else make_stats_socket(ctx, stats_address)
        )
        self._stats_address = stats_address
        self._num_stats_dropped = 0
        self._encoder = MsgpackEncoder()
        self._pushes: dict[int, zmq.Socket] = {}
        # (tracker, frames) of zero-copy sends: the frames must outlive ZMQ's use of them.
        self._pending: deque[tuple[zmq.MessageTracker, list[Any]]] = deque()
        self._socket_lock = threading.Lock()
        # Each written by one thread only (the submitter, this thread): equal when every
        # submitted item was handled, so a send from the submitter cannot overtake one.
        self._num_submitted = 0
        self._num_handled = 0

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
                item = self._work_queue.get()
                with self._socket_lock:
                    if not self._handle(item):
                        linger_ms = 200
                        return
                    self._num_handled += 1
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
            case AttachClient(client_index, push, reply):
                self._pushes[client_index] = push
                self._send(client_index, reply)
            case DetachClient(client_index, monitor):
                close_monitored(self._pushes.pop(client_index, None), monitor)
            case ReportStats(report):
                self._send_stats(report)
            case MoveStats(address):
                self._move_stats(address)
            case EngineDead():
                notice = [ENGINE_CORE_DEAD, str(self._engine_index).encode()]
                for push in self._pushes.values():
                    push.send_multipart(notice)
                # Enough for connected clients; one that is away learns from its own monitor.
                return False
        return True

    def _send(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        push = self._pushes.get(client_index)
        if push is None:
            return  # the client detached; nobody is waiting for these
        try:
            frames = self._encoder.encode(outputs)
        except TypeError as e:
            utility = outputs.utility_output
            if utility is None:
                raise
            message = f"the result of this call cannot be sent: {e}"
            outputs.utility_output = UtilityOutput(call_id=utility.call_id, failure_message=message)
            frames = self._encoder.encode(outputs)
        if len(frames) == 1:
            push.send(frames[0])
            return
        tracker = push.send_multipart(frames, copy=False, track=True)
        assert tracker is not None, "track=True always returns a tracker"
        self._pending.append((tracker, frames))
        while self._pending and self._pending[0][0].done:
            self._pending.popleft()

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
