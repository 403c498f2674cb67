"""The input IO thread of an `EngineCoreProc` and the state machine of a client connection.

What it hands the busy loop are the typed items of `shoal.engine.core.work_items`.

The input thread owns the bound ROUTER and every client's connection state; it decodes,
validates and queues work for the busy loop. It does not know what a step does (the busy loop
lives in `shoal.engine.core.core_proc`) nor how outputs are sent (`shoal.engine.core.core_output`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, cast

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
from shoal.engine.core.work_items import (
    AbortRequests,
    AddRequest,
    AttachClient,
    DetachClient,
    EngineDead,
    InputItem,
    SendOutputs,
    UtilityCall,
)
from shoal.engine.protocol import (
    PROTOCOL_VERSION,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineFacts,
    EngineHello,
    FinishReason,
    UtilityOutput,
    UtilityResult,
)
from shoal.engine.serial import (
    MsgpackDecoder,
    MsgpackEncoder,
    peek_call_id,
    peek_request_id,
    tag_structs,
)

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
# What a client may run on the data plane, the one policy the input thread enforces: the
# EngineCore methods a UTILITY message may name, each with its number of arguments (only ones
# that read state or are safe under any load), and through `collective_rpc` only the
# model-runner methods that read, called without arguments. Nothing that loads weights, binds
# the KV cache or runs the model is reachable.
UTILITY_METHODS: Mapping[str, int] = MappingProxyType(
    {
        "get_stats": 0,
        "reset_prefix_cache": 0,
        "echo": 1,
        "collective_rpc": 2,
        "get_kv_cache_snapshot": 0,
    }
)
READ_ONLY_RUNNER_METHODS = frozenset({"bytes_per_block", "determine_num_blocks"})

# The input thread wakes at least this often to notice shutdown and expired connections.
_INPUT_POLL_MS = 100
_MAX_MESSAGES_PER_WAKE = 256
# Plain ints: pyzmq's flag enums cost a few microseconds per message in arithmetic and wrapping.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


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


_REQUEST_TYPES = {t.value: t for t in EngineCoreRequestType}
_UtilityCall = tuple[int, int, str, list[Any]]


class _ClientConnection:
    """One attached client, as the input thread sees it.

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


class InputThread(threading.Thread):
    """Receives client frames, validates them and queues work for the busy loop.

    Args:
        ctx: the engine's ZMQ context.
        router: the bound input ROUTER; this thread owns (and closes) it from now on.
        facts: the answer to every accepted HELLO.
        utility_methods: the methods a UTILITY call may invoke, each with its number of
            arguments; other calls are refused here.
        work_queue: the busy loop's input queue.
        lagging_clients: (client index, attach serial) of clients that did not take their
            outputs in time, posted by the output thread, or (client index, None) of clients
            whose key was revoked: each is detached.
        max_clients: the most clients attached at once.
        keys: the engine's key pair, with CURVE (the ROUTER is already a CURVE server).
        client_keys: the admitted clients' public keys, with CURVE: a HELLO is taken only
            for the index of the key its connection proved (`shoal.engine.core.curve`).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        router: zmq.Socket,
        facts: EngineFacts,
        utility_methods: Mapping[str, int],
        work_queue: queue.SimpleQueue[InputItem],
        lagging_clients: queue.SimpleQueue[tuple[int, int | None]] | None = None,
        max_clients: int = MAX_ATTACHED_CLIENTS,
        keys: CurveKeyPair | None = None,
        client_keys: KeyRing | None = None,
    ) -> None:
        super().__init__(name=f"EngineCoreInput_{facts.engine_index}", daemon=True)
        self._ctx = ctx
        self._router = router
        self._facts = facts
        self._engine_index = facts.engine_index
        self._utility_methods = utility_methods
        self._work_queue = work_queue
        self._stop_event = threading.Event()
        self._encoder = MsgpackEncoder()
        self._add_decoder = MsgpackDecoder(EngineCoreRequest)
        self._abort_decoder = MsgpackDecoder(list[str])
        self._utility_decoder = MsgpackDecoder(_UtilityCall)
        self._hello_decoder = MsgpackDecoder(EngineHello)
        self._poller = zmq.Poller()
        self._connections: dict[bytes, _ClientConnection] = {}
        self._by_client_index: dict[int, _ClientConnection] = {}
        self._monitors: dict[zmq.Socket, _ClientConnection] = {}
        self._num_attaches = 0
        self._lagging_clients = lagging_clients
        self._max_clients = max_clients
        self._keys = keys
        self._client_keys = client_keys
        self._refusal_times: deque[float] = deque()
        self._warnings = LogRateLimiter(logger)
        self._poller.register(router, zmq.POLLIN)

    def stop(self) -> None:
        """Asks the thread to exit within ~0.1 s; thread-safe."""
        self._stop_event.set()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                self.serve_once(self._poll_timeout_ms())
        except Exception:
            logger.exception("engine %d input thread failed", self._engine_index)
            self._work_queue.put(EngineDead())
        finally:
            # Monitors of attached clients stay open until the context goes: their PUSHes
            # (the output thread's) are still monitored.
            self._router.close(linger=0)

    def serve_once(self, timeout_ms: int) -> None:
        """One turn of the thread: whatever is ready within `timeout_ms`, then expiries.

        One poll can report a client's GOODBYE together with its connection's monitor event
        (its PULL closed right after saying goodbye); the GOODBYE, handled first, detaches the
        connection and hands its monitor to the output thread, so the event is about nothing
        any more and is skipped.
        """
        for socket, _ in self._poller.poll(timeout_ms):
            if socket is self._router:
                self._drain_router()
            elif (connection := self._monitors.get(socket)) is not None:
                self._on_monitor_event(connection)
        self._expire_connections()
        self._detach_lagging_clients()

    def _poll_timeout_ms(self) -> int:
        deadlines = [c.deadline for c in self._connections.values() if c.deadline is not None]
        if not deadlines:
            return _INPUT_POLL_MS
        wait_ms = (min(deadlines) - time.monotonic()) * 1000
        return max(0, min(_INPUT_POLL_MS, int(wait_ms) + 1))

    def _drain_router(self) -> None:
        router = self._router
        for _ in range(_MAX_MESSAGES_PER_WAKE):  # bounded: monitors and deadlines need turns too
            # Cheaper than the exception of an empty non-blocking read, and this thread holds
            # the GIL the woken busy loop needs until it blocks in poll again.
            if not cast(int, router.getsockopt(_EVENTS)) & _POLLIN:
                return
            try:
                frames = router.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._on_frames(frames)
            except Exception as e:  # a peer's frames must never kill this thread
                self._warnings.warning(
                    "unhandled",
                    "engine %d dropped a message it could not handle: %s: %s",
                    self._engine_index,
                    type(e).__name__,
                    e,
                )

    # --- frames -------------------------------------------------------------------------------

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            self._warnings.warning(
                "no-type", "engine %d dropped a message without a request type", self._engine_index
            )
            return
        routing_id = frames[0].bytes
        request_type = _REQUEST_TYPES.get(frames[1].bytes)
        payload = frames[2:]
        connection = self._connections.get(routing_id)
        if request_type is EngineCoreRequestType.HELLO:
            self._on_hello(routing_id, connection, payload, frames[1])
        elif connection is None:
            self._warnings.warning(
                "no-hello",
                "engine %d dropped a %s from a peer that never said HELLO",
                self._engine_index,
                request_type.name if request_type else "message",
            )
        elif not payload and request_type is not EngineCoreRequestType.GOODBYE:
            self._warnings.warning(
                "no-payload", "engine %d dropped a message without payload", self._engine_index
            )
        elif request_type is EngineCoreRequestType.ADD:
            self._on_add(connection, payload)
        elif request_type is EngineCoreRequestType.ABORT:
            self._on_abort(connection, payload)
        elif request_type is EngineCoreRequestType.UTILITY:
            self._on_utility(connection, payload)
        elif request_type is EngineCoreRequestType.GOODBYE:
            self._detach(connection, "it said goodbye")
        else:
            self._warnings.warning(
                "bad-type",
                "engine %d dropped a message of unsupported type %r from client %d",
                self._engine_index,
                frames[1].bytes,
                connection.client_index,
            )

    def _on_add(self, connection: _ClientConnection, payload: list[zmq.Frame]) -> None:
        try:
            request: EngineCoreRequest = self._add_decoder.decode(payload)
        except Exception as e:
            request_id = peek_request_id(payload[0].buffer)
            self._warnings.warning(
                "bad-add",
                "engine %d got a malformed ADD (%r): %s",
                self._engine_index,
                request_id,
                e,
            )
            if request_id is not None:
                output = EngineCoreOutput(
                    request_id=request_id,
                    finish_reason=FinishReason.ERROR,
                    error_message=f"malformed request: {e}",
                )
                self._send(connection.client_index, EngineCoreOutputs(outputs=[output]))
            return
        request.client_index = connection.client_index  # never trust the sender's index
        self._work_queue.put(AddRequest(request))

    def _on_abort(self, connection: _ClientConnection, payload: list[zmq.Frame]) -> None:
        try:
            request_ids = self._abort_decoder.decode(payload)
        except Exception as e:
            self._warnings.warning(
                "bad-abort", "engine %d dropped a malformed ABORT: %s", self._engine_index, e
            )
            return
        # Scoped to the sender: a client can only abort its own requests.
        self._work_queue.put(AbortRequests(request_ids, connection.client_index))

    def _on_utility(self, connection: _ClientConnection, payload: list[zmq.Frame]) -> None:
        try:
            _, call_id, method, args = self._utility_decoder.decode(payload)
        except Exception as e:
            peeked = peek_call_id(payload[0].buffer)
            self._warnings.warning(
                "bad-utility", "engine %d got a malformed UTILITY call: %s", self._engine_index, e
            )
            if peeked is not None:
                self._send_utility_failure(connection, peeked, f"malformed utility call: {e}")
            return
        num_args = self._utility_methods.get(method)
        if num_args is None:
            allowed = ", ".join(sorted(self._utility_methods))
            message = f"utility method {method!r} is not available to clients; allowed: {allowed}"
            self._send_utility_failure(connection, call_id, message)
            return
        if len(args) != num_args:
            message = f"utility method {method!r} takes {num_args} arguments, got {len(args)}"
            self._send_utility_failure(connection, call_id, message)
            return
        if method == "collective_rpc" and not is_read_only_rpc(args):
            allowed = ", ".join(sorted(READ_ONLY_RUNNER_METHODS))
            message = (
                f"collective_rpc from a client reaches only the read-only runner methods "
                f"({allowed}), without arguments; not {args[0]!r}"
            )
            self._send_utility_failure(connection, call_id, message)
            return
        self._work_queue.put(UtilityCall(connection.client_index, call_id, method, args))

    def _send_utility_failure(
        self, connection: _ClientConnection, call_id: int, message: str
    ) -> None:
        failure = UtilityOutput(call_id=call_id, failure_message=message)
        self._send(connection.client_index, EngineCoreOutputs(utility_output=failure))

    def _send(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        # Through the busy loop, so it lands after the ATTACH that created the client's PUSH.
        outputs.engine_index = self._engine_index
        self._work_queue.put(SendOutputs(client_index, outputs))

    # --- attach / detach --------------------------------------------------------------------

    def _on_hello(
        self,
        routing_id: bytes,
        connection: _ClientConnection | None,
        payload: list[zmq.Frame],
        first_frame: zmq.Frame,
    ) -> None:
        try:
            hello: EngineHello = self._hello_decoder.decode(payload)
        except Exception as e:
            self._warnings.warning(
                "bad-hello",
                "engine %d dropped a malformed HELLO (cannot answer it): %s",
                self._engine_index,
                e,
            )
            return
        server_key: bytes | None = None  # the client's public key, with CURVE
        if self._client_keys is not None:
            # Who the client is comes from the key its connection proved (`shoal.engine.core.curve`),
            # never from what its HELLO says.
            key_index = client_index_of(peer_name(first_frame))
            if key_index is not None:
                server_key = self._client_keys.key_of(client_key_name(key_index))
            if key_index is None or server_key is None:  # revoked since its handshake
                self._warnings.warning(
                    "hello-unkeyed",
                    "engine %d dropped a HELLO from a connection whose key is no client's",
                    self._engine_index,
                )
                return
            if hello.client_index != key_index:
                self._refuse(
                    hello,
                    server_key,
                    f"this connection's key is client {key_index}'s; a HELLO cannot claim "
                    f"client_index {hello.client_index}",
                )
                return
        if hello.protocol_version != PROTOCOL_VERSION:
            self._refuse(
                hello,
                server_key,
                f"protocol version {hello.protocol_version} is not supported; "
                f"this engine speaks version {PROTOCOL_VERSION}",
            )
            return
        if connection is not None:
            if (connection.client_index, connection.output_address) == (
                hello.client_index,
                hello.output_address,
            ):
                # A repeated HELLO (its answer was lost): the same answer again.
                self._send(connection.client_index, self._hello_reply(hello, connection.serial))
            else:
                self._refuse(
                    hello,
                    server_key,
                    f"this connection is attached as client {connection.client_index}",
                )
            return
        other = self._by_client_index.get(hello.client_index)
        if other is not None:
            if other.output_address == hello.output_address:
                # Only the client bound to that address can name it: the same client came back
                # on a new connection (its old one failed on its side; it has given up on the
                # requests it sent there).
                self._detach(other, "it reconnected")
            elif other.is_suspect:
                self._detach(other, "a new connection took over its client index")
            else:
                self._refuse(
                    hello,
                    server_key,
                    f"client_index {hello.client_index} is already attached to another live "
                    "connection; use a distinct client_index per client",
                )
                return
        if len(self._connections) >= self._max_clients and not self._make_room():
            self._refuse(
                hello,
                server_key,
                f"this engine serves {self._max_clients} clients, its maximum; "
                "try again when one has left",
            )
            return
        self._attach(routing_id, hello, server_key)

    def _make_room(self) -> bool:
        """Frees a client slot for a new HELLO by detaching the oldest client whose output
        connection is not up (one that never took its outputs, or has been away since).

        A flood of HELLOs naming addresses that never answer thus makes room for a client that
        does, instead of keeping it out.
        """
        suspects = [c for c in self._connections.values() if c.is_suspect]
        if not suspects:
            return False
        self._detach(min(suspects, key=lambda c: c.serial), "a new client needed its slot")
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
        connection = _ClientConnection(
            routing_id, hello.client_index, hello.output_address, monitor, self._num_attaches
        )
        self._connections[routing_id] = connection
        self._by_client_index[hello.client_index] = connection
        self._monitors[monitor] = connection
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

    def _detach(self, connection: _ClientConnection, reason: str) -> None:
        logger.info(
            "engine %d detached client %d: %s", self._engine_index, connection.client_index, reason
        )
        del self._connections[connection.routing_id]
        del self._by_client_index[connection.client_index]
        del self._monitors[connection.monitor]
        self._poller.unregister(connection.monitor)
        # Not closed here: the reader must outlive the monitoring (see `close_monitored`), and
        # the PUSH is the output thread's, which closes both.
        self._work_queue.put(DetachClient(connection.client_index, connection.monitor))

    def _on_monitor_event(self, connection: _ClientConnection) -> None:
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

    def _detach_lagging_clients(self) -> None:
        if self._lagging_clients is None:
            return
        while not self._lagging_clients.empty():
            client_index, serial = self._lagging_clients.get_nowait()
            connection = self._by_client_index.get(client_index)
            if connection is None:
                continue
            if serial is None:
                self._detach(connection, "its key was revoked")
            elif connection.serial == serial:  # not a newer attach
                self._detach(connection, "it did not take its outputs in time")

    def _expire_connections(self) -> None:
        now = time.monotonic()
        for connection in list(self._connections.values()):
            if connection.deadline is not None and connection.deadline <= now:
                self._detach(connection, "its output connection is gone")


def is_read_only_rpc(args: list[Any]) -> bool:
    """Whether `collective_rpc` arguments `[method, method_args]` name a read-only runner
    method called without arguments."""
    method, method_args = args
    return method in READ_ONLY_RUNNER_METHODS and not method_args
