"""`MPClient`: the base of the engine-core clients — engine cores in other processes, over ZMQ.

One ROUTER carries input to every engine (each connection named by the engine's identity) and
one bound PULL receives every engine's outputs. `MPClient` owns the sockets, the HELLO handshake,
the engine set (which may change at run time) and the engine monitor; the variants add how
outputs are consumed: a thread (`shoal.client.sync_mp_client`) or an asyncio task
(`shoal.client.async_mp_client`). The helpers at the end are shared by both consumers.
"""

from __future__ import annotations

import logging
import tempfile
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.process import BaseProcess
from typing import Any, Literal, TypeVar

import zmq
import zmq.asyncio

from shoal.client.background_resources import CLOSE_LINGER_MS, BackgroundResources, send_goodbye
from shoal.client.engine_monitor import EngineMonitor
from shoal.client.engine_set import EngineIdentity, EngineSet
from shoal.engine.config import EngineConfig
from shoal.engine.core.curve import ClientCurve, CurveKeyPair, EngineKeys, attach_refusal
from shoal.engine.core.engine_process import start_engine_process, stop_engine_process
from shoal.engine.errors import EngineDeadError, RequestError
from shoal.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequestType,
    EngineEndpoint,
    EngineFacts,
    EngineHello,
    UtilityOutput,
)
from shoal.engine.serial import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

AnyFuture = Any  # a concurrent.futures.Future (sync client) or an asyncio.Future

# ZMTP heartbeats on the input connections, so a silent engine host is noticed too.
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 3000


# How long to wait for an engine's HELLO answer before asking again.
HELLO_RESEND_S = 2.0
# While a HELLO waits: how often it looks whether the engine refused this client's key.
KEY_REFUSAL_POLL_S = 0.1
# How long a request for an engine that is being attached again waits for it.
ENGINE_RETURN_WAIT_S = 10.0
# How long an engine may take to answer the HELLO of a recheck (RECHECK_ATTACHED).
RECHECK_TIMEOUT_S = 5.0
# How long an engine's identity stays off limits to a new connection after its connection was
# closed: libzmq aborts the process when a connection takes a routing id that a closing one
# still holds (libzmq#1572), and a closing connection lingers up to CLOSE_LINGER_MS while it
# still has sends queued for a peer that does not take them.
SAME_IDENTITY_RECONNECT_S = CLOSE_LINGER_MS / 1000 + 0.2

_Client = TypeVar("_Client", bound="MPClient")


class EngineUtilityError(RuntimeError):
    """A utility call failed on the engine (or was refused); the engine itself is fine."""


class EngineAttachError(RuntimeError):
    """An engine refused this client at HELLO (protocol version, client index in use)."""


class MPClient:
    """Base of the seed's client family: sockets, HELLO handshake, engine set, engine monitor.

    Which engines the client has, and what it knows of each, is its `engine_set`
    (`shoal.client.engine_set`, which documents the states). An engine is attached (HELLO
    answered with its facts), then either removed on purpose (`remove_engine`: GOODBYE, its
    pending calls fail) or dead: it sent ENGINE_CORE_DEAD, its process exited, or its input
    connection stayed down for a second — the monitor then pushes ENGINE_CORE_DEAD into this
    client's own output socket, so the output consumer learns of every death the same way. A
    dead engine stays in the set, counted dead, until it is removed or attached again; sends
    to it fail at once.

    Args:
        endpoints: the engines to attach to now (more can be added later).
        asyncio_mode: use zmq.asyncio sockets (for `AsyncMPClient`).
        client_index: this client's index on every engine; distinct per attached client.
        host: interface the output PULL binds (must be reachable from the engines) for tcp.
        transport: "tcp" or "ipc" for the output PULL.
        processes: engine processes this client launched (watched, and stopped on close).
        hello_timeout_s: how long to wait for each engine's HELLO answer.
        curve_keys: this client's CURVE key pair, for engines that authenticate their clients
            (`shoal.engine.core.curve`); the engines must have admitted its public key.

    Raises:
        EngineAttachError: an engine refused this client.
        EngineDeadError: an engine died during the handshake.
        TimeoutError: an engine did not answer HELLO in time.
    """

    # Whether this client asks the engines for their KV events at HELLO (a router does).
    wants_kv_events = False

    def __init__(
        self,
        endpoints: Sequence[EngineEndpoint],
        *,
        asyncio_mode: bool = False,
        client_index: int = 0,
        host: str = "127.0.0.1",
        transport: Literal["tcp", "ipc"] = "tcp",
        processes: Mapping[int, BaseProcess] | None = None,
        hello_timeout_s: float = 30.0,
        curve_keys: CurveKeyPair | None = None,
    ) -> None:
        sync_ctx = zmq.Context()
        self.ctx: zmq.Context = zmq.asyncio.Context.shadow(sync_ctx) if asyncio_mode else sync_ctx
        self.engine_set = EngineSet()
        self.resources = BackgroundResources(ctx=sync_ctx, engines=self.engine_set)
        self._finalizer = weakref.finalize(self, self.resources)
        self.client_index = client_index
        self.encoder = MsgpackEncoder()
        self.decoder = OutputDecoder()
        # call_id -> future of a pending utility call, and the engine it went to.
        self.utility_results: dict[int, AnyFuture] = {}
        self.utility_engines: dict[int, int] = {}
        # Identities whose connection this client closed lately, and when.
        self._disconnected_at: dict[EngineIdentity, float] = {}
        self._hello_timeout_s = hello_timeout_s
        self._curve = (
            None
            if curve_keys is None
            else ClientCurve(sync_ctx, curve_keys, f"client {client_index}")
        )
        try:
            self.input_socket = self._make_input_socket()
            self.output_socket, self.output_address = self._make_output_socket(host, transport)
            notify_address = self.output_address
            if self._curve is not None:  # the monitor's notices come in-process, past CURVE
                notify_address = f"inproc://client-notices-{uuid.uuid4().hex}"
                self.output_socket.bind(notify_address)
            router_monitor = f"inproc://engine-router-monitor-{uuid.uuid4().hex}"
            self.input_socket.monitor(
                router_monitor,
                zmq.EVENT_HANDSHAKE_SUCCEEDED
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_DISCONNECTED,
            )
            output_monitor = f"inproc://client-output-monitor-{uuid.uuid4().hex}"
            self.output_socket.monitor(output_monitor, zmq.EVENT_DISCONNECTED)
            monitor = EngineMonitor(
                sync_ctx, self.engine_set, router_monitor, output_monitor, notify_address
            )
            self.resources.engine_monitor = monitor
            monitor.start()
            processes = processes or {}
            self._attach_blocking([(e, processes.get(e.engine_index)) for e in endpoints])
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def make_local(
        cls: type[_Client],
        config: EngineConfig,
        *,
        engine_index: int = 0,
        engine_transport: Literal["tcp", "ipc"] = "tcp",
        startup_timeout_s: float = 120.0,
        **kwargs: Any,
    ) -> _Client:
        """Launches one engine process and attaches a new client to it.

        Returns:
            An instance of `cls`; closing it stops the engine process.

        Raises:
            RuntimeError: the engine failed to start.
        """
        # Closed like a cluster's data plane: the engine admits this client's key alone.
        client_keys = CurveKeyPair.generate()
        engine_keys = EngineKeys(
            CurveKeyPair.generate(), {kwargs.get("client_index", 0): client_keys.public}
        )
        process, endpoint = start_engine_process(
            config,
            engine_index=engine_index,
            transport=engine_transport,
            startup_timeout_s=startup_timeout_s,
            keys=engine_keys,
        )
        try:
            return cls(
                [endpoint], processes={engine_index: process}, curve_keys=client_keys, **kwargs
            )
        except BaseException:
            stop_engine_process(process)
            raise

    @property
    def core_engine(self) -> EngineIdentity:
        """The identity of the first attached engine: where single-engine calls go."""
        for endpoint in self.engine_set.endpoints().values():
            return endpoint.identity
        raise EngineDeadError("no engine is attached")

    @property
    def is_closed(self) -> bool:
        return self.resources.is_closed

    def is_terminal(self, dead: EngineDeadError) -> bool:
        """Whether a death ends this client's outputs for good (`EngineSet.is_terminal`)."""
        return self.engine_set.is_terminal(dead)

    def endpoints(self) -> dict[int, EngineEndpoint]:
        """The engines this client has (attached, attaching, or counted dead), by index."""
        return self.engine_set.endpoints()

    def serving_engines(self) -> list[int]:
        """The engines that take new requests now: attached and not counted dead."""
        return self.engine_set.routable()

    def engine_facts(self) -> dict[int, EngineFacts]:
        """What each live attached engine said of itself at HELLO, by index."""
        return {i: facts for i, (_, facts) in self.engine_set.attached_facts().items()}

    def dead_ranks(self) -> list[int]:
        """The engines this client counts dead."""
        return self.engine_set.dead()

    def set_engines_can_return(self, can_return: bool) -> None:
        """Whether engines counted dead may be attached again by someone (a cluster link)."""
        self.engine_set.set_engines_can_return(can_return)

    def shutdown(self) -> None:
        """GOODBYE to every engine, closes sockets, stops engine processes it launched."""
        self._finalizer()

    close = shutdown

    # --- sockets ----------------------------------------------------------------------------

    def _make_input_socket(self) -> zmq.Socket:
        socket = self.ctx.socket(zmq.ROUTER)
        if self._curve is not None:
            self._curve.secure_input_socket(socket)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        socket.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        self.resources.input_socket = socket
        return socket

    def _make_output_socket(self, host: str, transport: str) -> tuple[zmq.Socket, str]:
        socket = self.ctx.socket(zmq.PULL)
        if self._curve is not None:
            self._curve.secure_output_socket(socket)
        # The default receive HWM: unbounded, the IO thread outruns the reader and costs it
        # a third of its throughput; beyond it, outputs wait in the engine's PUSH queue.
        socket.setsockopt(zmq.LINGER, 0)
        self.resources.output_socket = socket
        if transport == "tcp":
            port = socket.bind_to_random_port(f"tcp://{host}")
            return socket, f"tcp://{host}:{port}"
        if transport == "ipc":
            path = f"{tempfile.gettempdir()}/shoal-client-{uuid.uuid4().hex}.sock"
            socket.bind(f"ipc://{path}")
            self.resources.ipc_path = path
            return socket, f"ipc://{path}"
        raise ValueError(f"transport must be 'tcp' or 'ipc', got {transport!r}")

    # --- the engine set ---------------------------------------------------------------------

    def add_engine(
        self, endpoint: EngineEndpoint, process: BaseProcess | None = None
    ) -> EngineFacts:
        """Attaches one more engine (blocking handshake; variants override when it must not block).

        Raises:
            ValueError: an engine with this index is already attached.
            EngineAttachError, EngineDeadError, TimeoutError: as at construction.
        """
        self._attach_blocking([(endpoint, process)])
        facts = self.engine_set.facts(endpoint.engine_index)
        assert facts is not None, "an answered HELLO records the engine's facts"
        return facts

    def remove_engine(self, engine_index: int) -> None:
        """Detaches an engine on purpose: GOODBYE, disconnect, its pending calls fail.

        Raises:
            ValueError: no engine with this index is attached.
        """
        endpoint, process, was_dead = self.engine_set.remove(engine_index)
        assert self.resources.engine_monitor is not None
        self.resources.engine_monitor.forget(engine_index)
        if not was_dead:
            send_goodbye(zmq.Socket.shadow(self.input_socket.underlying), endpoint.identity)
        self.input_socket.disconnect(endpoint.input_address)
        now = time.monotonic()
        self._disconnected_at = {
            identity: at
            for identity, at in self._disconnected_at.items()
            if at > now - SAME_IDENTITY_RECONNECT_S
        }
        self._disconnected_at[endpoint.identity] = now
        error = EngineDeadError("it was removed from this client", engine_index=engine_index)
        fail_utility_calls(self.utility_results, self.utility_engines, engine_index, error)
        if process is not None:
            stop_engine_process(process)
        self._on_engine_removed(engine_index, was_dead)

    def _on_engine_removed(self, engine_index: int, was_dead: bool) -> None:
        """Hook: an engine left the set on purpose (`was_dead`: its death was known)."""

    def _reconnect_wait_s(self, identity: EngineIdentity) -> float:
        """How long to wait before connecting to `identity` (see SAME_IDENTITY_RECONNECT_S)."""
        at = self._disconnected_at.get(identity)
        return 0.0 if at is None else max(0.0, at + SAME_IDENTITY_RECONNECT_S - time.monotonic())

    def _connect_engine(self, endpoint: EngineEndpoint, process: BaseProcess | None) -> None:
        index = endpoint.engine_index
        refusal = attach_refusal(index, endpoint.public_key, self._curve is not None)
        if refusal is not None:
            raise EngineAttachError(refusal)
        if index in self.engine_set:
            raise ValueError(f"engine {index} is already attached; remove it first")
        time.sleep(self._reconnect_wait_s(endpoint.identity))  # async callers waited already
        self.engine_set.attach(endpoint, process)
        assert self.resources.engine_monitor is not None
        self.resources.engine_monitor.watch(index, is_new_attach=True)
        if self._curve is not None:
            self._curve.admit_engine(self.input_socket, index, endpoint.public_key)
        self.input_socket.setsockopt(zmq.CONNECT_ROUTING_ID, endpoint.identity)
        self.input_socket.connect(endpoint.input_address)

    def _check_key_accepted(self, engine_index: int) -> None:
        """Fails a HELLO at once when the engine refused this client's key at the handshake.

        Raises:
            EngineAttachError: it did (the key was never admitted by the cluster).
        """
        if self.engine_set.is_key_refused(engine_index):
            raise EngineAttachError(
                f"engine {engine_index} refused this client's CURVE key at the handshake: the "
                "key was not admitted (a client's key reaches the engines through the cluster's "
                "registry when it attaches)"
            )

    def _hello_message(self) -> tuple[int, tuple[bytes | memoryview, ...]]:
        call_id = uuid.uuid1().int >> 64
        hello = EngineHello(
            self.client_index, self.output_address, call_id, wants_kv_events=self.wants_kv_events
        )
        return call_id, (EngineCoreRequestType.HELLO.value, *self.encoder.encode(hello))

    def _on_hello_reply(self, endpoint: EngineEndpoint, output: UtilityOutput) -> EngineFacts:
        if output.failure_message is not None:
            self.remove_engine(endpoint.engine_index)
            raise EngineAttachError(
                f"engine {endpoint.engine_index} refused this client: {output.failure_message}"
            )
        facts = output.result.result if output.result is not None else None
        if not isinstance(facts, EngineFacts):
            raise EngineAttachError(f"engine {endpoint.engine_index} sent no facts at HELLO")
        self._on_attached(endpoint.engine_index, facts)
        return facts

    def _on_attached(self, engine_index: int, facts: EngineFacts) -> None:
        """An engine answered HELLO (a first attach, or again after it was counted dead):
        it is attached and routable. Subclasses hook what that means to them."""
        self.engine_set.set_facts(engine_index, facts)
        self.engine_set.mark_alive(engine_index)

    def _attach_blocking(
        self, engines: Sequence[tuple[EngineEndpoint, BaseProcess | None]]
    ) -> None:
        """HELLO to each engine and wait for every answer on the output socket directly.

        Only valid while nothing else consumes the output socket (construction, or before the
        output task or thread starts).
        """
        router: zmq.Socket = zmq.Socket.shadow(self.input_socket.underlying)
        pull: zmq.Socket = zmq.Socket.shadow(self.output_socket.underlying)
        deadline = time.monotonic() + self._hello_timeout_s
        waiting: dict[int, tuple[EngineEndpoint, tuple[Any, ...]]] = {}
        for endpoint, process in engines:
            self._connect_engine(endpoint, process)
            call_id, message = self._hello_message()
            send_hello(router, endpoint.identity, message, deadline)
            waiting[call_id] = (endpoint, message)
        # A HELLO (or its answer) lost on a connection that was being set up is asked again;
        # the engine answers a repeated HELLO from the same connection again.
        resend_at = time.monotonic() + HELLO_RESEND_S
        while waiting:
            for endpoint, _ in waiting.values():
                self._check_key_accepted(endpoint.engine_index)
            now = time.monotonic()
            if now >= deadline:
                names = sorted(e.engine_index for e, _ in waiting.values())
                raise TimeoutError(f"engines {names} did not answer HELLO in time")
            if now >= resend_at:
                for endpoint, message in waiting.values():
                    logger.warning(
                        "engine %d has not answered HELLO yet; asking again", endpoint.engine_index
                    )
                    send_hello(router, endpoint.identity, message, deadline)
                resend_at = now + HELLO_RESEND_S
            wait_ms = (min(deadline, resend_at, now + KEY_REFUSAL_POLL_S) - now) * 1000
            if not pull.poll(max(1, int(wait_ms))):
                continue
            frames = pull.recv_multipart(copy=False)
            if not self.engine_set.validate_alive(frames):
                continue
            outputs = self.decoder.decode(frames)
            utility = outputs.utility_output if outputs is not None else None
            if utility is None or utility.call_id not in waiting:
                logger.debug("dropped an unexpected message during the HELLO handshake")
                continue
            self._on_hello_reply(waiting.pop(utility.call_id)[0], utility)

    def _check_engine(self, engine: EngineIdentity) -> int:
        """The index of a live attached engine; raises EngineDeadError otherwise."""
        index = self.engine_set.index_of(engine)
        if index is None:
            raise EngineDeadError("no such engine is attached")
        if self.engine_set.is_dead(index):
            raise EngineDeadError(engine_index=index)
        return index

    def _encode_input(
        self, request_type: EngineCoreRequestType, request: Any
    ) -> tuple[bytes | memoryview, ...]:
        """The frames of one input message.

        Raises:
            RequestError: a field holds a value the wire cannot carry (an int past 64 bits,
                say, set after the request was validated).
        """
        try:
            return (request_type.value, *self.encoder.encode(request))
        except (OverflowError, TypeError) as e:
            raise RequestError(f"the request cannot be sent: {type(e).__name__}: {e}") from e

    def _new_utility_message(
        self, method: str, args: tuple[Any, ...]
    ) -> tuple[int, tuple[Any, ...]]:
        call_id = uuid.uuid1().int >> 64
        payload = self.encoder.encode((self.client_index, call_id, method, args))
        return call_id, (EngineCoreRequestType.UTILITY.value, *payload)


# --- shared by the output thread and the output task ----------------------------------------


class OutputDecoder:
    """Decodes the messages of a client's output socket, dropping the ones that are malformed.

    The PULL takes connections from anyone who can reach it; a message no engine would send (a
    broken or foreign peer's) is logged and dropped, and the client goes on serving.
    """

    def __init__(self) -> None:
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self.num_dropped = 0

    def decode(self, frames: Sequence[zmq.Frame]) -> EngineCoreOutputs | None:
        """The message's outputs, or None if it is malformed."""
        try:
            outputs: EngineCoreOutputs = self._decoder.decode(frames)
            return outputs
        except Exception as e:  # a peer's bytes must never end the output loop
            self.num_dropped += 1
            if self.num_dropped & (self.num_dropped - 1) == 0:  # 1st, 2nd, 4th, 8th, ...
                logger.warning(
                    "dropped a malformed message on the output socket (%d so far): %s: %s",
                    self.num_dropped,
                    type(e).__name__,
                    e,
                )
            return None


def process_utility_output(output: UtilityOutput, utility_results: dict[int, AnyFuture]) -> None:
    """Completes the future of a utility call (concurrent or asyncio) with its result."""
    future = utility_results.pop(output.call_id, None)
    if future is None or future.done():
        return  # the caller gave up (cancelled) or the engine was declared dead first
    if output.failure_message is not None:
        future.set_exception(EngineUtilityError(output.failure_message))
    else:
        future.set_result(output.result.result if output.result is not None else None)


def fail_utility_calls(
    utility_results: dict[int, AnyFuture],
    utility_engines: dict[int, int],
    engine_index: int | None,
    error: BaseException,
) -> None:
    """Fails the pending utility calls of one engine (all engines if `engine_index` is None)."""
    for call_id, index in list(utility_engines.items()):
        if engine_index is not None and index != engine_index:
            continue
        del utility_engines[call_id]
        future = utility_results.pop(call_id, None)
        if future is not None and not future.done():
            future.set_exception(error)


def format_exception(error: BaseException) -> EngineDeadError:
    """The consumer-facing form of an output failure: always EngineDeadError, cause attached."""
    if isinstance(error, EngineDeadError):
        return error
    dead = EngineDeadError(f"the output stream failed: {type(error).__name__}: {error}")
    dead.__cause__ = error
    return dead


def as_engine_error(error: zmq.ZMQError, engine_index: int) -> Exception:
    if error.errno == zmq.EHOSTUNREACH:
        return EngineDeadError("its input connection is gone", engine_index=engine_index)
    return error


def send_hello(
    router: zmq.Socket, identity: EngineIdentity, message: tuple[Any, ...], deadline: float
) -> None:
    """Sends HELLO, retrying while the ROUTER has no connection to the engine yet."""
    delay_s = 0.001
    while True:
        try:
            router.send_multipart((identity, *message), flags=zmq.NOBLOCK)
            return
        except zmq.ZMQError as e:
            if e.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN) or time.monotonic() > deadline:
                raise
        time.sleep(delay_s)  # connection setup, not the data path
        delay_s = min(delay_s * 2, 0.05)
