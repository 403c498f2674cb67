"""Notices engines that die without saying so, and tells the client's output consumer.

An engine is declared dead when its process (if this client launched it) exits, when the
client's input connection to it drops and does not come back within a grace period, or when
the client is told that the engine no longer counts it attached (`declare_lost`). An engine
lost while its process lives is reported again when that process exits, so a client waiting
for it to come back learns it never will. The notice is an ENGINE_CORE_DEAD message pushed
into the client's own output socket, so the one consumer of that socket learns of every death
the same way.

The monitor also says when the client may have been let go without a word
(`RECHECK_ATTACHED`): an engine's connection to the client's output socket dropped (an engine
lets go of a client it took for dead, one paused past its heartbeat timeout, say, by closing
that connection), or the client's input connection to an engine came back within the grace
period (the engine knows a connection by the routing id it gave it, and takes a new one for a
stranger until it says HELLO). The consumer then asks the engines whether they still count it
attached. Knows nothing of requests or asyncio.
"""

from __future__ import annotations

import logging
import threading
import time
from multiprocessing.process import BaseProcess

import zmq

from shoal.client.transport.attach import RECHECK_NOTICE, death_notice
from shoal.client.transport.engine_set import EngineSet

logger = logging.getLogger(__name__)

# How long an engine's input connection may stay down before the engine counts as dead.
ENGINE_DISCONNECT_GRACE_S = 1.0
_POLL_MS = 100


class EngineMonitor(threading.Thread):
    """Watches engine processes and the client's sockets' connections; holds no client reference.

    Which engines there are, their addresses and processes, it reads from the client's
    `EngineSet`; what it keeps itself is only what it detects: connections that are down and
    since when, and the deaths it has already reported.

    Args:
        ctx: a synchronous context (a shadow of the client's, in asyncio mode).
        engines: the client's engine set.
        router_monitor_address: the inproc address the input ROUTER publishes its events on
            (HANDSHAKE_SUCCEEDED, HANDSHAKE_FAILED_AUTH and DISCONNECTED).
        output_monitor_address: the same for the output PULL (DISCONNECTED).
        notify_address: the client's output (PULL) address, where notices go.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        engines: EngineSet,
        router_monitor_address: str,
        output_monitor_address: str,
        notify_address: str,
    ) -> None:
        super().__init__(name="EngineMonitor", daemon=True)
        self._ctx = ctx
        self._engines = engines
        self._router_monitor_address = router_monitor_address
        self._output_monitor_address = output_monitor_address
        self._notify_address = notify_address
        self._lock = threading.Lock()
        self._deadlines: dict[int, float] = {}  # engine → when its down connection counts lost
        self._reported: set[int] = set()  # losses reported (until the engine is watched again)
        self._exits_reported: set[int] = set()  # process exits reported (once per process)
        # Engines that refused this client's key at the CURVE handshake, until attached afresh.
        self._key_refused: set[int] = set()
        self._stop_event = threading.Event()

    def watch(self, engine_index: int, *, is_new_attach: bool) -> None:
        """Starts watching an engine of the set again: a new attach (maybe of a new process
        under a reused index), or an engine counted dead asked HELLO again; thread-safe."""
        with self._lock:
            if is_new_attach:
                self._exits_reported.discard(engine_index)
                self._key_refused.discard(engine_index)
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

    def is_key_refused(self, engine_index: int) -> bool:
        """Whether the engine refused this client's key at the connection's handshake (it was
        never admitted: a HELLO waiting for it fails at once)."""
        return engine_index in self._key_refused

    def forget(self, engine_index: int) -> None:
        """Stops watching an engine that is being removed on purpose; thread-safe."""
        with self._lock:
            self._deadlines.pop(engine_index, None)
            self._reported.add(engine_index)
            self._exits_reported.add(engine_index)

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        router_events = self._ctx.socket(zmq.PAIR)
        router_events.connect(self._router_monitor_address)
        output_events = self._ctx.socket(zmq.PAIR)
        output_events.connect(self._output_monitor_address)
        notify = self._ctx.socket(zmq.PUSH)
        notify.setsockopt(zmq.LINGER, 0)
        notify.connect(self._notify_address)
        try:
            while not self._stop_event.is_set():
                poller = zmq.Poller()  # rebuilt each turn: engines come and go
                poller.register(router_events, zmq.POLLIN)
                poller.register(output_events, zmq.POLLIN)
                for sentinel in [p.sentinel for _, p in self._unreported_processes()]:
                    poller.register(sentinel, zmq.POLLIN)  # readable once the process exits
                ready = {socket for socket, _ in poller.poll(_POLL_MS)}
                is_recheck_due = router_events in ready and self._on_router_events(router_events)
                if output_events in ready and _drain_events(output_events):
                    is_recheck_due = True  # every event subscribed there is a DISCONNECTED
                for engine_index in self._find_dead():
                    logger.error("engine %d is gone, or lost to this client", engine_index)
                    notify.send_multipart(death_notice(engine_index))
                if is_recheck_due:
                    notify.send_multipart(RECHECK_NOTICE)
        except zmq.ContextTerminated:
            pass
        finally:
            router_events.close(linger=0)
            output_events.close(linger=0)
            notify.close(linger=0)

    def _on_router_events(self, events: zmq.Socket) -> bool:
        """Returns whether an input connection came back within its grace period."""
        has_reconnected = False
        for event, endpoint in _drain_events(events):
            engine_index = self._index_of_address(endpoint.decode())
            if engine_index is None:
                continue
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                # The engine's ZAP handler refused this client's key: a HELLO waiting for it
                # fails at once (libzmq does not try that connection again).
                logger.error("engine %d refused this client's key at the handshake", engine_index)
                with self._lock:
                    self._key_refused.add(engine_index)
                continue
            with self._lock:
                if event == zmq.EVENT_DISCONNECTED:
                    deadline = time.monotonic() + ENGINE_DISCONNECT_GRACE_S
                    self._deadlines.setdefault(engine_index, deadline)
                elif self._deadlines.pop(engine_index, None) is not None:  # HANDSHAKE_SUCCEEDED
                    has_reconnected = True
        return has_reconnected

    def _index_of_address(self, input_address: str) -> int | None:
        """The engine connected at `input_address`."""
        for index, endpoint in self._engines.endpoints().items():
            if endpoint.input_address == input_address:
                return index
        return None

    def _find_dead(self) -> list[int]:
        now = time.monotonic()
        processes = self._unreported_processes()
        with self._lock:
            lost = {i for i, deadline in self._deadlines.items() if deadline <= now}
            exited = {i for i, p in processes if p.exitcode is not None}
            for engine_index in lost:
                del self._deadlines[engine_index]
            self._exits_reported |= exited  # reported once, even after a loss
            dead = (lost - self._reported) | exited
            self._reported |= dead
        return sorted(dead)

    def _unreported_processes(self) -> list[tuple[int, BaseProcess]]:
        """The set's launched processes whose exit is not reported yet."""
        indices = self._engines.indices()
        with self._lock:
            watched = [i for i in indices if i not in self._exits_reported]
        return [(i, p) for i in watched if (p := self._engines.process(i)) is not None]


def _drain_events(events: zmq.Socket) -> list[tuple[int, bytes]]:
    """The (event, endpoint) pairs waiting on a socket monitor's reader."""
    drained: list[tuple[int, bytes]] = []
    while True:
        try:
            event_frame, endpoint = events.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return drained
        drained.append((int.from_bytes(event_frame[:2], "little"), endpoint))
