"""The engine's table of attached clients: the HELLO handshake on the engine's side and the
state machine of each client connection (`ClientConnection`).

The input thread (`shoal.engine.core.core_io`) owns a `ClientTable` and is its only caller: it
hands over HELLOs and monitor events, and asks for expiries on each turn. An accepted HELLO
becomes an `AttachClient` for the busy loop (which hands the client's PUSH to the output
thread), a detach a `DetachClient`; refusals are answered here, on a short-lived PUSH.
"""

from __future__ import annotations

import logging
import queue
import time
import uuid
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

from shoal.engine.core.curve import (
    CurveKeyPair,
    KeyRing,
    client_index_of,
    client_key_name,
    curve_client,
    peer_name,
)
from shoal.engine.core.rate_limit import LogRateLimiter
from shoal.engine.core.work_items import AttachClient, DetachClient, InputItem, SendOutputs
from shoal.engine.protocol import (
    PROTOCOL_VERSION,
    EngineCoreOutputs,
    EngineFacts,
    EngineHello,
    UtilityOutput,
    UtilityResult,
)
from shoal.engine.serial import MsgpackDecoder, MsgpackEncoder, tag_structs

logger = logging.getLogger(__name__)

# How long a client's output connection may stay down before the client counts as gone.
DISCONNECT_GRACE_S = 1.5
# How long a newly attached client has to accept the engine's output connection.
CONNECT_GRACE_S = 5.0
# ZMTP heartbeats on output connections, so a silent (partitioned) client is noticed too.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
# Messages ZMQ queues for one client before a send would block; the output thread then keeps
# a bounded backlog of its own for a while (`shoal.engine.core.core_output`).
OUTPUT_SNDHWM = 1000
# The most clients attached to one engine at once; a HELLO beyond it is refused.
MAX_ATTACHED_CLIENTS = 256
# Refused HELLOs answered per second at most: each answer opens a connection to the address
# the HELLO named, and a flood of them must not take the engine's descriptors.
MAX_REFUSALS_PER_S = 20


def close_monitored(
    socket: zmq.Socket | None, monitor: zmq.Socket | None, linger_ms: int = 0
) -> None:
    """Closes a monitored socket and its monitor's reader (either may be None), safely.

    Monitoring stops first: an event sent to a reader that is already closed blocks libzmq's
    I/O thread for good (libzmq#3575), and with it every socket of the context.
    """
    if socket is not None:
        socket.disable_monitor()
    if monitor is not None:
        monitor.close(linger=0)
    if socket is not None:
        socket.close(linger=linger_ms)


class ClientConnection:
    """One attached client, as the engine's input thread sees it.

    State machine (the input thread is the only writer):

        (no HELLO) ──HELLO ok──▶ CONNECTING ──output handshake──▶ CONNECTED
        CONNECTED ──output disconnected──▶ SUSPECT ──output handshake──▶ CONNECTED
        CONNECTING/SUSPECT ──deadline passed──▶ DETACHED
        any ──GOODBYE, or a HELLO for its index while SUSPECT──▶ DETACHED
        any ──a HELLO for its index and output address on another connection──▶ DETACHED
        any ──its outputs not taken in time (the output thread says so)──▶ DETACHED
        CONNECTING/SUSPECT ──the engine is full and this is the oldest such──▶ DETACHED

    `deadline` is set exactly in CONNECTING and SUSPECT. DETACHED aborts every request of the
    client and closes its PUSH; its routing id and client index are free again. Frames from a
    routing id with no connection are dropped (there is nowhere to answer them).
    """

    __slots__ = ("client_index", "deadline", "monitor", "output_address", "routing_id", "serial")

    def __init__(
        self,
        routing_id: bytes,
        client_index: int,
        output_address: str,
        monitor: zmq.Socket,
        serial: int,
    ) -> None:
        self.routing_id = routing_id
        self.client_index = client_index
        self.output_address = output_address
        self.monitor = monitor
        self.serial = serial  # this engine's count of attaches when it attached (from 1)
        self.deadline: float | None = time.monotonic() + CONNECT_GRACE_S

    @property
    def is_suspect(self) -> bool:
        return self.deadline is not None


class _Handled:
    """A HELLO case that dealt with the HELLO itself (dropped it, or answered it again)."""


_HANDLED = _Handled()
# What a HELLO case decides: a refusal (its message), _HANDLED, or None (not this case).
_Verdict = str | _Handled | None


@dataclass(frozen=True)
class _ProvenKey:
    """The client a HELLO's connection proved it is, by its CURVE key (when keys are on)."""

    is_required: bool
    index: int | None = None
    server_key: bytes | None = None  # the client's public key: its outputs' PUSH serves it


class ClientTable:
    """The attached clients of one engine, by routing id and by client index.

    Args:
        ctx: the engine's ZMQ context (clients' PUSHes and their monitors are made in it).
        poller: the input thread's poller; each client's monitor is registered on it.
        facts: the answer to every accepted HELLO.
        work_queue: the busy loop's input queue.
        warnings: the input thread's rate-limited warnings.
        max_clients: the most clients attached at once.
        keys: the engine's key pair, with CURVE.
        client_keys: the admitted clients' public keys, with CURVE: a HELLO is taken only
            for the index of the key its connection proved (`shoal.engine.core.curve`).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        poller: zmq.Poller,
        facts: EngineFacts,
        work_queue: queue.SimpleQueue[InputItem],
        warnings: LogRateLimiter,
        max_clients: int = MAX_ATTACHED_CLIENTS,
        keys: CurveKeyPair | None = None,
        client_keys: KeyRing | None = None,
    ) -> None:
        self._ctx = ctx
        self._poller = poller
        self._facts = facts
        self._engine_index = facts.engine_index
        self._work_queue = work_queue
        self._warnings = warnings
        self._max_clients = max_clients
        self._keys = keys
        self._client_keys = client_keys
        self._encoder = MsgpackEncoder()
        self._hello_decoder = MsgpackDecoder(EngineHello)
        self._num_attaches = 0
        self._refusal_times: deque[float] = deque()
        self.connections: dict[bytes, ClientConnection] = {}
        self.by_client_index: dict[int, ClientConnection] = {}
        self.monitors: dict[zmq.Socket, ClientConnection] = {}

    def next_deadline(self) -> float | None:
        """The earliest deadline of a CONNECTING or SUSPECT connection, if any."""
        deadlines = [c.deadline for c in self.connections.values() if c.deadline is not None]
        return min(deadlines) if deadlines else None

    def send(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        # Through the busy loop, so it lands after the ATTACH that created the client's PUSH.
        outputs.engine_index = self._engine_index
        self._work_queue.put(SendOutputs(client_index, outputs))

    def on_hello(
        self,
        routing_id: bytes,
        connection: ClientConnection | None,
        payload: list[zmq.Frame],
        first_frame: zmq.Frame,
    ) -> None:
        """Answers a HELLO: its cases, in order, each may decide it; one that none decides
        attaches its client.

            case                        the HELLO                            is
            _unkeyed                    on a connection whose key is no      dropped
                                        client's (revoked since)
            _claims_another_index       names an index its key is not        refused
            _speaks_another_protocol    of another protocol version          refused
            _on_an_attached_connection  repeats this connection's attach     answered again
                                        names another client                 refused
            _takes_an_index             names an attached client's index:    attached (the old
                                        the same output address, or one      one detached)
                                        whose connection is down
                                        one that is up elsewhere             refused
            _finds_no_room              one client too many (and none is     refused
                                        down to make room)
        """
        hello = self._decode_hello(payload)
        if hello is None:
            return
        key = self._proven_key(first_frame)
        for case in (
            self._unkeyed,
            self._claims_another_index,
            self._speaks_another_protocol,
            self._on_an_attached_connection,
            self._takes_an_index,
            self._finds_no_room,
        ):
            verdict = case(hello, connection, key)
            if isinstance(verdict, str):
                self._refuse(hello, key.server_key, verdict)
                return
            if verdict is _HANDLED:
                return
        self._attach(routing_id, hello, key.server_key)

    def _decode_hello(self, payload: list[zmq.Frame]) -> EngineHello | None:
        try:
            hello: EngineHello = self._hello_decoder.decode(payload)
        except Exception as e:
            self._warnings.warning(
                "bad-hello",
                "engine %d dropped a malformed HELLO (cannot answer it): %s",
                self._engine_index,
                e,
            )
            return None
        return hello

    def _proven_key(self, first_frame: zmq.Frame) -> _ProvenKey:
        """Who the client is, from the key its connection proved (`shoal.engine.core.curve`),
        never from what its HELLO says."""
        if self._client_keys is None:
            return _ProvenKey(is_required=False)
        key_index = client_index_of(peer_name(first_frame))
        server_key = None
        if key_index is not None:
            server_key = self._client_keys.key_of(client_key_name(key_index))
        return _ProvenKey(True, key_index, server_key)

    def _unkeyed(self, hello: EngineHello, _: ClientConnection | None, key: _ProvenKey) -> _Verdict:
        if key.is_required and (key.index is None or key.server_key is None):
            self._warnings.warning(
                "hello-unkeyed",
                "engine %d dropped a HELLO from a connection whose key is no client's",
                self._engine_index,
            )
            return _HANDLED
        return None

    def _claims_another_index(
        self, hello: EngineHello, _: ClientConnection | None, key: _ProvenKey
    ) -> _Verdict:
        if key.is_required and hello.client_index != key.index:
            return (
                f"this connection's key is client {key.index}'s; a HELLO cannot claim "
                f"client_index {hello.client_index}"
            )
        return None

    def _speaks_another_protocol(
        self, hello: EngineHello, _: ClientConnection | None, __: _ProvenKey
    ) -> _Verdict:
        if hello.protocol_version != PROTOCOL_VERSION:
            return (
                f"protocol version {hello.protocol_version} is not supported; "
                f"this engine speaks version {PROTOCOL_VERSION}"
            )
        return None

    def _on_an_attached_connection(
        self, hello: EngineHello, connection: ClientConnection | None, _: _ProvenKey
    ) -> _Verdict:
        if connection is None:
            return None
        if (connection.client_index, connection.output_address) != (
            hello.client_index,
            hello.output_address,
        ):
            return f"this connection is attached as client {connection.client_index}"
        # A repeated HELLO (its answer was lost): the same answer again.
        self.send(connection.client_index, self._hello_reply(hello, connection.serial))
        return _HANDLED

    def _takes_an_index(
        self, hello: EngineHello, _: ClientConnection | None, __: _ProvenKey
    ) -> _Verdict:
        other = self.by_client_index.get(hello.client_index)
        if other is None:
            return None
        if other.output_address == hello.output_address:
            # Only the client bound to that address can name it: the same client came back on
            # a new connection (its old one failed on its side; it has given up on the
            # requests it sent there).
            self.detach(other, "it reconnected")
        elif other.is_suspect:
            self.detach(other, "a new connection took over its client index")
        else:
            return (
                f"client_index {hello.client_index} is already attached to another live "
                "connection; use a distinct client_index per client"
            )
        return None

    def _finds_no_room(
        self, hello: EngineHello, _: ClientConnection | None, __: _ProvenKey
    ) -> _Verdict:
        if len(self.connections) >= self._max_clients and not self._make_room():
            return (
                f"this engine serves {self._max_clients} clients, its maximum; "
                "try again when one has left"
            )
        return None

    def _make_room(self) -> bool:
        """Frees a client slot for a new HELLO by detaching the oldest client whose output
        connection is not up (one that never took its outputs, or has been away since).

        A flood of HELLOs naming addresses that never answer thus makes room for a client that
        does, instead of keeping it out.
        """
        suspects = [c for c in self.connections.values() if c.is_suspect]
        if not suspects:
            return False
        self.detach(min(suspects, key=lambda c: c.serial), "a new client needed its slot")
        return True

    def _attach(self, routing_id: bytes, hello: EngineHello, server_key: bytes | None) -> None:
        push = self._ctx.socket(zmq.PUSH)
        if server_key is not None:
            # Only the holder of the client's secret key can take these outputs.
            assert self._keys is not None, "client keys come with the engine's own"
            curve_client(push, self._keys, server_key)
        push.setsockopt(zmq.SNDHWM, OUTPUT_SNDHWM)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        push.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        monitor_address = f"inproc://client-monitor-{uuid.uuid4().hex}"
        push.monitor(monitor_address, zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        monitor = self._ctx.socket(zmq.PAIR)
        monitor.connect(monitor_address)
        try:
            push.connect(hello.output_address)
        except zmq.ZMQError as e:
            self._warnings.warning(
                "bad-address",
                "engine %d refused HELLO: bad output address %r: %s",
                self._engine_index,
                hello.output_address,
                e,
            )
            close_monitored(push, monitor)
            return
        self._num_attaches += 1
        connection = ClientConnection(
            routing_id, hello.client_index, hello.output_address, monitor, self._num_attaches
        )
        self.connections[routing_id] = connection
        self.by_client_index[hello.client_index] = connection
        self.monitors[monitor] = connection
        self._poller.register(monitor, zmq.POLLIN)
        # The PUSH belongs to the output thread from here on; the queue is the memory barrier.
        reply = self._hello_reply(hello, connection.serial)
        self._work_queue.put(
            AttachClient(hello.client_index, push, reply, connection.serial, hello.wants_kv_events)
        )
        logger.info(
            "engine %d attached client %d (outputs to %s)",
            self._engine_index,
            hello.client_index,
            hello.output_address,
        )

    def _hello_reply(self, hello: EngineHello, serial: int) -> EngineCoreOutputs:
        facts = msgspec.structs.replace(self._facts, attach_serial=serial)
        result = UtilityResult(tag_structs(facts))
        return EngineCoreOutputs(
            engine_index=self._engine_index,
            utility_output=UtilityOutput(call_id=hello.call_id, result=result),
        )

    def _refuse(self, hello: EngineHello, server_key: bytes | None, message: str) -> None:
        """Answers a refused HELLO on a short-lived PUSH; the client is never attached.

        At most MAX_REFUSALS_PER_S are answered each second; the rest only count in the
        (rate-limited) warning.
        """
        self._warnings.warning(
            "refused",
            "engine %d refused client %d: %s",
            self._engine_index,
            hello.client_index,
            message,
        )
        now = time.monotonic()
        while self._refusal_times and self._refusal_times[0] < now - 1.0:
            self._refusal_times.popleft()
        if len(self._refusal_times) >= MAX_REFUSALS_PER_S:
            return
        self._refusal_times.append(now)
        reply = EngineCoreOutputs(
            engine_index=self._engine_index,
            utility_output=UtilityOutput(call_id=hello.call_id, failure_message=message),
        )
        push = self._ctx.socket(zmq.PUSH)
        if server_key is not None:
            assert self._keys is not None, "client keys come with the engine's own"
            curve_client(push, self._keys, server_key)
        try:
            push.connect(hello.output_address)
            push.send_multipart(self._encoder.encode(reply), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._warnings.warning(
                "refusal-unsent",
                "engine %d could not answer a refused HELLO: %s",
                self._engine_index,
                e,
            )
        finally:
            push.close(linger=1000)  # the context delivers in the background

    def detach(self, connection: ClientConnection, reason: str) -> None:
        logger.info(
            "engine %d detached client %d: %s", self._engine_index, connection.client_index, reason
        )
        del self.connections[connection.routing_id]
        del self.by_client_index[connection.client_index]
        del self.monitors[connection.monitor]
        self._poller.unregister(connection.monitor)
        # Not closed here: the reader must outlive the monitoring (see `close_monitored`), and
        # the PUSH is the output thread's, which closes both.
        self._work_queue.put(DetachClient(connection.client_index, connection.monitor))

    def on_monitor_event(self, connection: ClientConnection) -> None:
        while True:
            try:
                frames = connection.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = int.from_bytes(frames[0][:2], "little")
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                connection.deadline = None
            elif event == zmq.EVENT_DISCONNECTED and connection.deadline is None:
                connection.deadline = time.monotonic() + DISCONNECT_GRACE_S

    def detach_lagging_clients(
        self, lagging_clients: queue.SimpleQueue[tuple[int, int | None]]
    ) -> None:
        while not lagging_clients.empty():
            client_index, serial = lagging_clients.get_nowait()
            connection = self.by_client_index.get(client_index)
            if connection is None:
                continue
            if serial is None:
                self.detach(connection, "its key was revoked")
            elif connection.serial == serial:  # not a newer attach
                self.detach(connection, "it did not take its outputs in time")

    def expire_connections(self) -> None:
        now = time.monotonic()
        for connection in list(self.connections.values()):
            if connection.deadline is not None and connection.deadline <= now:
                self.detach(connection, "its output connection is gone")
