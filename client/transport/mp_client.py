"""`MPClient`: the base of the engine-core clients, assembled from parts wired by events.

One ROUTER carries input to every engine (each connection named by the engine's identity) and
one bound PULL receives every engine's outputs. The client is its parts; a variant adds how
outputs are consumed (a thread, `sync_mp_client`, or an asyncio task, `async_mp_client`), and
the DP clients add theirs (`dp_client`; `shoal.client.routing.lb_client`):

    input ROUTER ◀── EngineConnections ◀── AttachDriver (HELLO: attach, reattach, recheck)
         │                 │                   │    ▲
         ▼                 ▼                   ▼    │ replies
      engines ──▶ output PULL ──▶ OutputClassifier ──▶ output loop (thread or task)
                       ▲                                   │
    EngineMonitor ─────┘ death / recheck notices           ├─▶ PendingCalls (replies)
                                                           └─▶ outputs queue

    EngineSet: the one record of the engines, read by all, changed by the connections,
    the attach driver and the output loop.

The parts meet by events (`events.ClientEvents`), never by overriding the client:

    engine_added    AttachDriver.settle            → the KV index indexes the rank
    engine_removed  EngineConnections.remove       → router, migrator, stats forget it;
                                                     the consumer hears it (asyncio)
    engine_dead     the output loop (not the end)  → router, migrator, stats, the cluster
                                                     link, a re-attach of a launched engine
    outputs         the output loop (asyncio)      → the router's accounting, the KV index
    stats           the stats subscription, and    → the router's view of each rank's load
                    outputs that carry stats
    scale_notice    the output loop (asyncio)      → `eep_process_engine_core_notification`
"""

from __future__ import annotations

import logging
import uuid
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.process import BaseProcess
from typing import Any, Literal, TypeVar

import zmq
import zmq.asyncio

from shoal.client.transport.attach import HelloMaker, Purpose
from shoal.client.transport.attach_driver import AttachDriver
from shoal.client.transport.background_resources import BackgroundResources
from shoal.client.transport.connections import EngineAttachError, EngineConnections
from shoal.client.transport.engine_monitor import EngineMonitor
from shoal.client.transport.engine_set import EngineIdentity, EngineSet
from shoal.client.transport.events import ClientEvents
from shoal.client.transport.output_classifier import OutputClassifier
from shoal.client.transport.output_dispatch import PendingCalls
from shoal.client.transport.sockets import make_input_socket, make_output_socket
from shoal.engine.config import EngineConfig
from shoal.engine.core.curve import ClientCurve, CurveKeyPair, EngineKeys
from shoal.engine.core.engine_process import start_engine_process, stop_engine_process
from shoal.engine.errors import EngineDeadError, RequestError
from shoal.engine.protocol import EngineCoreRequestType, EngineEndpoint, EngineFacts
from shoal.engine.serial import MsgpackEncoder

__all__ = ["BackgroundResources", "EngineAttachError", "MPClient"]

logger = logging.getLogger(__name__)

_Client = TypeVar("_Client", bound="MPClient")


class MPClient:
    """Base of the seed's client family: its parts (the module docstring draws them).

    Which engines the client has, and what it knows of each, is its `engine_set`
    (`shoal.client.transport.engine_set`, which documents the states). An engine is attached
    (HELLO answered with its facts), then either removed on purpose (`remove_engine`: GOODBYE,
    its pending calls fail) or dead: it sent ENGINE_CORE_DEAD, its process exited, or its
    input connection stayed down for a second — the monitor then pushes ENGINE_CORE_DEAD into
    this client's own output socket, so the output consumer learns of every death the same
    way. A dead engine stays in the set, counted dead, until it is removed or attached again;
    sends to it fail at once.

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
        self.client_index = client_index
        self.engine_set = EngineSet()
        self.events = ClientEvents()
        self.pending_calls = PendingCalls()
        self.classifier = OutputClassifier()
        self.encoder = MsgpackEncoder()
        self.resources = BackgroundResources(ctx=sync_ctx, engines=self.engine_set)
        self._finalizer = weakref.finalize(self, self.resources)
        self._curve = (
            None
            if curve_keys is None
            else ClientCurve(sync_ctx, curve_keys, f"client {client_index}")
        )
        self.resources.curve = self._curve
        try:
            notify_address = self._open_sockets(host, transport)
            monitor = self._start_monitor(sync_ctx, notify_address)
            self._connections = EngineConnections(
                self.input_socket, self._curve, self.engine_set, monitor, self.pending_calls,
                self.events,
            )  # fmt: skip
            hellos = HelloMaker(
                client_index, self.output_address, wants_kv_events=self.wants_kv_events
            )
            self._attach = AttachDriver(
                hellos, self.input_socket, self.engine_set, self._connections,
                self.pending_calls, self.events, self.resources, hello_timeout_s,
            )  # fmt: skip
            # A failure here closes the whole client: no engine needs detaching on its own.
            processes = processes or {}
            self._attach.attach_from_socket(
                [(e, processes.get(e.engine_index)) for e in endpoints],
                self.output_socket,
                self.classifier,
                detach_on_failure=False,
            )
        except BaseException:
            self.shutdown()
            raise

    def _open_sockets(self, host: str, transport: Literal["tcp", "ipc"]) -> str:
        """Makes the input ROUTER and the bound output PULL; returns where notices go."""
        self.input_socket = make_input_socket(self.ctx, self._curve, self.resources)
        self.output_socket, self.output_address = make_output_socket(
            self.ctx, self._curve, self.resources, host, transport
        )
        if self._curve is None:
            return self.output_address
        notify_address = f"inproc://client-notices-{uuid.uuid4().hex}"
        self.output_socket.bind(notify_address)  # the monitor's notices come past CURVE
        return notify_address

    def _start_monitor(self, sync_ctx: zmq.Context, notify_address: str) -> EngineMonitor:
        """Starts the engine monitor on the sockets' connection events."""
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
        return monitor

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
        self.engine_set.returns.engines_can_return = can_return

    def shutdown(self) -> None:
        """GOODBYE to every engine, closes sockets, stops engine processes it launched."""
        self._finalizer()

    close = shutdown

    # --- the engine set ---------------------------------------------------------------------

    def add_engine(
        self, endpoint: EngineEndpoint, process: BaseProcess | None = None
    ) -> EngineFacts:
        """Attaches one more engine, blocking until it answers HELLO.

        An asyncio client whose output task runs attaches with `add_engine_async` instead.

        Raises:
            ValueError: an engine with this index is already attached.
            RuntimeError: the asyncio output task runs (it must not be blocked).
            EngineAttachError, EngineDeadError, TimeoutError: as at construction.
        """
        resources = self.resources
        if resources.output_queue_task is not None:
            raise RuntimeError("the output task is running: use `await add_engine_async(...)`")
        if resources.output_thread is None:  # nothing reads the output socket: read it here
            self._attach.attach_from_socket(
                [(endpoint, process)], self.output_socket, self.classifier
            )
        else:  # the output thread hands the answer over
            self._connections.connect(endpoint, process)
            handshake = self._attach.handshake_blocking(
                endpoint, Purpose.ATTACH, self._attach.hello_timeout_s
            )
            self._attach.settle(handshake)
        facts = self.engine_set.facts(endpoint.engine_index)
        assert facts is not None, "an answered HELLO records the engine's facts"
        return facts

    def remove_engine(self, engine_index: int) -> None:
        """Detaches an engine on purpose: GOODBYE, disconnect, its pending calls fail.

        Raises:
            ValueError: no engine with this index is attached.
        """
        self._connections.remove(engine_index)

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
