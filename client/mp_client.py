"""`MPClient`: the base of the engine-core clients — engine cores in other processes, over ZMQ.

One ROUTER carries input to every engine (each connection named by the engine's identity) and
one bound PULL receives every engine's outputs. `MPClient` owns the sockets, the HELLO handshake,
the engine set (which may change at run time) and the engine monitor; the variants add how
outputs are consumed: a thread (`shoal.client.sync_mp_client`) or an asyncio task
(`shoal.client.async_mp_client`). The handshake itself is `shoal.client.attach`'s state
machine; what both output consumers share is `shoal.client.output_dispatch`'s.
"""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.process import BaseProcess
from typing import Any, Literal, TypeVar

import zmq
import zmq.asyncio

from shoal.client.attach import (
    Attached,
    Frames,
    Handshake,
    HelloMaker,
    LetGo,
    Purpose,
    Refused,
    Step,
    TimedOut,
    read_notice,
)
from shoal.client.background_resources import CLOSE_LINGER_MS, BackgroundResources, send_goodbye
from shoal.client.engine_monitor import EngineMonitor
from shoal.client.engine_set import EngineIdentity, EngineSet
from shoal.client.output_dispatch import (
    AnyFuture,
    OutputDecoder,
    fail_utility_calls,
    learn_notice,
)
from shoal.client.sockets import make_input_socket, make_output_socket, send_hello
from shoal.engine.config import EngineConfig
from shoal.engine.core.curve import ClientCurve, CurveKeyPair, EngineKeys, attach_refusal
from shoal.engine.core.engine_process import start_engine_process, stop_engine_process
from shoal.engine.errors import EngineDeadError, RequestError
from shoal.engine.protocol import EngineCoreRequestType, EngineEndpoint, EngineFacts
from shoal.engine.serial import MsgpackEncoder

logger = logging.getLogger(__name__)

# How long a request for an engine that is being attached again waits for it.
ENGINE_RETURN_WAIT_S = 10.0
# How long an engine's identity stays off limits to a new connection after its connection was
# closed: libzmq aborts the process when a connection takes a routing id that a closing one
# still holds (libzmq#1572), and a closing connection lingers up to CLOSE_LINGER_MS while it
# still has sends queued for a peer that does not take them.
SAME_IDENTITY_RECONNECT_S = CLOSE_LINGER_MS / 1000 + 0.2

_Client = TypeVar("_Client", bound="MPClient")


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
            self.input_socket = make_input_socket(self.ctx, self._curve, self.resources)
            self.output_socket, self.output_address = make_output_socket(
                self.ctx, self._curve, self.resources, host, transport
            )
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
            self._hellos = HelloMaker(
                client_index, self.output_address, wants_kv_events=self.wants_kv_events
            )
            processes = processes or {}
            # A failure here closes the whole client: no engine needs detaching on its own.
            self._attach_blocking(
                [(e, processes.get(e.engine_index)) for e in endpoints], detach_on_failure=False
            )
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

    # --- the HELLO handshake (`shoal.client.attach`; the drivers move frames and keep time) --

    def _tick(self, handshake: Handshake, now: float) -> Step:
        """The handshake's time event, or its key refusal once the engine monitor saw one."""
        if self.engine_set.is_key_refused(handshake.endpoint.engine_index):
            return handshake.on_key_refused()
        return handshake.on_tick(now)

    def _hello_frames(self, handshake: Handshake, step: Step) -> Frames | None:
        """The frames a step says to send, noting a resend."""
        if step.is_resend:
            logger.warning(
                "engine %d has not answered HELLO yet; asking again",
                handshake.endpoint.engine_index,
            )
        return step.send

    def _settle(
        self, handshake: Handshake, *, detach_on_failure: bool = True
    ) -> EngineFacts | None:
        """Applies a finished handshake to the engine set: the same for every driver.

        Args:
            detach_on_failure: whether an engine that refuses or does not answer an attach
                leaves the set (else it stays, counted dead, to be asked again).

        Returns:
            The facts of an attach; None for a recheck (whatever it found).

        Raises:
            EngineAttachError: the engine refused this client (ATTACH, REATTACH).
            TimeoutError: it did not answer in time (ATTACH, REATTACH).
        """
        outcome = handshake.outcome
        assert outcome is not None, "a handshake settles once done"
        index = handshake.endpoint.engine_index
        if isinstance(outcome, Attached):
            self._on_attached(index, outcome.facts)
            return outcome.facts
        if isinstance(outcome, LetGo):
            self._on_let_go(index, outcome.evidence)
        if handshake.purpose is Purpose.RECHECK:
            return None  # a recheck that timed out has no verdict: the monitor finds deaf ones
        if detach_on_failure:
            self.remove_engine(index)
        if isinstance(outcome, Refused):
            raise EngineAttachError(outcome.reason)
        assert isinstance(outcome, TimedOut), f"an attach cannot end {outcome}"
        raise TimeoutError(outcome.reason)

    def _on_attached(self, engine_index: int, facts: EngineFacts) -> None:
        """An engine answered HELLO (a first attach, or again after it was counted dead):
        it is attached and routable. Subclasses hook what that means to them."""
        self.engine_set.set_facts(engine_index, facts)
        self.engine_set.mark_alive(engine_index)

    def _on_let_go(self, engine_index: int, evidence: str) -> None:
        """An engine let this client go: the requests there are lost, so it counts as lost
        (once), through the monitor's death notice, as every lost engine does."""
        assert self.resources.engine_monitor is not None
        if self.resources.engine_monitor.declare_lost(engine_index):
            logger.warning(
                "engine %d no longer counts this client attached (%s); its requests there are lost",
                engine_index,
                evidence,
            )

    def _attach_blocking(
        self,
        engines: Sequence[tuple[EngineEndpoint, BaseProcess | None]],
        *,
        detach_on_failure: bool = True,
    ) -> None:
        """HELLO to each engine and wait for every answer on the output socket directly.

        Only valid while nothing else consumes the output socket (construction, or before the
        output task or thread starts).
        """
        router: zmq.Socket = zmq.Socket.shadow(self.input_socket.underlying)
        pull: zmq.Socket = zmq.Socket.shadow(self.output_socket.underlying)
        waiting: dict[int, Handshake] = {}

        def drive(handshake: Handshake, step: Step) -> None:
            frames = self._hello_frames(handshake, step)
            if frames is not None:
                send_hello(router, handshake.endpoint.identity, frames, handshake.deadline)
            if step.outcome is not None:
                del waiting[handshake.call_id]
                self._settle(handshake, detach_on_failure=detach_on_failure)

        for endpoint, process in engines:
            self._connect_engine(endpoint, process)
            handshake = self._hellos.handshake(
                endpoint, Purpose.ATTACH, timeout_s=self._hello_timeout_s
            )
            waiting[handshake.call_id] = handshake
            drive(handshake, handshake.start(time.monotonic()))
        while waiting:
            now = time.monotonic()
            for handshake in list(waiting.values()):
                drive(handshake, self._tick(handshake, now))
            wait_s = min((h.wait_s(now) for h in waiting.values()), default=0.0)
            if not waiting or not pull.poll(max(1, int(wait_s * 1000))):
                continue
            frames = pull.recv_multipart(copy=False)
            notice = read_notice(frames)
            if notice is not None:
                dead = learn_notice(notice, self.engine_set)
                if dead is not None:
                    raise dead
                continue
            outputs = self.decoder.decode(frames)
            utility = outputs.utility_output if outputs is not None else None
            answered = waiting.get(utility.call_id) if utility is not None else None
            if answered is None or utility is None:
                logger.debug("dropped an unexpected message during the HELLO handshake")
                continue
            drive(answered, answered.on_reply(utility))

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
