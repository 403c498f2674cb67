"""Notices engines that die without saying so, and tells the client's output consumer.

An engine is declared dead when its process (if this client launched it) exits, when the
client's input connection to it drops and does not come back within a grace period, or when
the client is told that the engine no longer counts it attached (`declare_lost`). The notice
is an ENGINE_CORE_DEAD message pushed into the client's own output socket, so the one consumer
of that socket learns of every death the same way. Knows nothing of requests or asyncio.
"""

from __future__ import annotations

import logging
import threading
import time
from multiprocessing.process import BaseProcess

import zmq

from engine.protocol import ENGINE_CORE_DEAD

logger = logging.getLogger(__name__)

# How long an engine's input connection may stay down before the engine counts as dead.
ENGINE_DISCONNECT_GRACE_S = 1.0
_POLL_MS = 100


class EngineMonitor(threading.Thread):
    """Watches engine processes and the input ROUTER's connections; holds no client reference.

    Args:
        ctx: a synchronous context (a shadow of the client's, in asyncio mode).
        router_monitor_address: the inproc address the input ROUTER publishes its events on.
        notify_address: the client's output (PULL) address, where death notices go.
    """

    def __init__(self, ctx: zmq.Context, router_monitor_address: str, notify_address: str) -> None:
        super().__init__(name="EngineMonitor", daemon=True)
        self._ctx = ctx
        self._router_monitor_address = router_monitor_address
        self._notify_address = notify_address
        self._lock = threading.Lock()
        self._index_by_address: dict[str, int] = {}
        self._processes: dict[int, BaseProcess] = {}
        self._deadlines: dict[int, float] = {}
        self._reported: set[int] = set()
        self._stop_event = threading.Event()

    def watch(self, engine_index: int, input_address: str, process: BaseProcess | None) -> None:
        """Starts watching an engine (again, if the index was used before); thread-safe."""
        with self._lock:
            self._index_by_address[input_address] = engine_index
            if process is not None:
                self._processes[engine_index] = process
            self._reported.discard(engine_index)
            self._deadlines.pop(engine_index, None)

    def declare_lost(self, engine_index: int) -> bool:
        """Reports an engine dead on the monitor's next turn (the client learned it otherwise:
        the engine no longer counts it attached); thread-safe.

        Returns:
            False if that death is already reported or about to be (once per attach).
        """
        with self._lock:
            if engine_index in self._reported or self._deadlines.get(engine_index) == 0.0:
                return False
            self._deadlines[engine_index] = 0.0
            return True

    def forget(self, engine_index: int) -> None:
        """Stops watching an engine that is being removed on purpose; thread-safe."""
        with self._lock:
            for address, index in list(self._index_by_address.items()):
                if index == engine_index:
                    del self._index_by_address[address]
            self._processes.pop(engine_index, None)
            self._deadlines.pop(engine_index, None)
            self._reported.add(engine_index)

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        events = self._ctx.socket(zmq.PAIR)
        events.connect(self._router_monitor_address)
        notify = self._ctx.socket(zmq.PUSH)
        notify.setsockopt(zmq.LINGER, 0)
        notify.connect(self._notify_address)
        try:
            while not self._stop_event.is_set():
                poller = zmq.Poller()  # rebuilt each turn: engines come and go
                poller.register(events, zmq.POLLIN)
                with self._lock:
                    sentinels = [p.sentinel for p in self._processes.values()]
                for sentinel in sentinels:
                    poller.register(sentinel, zmq.POLLIN)  # readable once the process exits
                if any(socket is events for socket, _ in poller.poll(_POLL_MS)):
                    self._on_router_events(events)
                for engine_index in self._find_dead():
                    logger.error("engine %d is gone", engine_index)
                    notify.send_multipart([ENGINE_CORE_DEAD, str(engine_index).encode()])
        except zmq.ContextTerminated:
            pass
        finally:
            events.close(linger=0)
            notify.close(linger=0)

    def _on_router_events(self, events: zmq.Socket) -> None:
        while True:
            try:
                event_frame, endpoint = events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = int.from_bytes(event_frame[:2], "little")
            with self._lock:
                engine_index = self._index_by_address.get(endpoint.decode())
                if engine_index is None:
                    continue
                if event == zmq.EVENT_DISCONNECTED:
                    deadline = time.monotonic() + ENGINE_DISCONNECT_GRACE_S
                    self._deadlines.setdefault(engine_index, deadline)
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._deadlines.pop(engine_index, None)

    def _find_dead(self) -> list[int]:
        now = time.monotonic()
        with self._lock:
            dead = {i for i, deadline in self._deadlines.items() if deadline <= now}
            dead |= {i for i, p in self._processes.items() if p.exitcode is not None}
            dead -= self._reported
            self._reported |= dead
            for engine_index in dead:
                self._deadlines.pop(engine_index, None)
                self._processes.pop(engine_index, None)
        return sorted(dead)
