"""`BackgroundResources`: what an engine-core client must release, held apart from the client.

It is the client's `weakref.finalize` callback, so it must never reference the client: then
dropping the last reference to a client closes its sockets, stops its output task or thread,
its engine monitor and the engine processes it launched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from shoal.client.transport.engine_monitor import EngineMonitor
from shoal.client.transport.engine_set import EngineIdentity, EngineSet
from shoal.engine.core.curve import ClientCurve
from shoal.engine.core.engine_process import stop_engine_process
from shoal.engine.protocol import EngineCoreRequestType

logger = logging.getLogger(__name__)

# How long close() lets GOODBYE messages drain.
CLOSE_LINGER_MS = 1000


@dataclass
class BackgroundResources:
    """Everything a client must release; holds no reference to the client itself.

    It is the client's `weakref.finalize` callback, so dropping the last reference to the client
    closes the sockets, stops the output task or thread and the engine processes it launched.
    The engine set it holds is only read here, to say GOODBYE to the live engines and to stop
    the processes this client launched.
    """

    ctx: zmq.Context
    engines: EngineSet
    input_socket: zmq.Socket | None = None
    output_socket: zmq.Socket | None = None
    engine_monitor: EngineMonitor | None = None
    output_queue_task: Any = None  # asyncio.Task, asyncio mode only
    output_reader: tuple[Any, int] | None = None  # (loop, fd) the output task reads through
    stats_update_task: Any = None  # asyncio.Task of a DP client's stats subscription
    stats_socket: zmq.Socket | None = None  # that subscription's socket
    output_thread: threading.Thread | None = None
    curve: ClientCurve | None = None  # its ZAP handler thread answers on this context
    # (tracker, objects) of zero-copy sends: the tensors must outlive ZMQ's use of them.
    pending_messages: deque[tuple[zmq.MessageTracker, Any]] = field(default_factory=deque)
    # asyncio tasks the output task started (EEP notification handlers, re-attaches).
    side_tasks: set[Any] = field(default_factory=set)
    ipc_path: str | None = None  # the output socket's file, removed on close
    is_output_done: bool = False  # the sync output thread ended: its last error is terminal
    is_closed: bool = False

    def remove_output_reader(self) -> None:
        """Unregisters the output task's FD reader (idempotent); before the socket closes.

        A reader left behind on a closed FD would capture a later FD with the same number.
        Like zmq.asyncio's own close, this may run in the thread that closes the client.
        """
        reader, self.output_reader = self.output_reader, None
        if reader is not None:
            loop, fd = reader
            if not loop.is_closed():
                loop.remove_reader(fd)

    def add_pending(self, tracker: zmq.MessageTracker, objects: Any) -> None:
        pending = self.pending_messages
        while pending and pending[0][0].done:
            pending.popleft()
        pending.append((tracker, objects))

    def __call__(self) -> None:
        """Closes everything (idempotent): GOODBYE to engines, sockets, processes, context."""
        if self.is_closed:
            return
        self.is_closed = True
        for task in (self.output_queue_task, self.stats_update_task, *self.side_tasks):
            if task is not None and not task.done():
                loop = task.get_loop()
                if not loop.is_closed():
                    loop.call_soon_threadsafe(task.cancel)
        threads: list[threading.Thread] = []
        output_thread = self.output_thread
        if output_thread is not None and output_thread is not threading.current_thread():
            # First: it reads the output socket, which is touched below, and it sees
            # `is_closed` within one receive timeout. One socket, one thread at a time.
            output_thread.join(timeout=2)
        for socket in (self.input_socket, self.output_socket):
            if socket is not None and not socket.closed:
                # Before the monitor thread closes its ends: an event sent to a closed monitor
                # reader blocks libzmq's I/O thread for good (libzmq#3575), and `ctx.term()`
                # with it.
                zmq.Socket.shadow(socket.underlying).disable_monitor()
        if self.engine_monitor is not None:
            self.engine_monitor.stop()
            threads.append(self.engine_monitor)
        if self.output_thread is not None:
            threads.append(self.output_thread)
        if self.input_socket is not None:
            router: zmq.Socket = zmq.Socket.shadow(self.input_socket.underlying)
            for index, endpoint in self.engines.endpoints().items():
                if not self.engines.is_dead(index):
                    send_goodbye(router, endpoint.identity)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2)
        self.remove_output_reader()
        close_socket(self.output_socket, linger=0)
        close_socket(self.stats_socket, linger=0)
        close_socket(self.input_socket, linger=CLOSE_LINGER_MS)
        if self.ipc_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.ipc_path)
        for index in self.engines.indices():
            process = self.engines.process(index)
            if process is not None:  # launched by this client
                stop_engine_process(process)
        # Its ZAP handler too, before the context ends (`ZapHandler.close`).
        is_zap_stopped = self.curve is None or self.curve.close()
        if not is_zap_stopped or any(
            t.is_alive() and t is not threading.current_thread() for t in threads
        ):
            logger.warning("client background threads did not stop; leaving the ZMQ context open")
            return
        self.ctx.term()


def send_goodbye(router: zmq.Socket, identity: EngineIdentity) -> None:
    # If the engine is already unreachable, it notices the lost connection instead.
    with contextlib.suppress(zmq.ZMQError):
        router.send_multipart((identity, EngineCoreRequestType.GOODBYE.value), flags=zmq.NOBLOCK)


def close_socket(socket: zmq.Socket | None, linger: int) -> None:
    if socket is None or socket.closed:
        return
    try:
        socket.close(linger=linger)
    except RuntimeError:  # an asyncio socket whose event loop is already closed
        zmq.Socket.shadow(socket.underlying).close(linger=linger)
