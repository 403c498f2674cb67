"""`EngineConnections`: the client's input ROUTER connected to engines, and taken off them.

Connecting an engine admits its CURVE key, names the connection by the engine's identity and
puts the engine in the set (ATTACHING) under the monitor's watch; the HELLO that makes it
ATTACHED is `shoal.client.transport.attach_driver`'s. Removing one says GOODBYE (unless it is
counted dead), disconnects, fails its pending calls, stops a process this client launched for
it, and emits `engine_removed`.
"""

from __future__ import annotations

import time
from multiprocessing.process import BaseProcess

import zmq

from shoal.client.transport.background_resources import CLOSE_LINGER_MS, send_goodbye
from shoal.client.transport.engine_monitor import EngineMonitor
from shoal.client.transport.engine_set import EngineIdentity, EngineSet
from shoal.client.transport.events import ClientEvents
from shoal.client.transport.output_dispatch import PendingCalls
from shoal.engine.core.curve import ClientCurve, attach_refusal
from shoal.engine.core.engine_process import stop_engine_process
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import EngineEndpoint

# How long an engine's identity stays off limits to a new connection after its connection was
# closed: libzmq aborts the process when a connection takes a routing id that a closing one
# still holds (libzmq#1572), and a closing connection lingers up to CLOSE_LINGER_MS while it
# still has sends queued for a peer that does not take them.
SAME_IDENTITY_RECONNECT_S = CLOSE_LINGER_MS / 1000 + 0.2


class EngineAttachError(RuntimeError):
    """An engine refused this client at HELLO (protocol version, client index in use)."""


class EngineConnections:
    """The input ROUTER's connections to one client's engines.

    Args:
        input_socket: the client's ROUTER.
        curve: the client's CURVE keys and their sockets' security (None: no CURVE).
        engines: the client's engine set.
        monitor: the client's engine monitor.
        calls: the client's pending calls.
        events: where `engine_removed` is emitted.
    """

    def __init__(
        self,
        input_socket: zmq.Socket,
        curve: ClientCurve | None,
        engines: EngineSet,
        monitor: EngineMonitor,
        calls: PendingCalls,
        events: ClientEvents,
    ) -> None:
        self._router = input_socket
        self._curve = curve
        self._engines = engines
        self._monitor = monitor
        self._calls = calls
        self._events = events
        # Identities whose connection this client closed lately, and when.
        self._disconnected_at: dict[EngineIdentity, float] = {}

    def reconnect_wait_s(self, identity: EngineIdentity) -> float:
        """How long to wait before connecting to `identity` (see SAME_IDENTITY_RECONNECT_S)."""
        at = self._disconnected_at.get(identity)
        return 0.0 if at is None else max(0.0, at + SAME_IDENTITY_RECONNECT_S - time.monotonic())

    def connect(self, endpoint: EngineEndpoint, process: BaseProcess | None) -> None:
        """Connects to an engine and adds it to the set (ATTACHING); waits first, blocking,
        while its identity is off limits (an asyncio caller waited already).

        Raises:
            EngineAttachError: the engine has no CURVE key where this client has one, or the
                other way round.
            ValueError: an engine with this index is already in the set.
        """
        index = endpoint.engine_index
        refusal = attach_refusal(index, endpoint.public_key, self._curve is not None)
        if refusal is not None:
            raise EngineAttachError(refusal)
        if index in self._engines:
            raise ValueError(f"engine {index} is already attached; remove it first")
        time.sleep(self.reconnect_wait_s(endpoint.identity))
        self._engines.attach(endpoint, process)
        self._monitor.watch(index, is_new_attach=True)
        router: zmq.Socket = zmq.Socket.shadow(self._router.underlying)
        if self._curve is not None:
            self._curve.admit_engine(router, index, endpoint.public_key)
        router.setsockopt(zmq.CONNECT_ROUTING_ID, endpoint.identity)
        router.connect(endpoint.input_address)

    def remove(self, engine_index: int) -> None:
        """Detaches an engine on purpose: GOODBYE, disconnect, its pending calls fail.

        Raises:
            ValueError: no engine with this index is attached.
        """
        endpoint, process, was_dead = self._engines.remove(engine_index)
        self._monitor.forget(engine_index)
        router: zmq.Socket = zmq.Socket.shadow(self._router.underlying)
        if not was_dead:
            send_goodbye(router, endpoint.identity)
        router.disconnect(endpoint.input_address)
        now = time.monotonic()
        self._disconnected_at = {
            identity: at
            for identity, at in self._disconnected_at.items()
            if at > now - SAME_IDENTITY_RECONNECT_S
        }
        self._disconnected_at[endpoint.identity] = now
        error = EngineDeadError("it was removed from this client", engine_index=engine_index)
        self._calls.fail(engine_index, error)
        if process is not None:
            stop_engine_process(process)
        self._events.engine_removed.emit(engine_index, was_dead)
