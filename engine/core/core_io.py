"""The input IO thread of an `EngineCoreProc`, and the data plane's utility policy.

What it hands the busy loop are the typed items of `shoal.engine.core.work_items`.

The input thread owns the bound ROUTER and the table of attached clients
(`shoal.engine.core.client_table`, whose docstrings hold the HELLO handshake and a connection's
state machine); it decodes, validates and queues work for the busy loop. It does not know what a step does (the busy loop
lives in `shoal.engine.core.core_proc`) nor how outputs are sent (`shoal.engine.core.core_output`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

import zmq

from shoal.engine.core.client_table import MAX_ATTACHED_CLIENTS, ClientConnection, ClientTable
from shoal.engine.core.curve import (
    CurveKeyPair,
    KeyRing,
)
from shoal.engine.core.rate_limit import LogRateLimiter
from shoal.engine.core.work_items import (
    AbortRequests,
    AddRequest,
    EngineDead,
    InputItem,
    UtilityCall,
)
from shoal.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineFacts,
    FinishReason,
    UtilityOutput,
)
from shoal.engine.serial import (
    MsgpackDecoder,
    MsgpackEncoder,
    peek_call_id,
    peek_request_id,
)

if TYPE_CHECKING:
    from shoal.engine.core.rank_engine import RankEngine

logger = logging.getLogger(__name__)

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


def utility_of(engine: RankEngine, method: str) -> Callable[..., Any]:
    """What answers the utility call `method` (one of `UTILITY_METHODS`): `echo` and
    `get_stats` are the rank's own, the same whichever engine it hosts; the others are the
    engine's."""
    if method == "echo":
        return _echo
    if method == "get_stats":
        return engine.make_stats
    method_of_engine: Callable[..., Any] = getattr(engine, method)
    return method_of_engine


def _echo(value: Any) -> Any:
    return value


# The input thread wakes at least this often to notice shutdown and expired connections.
_INPUT_POLL_MS = 100
_MAX_MESSAGES_PER_WAKE = 256
# Plain ints: pyzmq's flag enums cost a few microseconds per message in arithmetic and wrapping.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


_REQUEST_TYPES = {t.value: t for t in EngineCoreRequestType}
_UtilityCall = tuple[int, int, str, list[Any]]


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
        self._poller = zmq.Poller()
        self._lagging_clients = lagging_clients
        self._warnings = LogRateLimiter(logger)
        self._clients = ClientTable(
            ctx, self._poller, facts, work_queue, self._warnings, max_clients, keys, client_keys
        )
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
            elif (connection := self._clients.monitors.get(socket)) is not None:
                self._clients.on_monitor_event(connection)
        self._clients.expire_connections()
        if self._lagging_clients is not None:
            self._clients.detach_lagging_clients(self._lagging_clients)

    def _poll_timeout_ms(self) -> int:
        deadline = self._clients.next_deadline()
        if deadline is None:
            return _INPUT_POLL_MS
        wait_ms = (deadline - time.monotonic()) * 1000
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
        connection = self._clients.connections.get(routing_id)
        if request_type is EngineCoreRequestType.HELLO:
            self._clients.on_hello(routing_id, connection, payload, frames[1])
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
            self._clients.detach(connection, "it said goodbye")
        else:
            self._warnings.warning(
                "bad-type",
                "engine %d dropped a message of unsupported type %r from client %d",
                self._engine_index,
                frames[1].bytes,
                connection.client_index,
            )

    def _on_add(self, connection: ClientConnection, payload: list[zmq.Frame]) -> None:
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
                self._clients.send(connection.client_index, EngineCoreOutputs(outputs=[output]))
            return
        request.client_index = connection.client_index  # never trust the sender's index
        self._work_queue.put(AddRequest(request))

    def _on_abort(self, connection: ClientConnection, payload: list[zmq.Frame]) -> None:
        try:
            request_ids = self._abort_decoder.decode(payload)
        except Exception as e:
            self._warnings.warning(
                "bad-abort", "engine %d dropped a malformed ABORT: %s", self._engine_index, e
            )
            return
        # Scoped to the sender: a client can only abort its own requests.
        self._work_queue.put(AbortRequests(request_ids, connection.client_index))

    def _on_utility(self, connection: ClientConnection, payload: list[zmq.Frame]) -> None:
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
        self, connection: ClientConnection, call_id: int, message: str
    ) -> None:
        failure = UtilityOutput(call_id=call_id, failure_message=message)
        self._clients.send(connection.client_index, EngineCoreOutputs(utility_output=failure))


def is_read_only_rpc(args: list[Any]) -> bool:
    """Whether `collective_rpc` arguments `[method, method_args]` name a read-only runner
    method called without arguments."""
    method, method_args = args
    return method in READ_ONLY_RUNNER_METHODS and not method_args
