"""`SyncMPClient`: the blocking engine-core client; a daemon thread reads the output socket.

It adds to `MPClient` how outputs are consumed (a thread, a thin driver of the output
classifier, and a `queue.Queue`), blocking calls, and the caller-thread half of the attach
recheck (`_recheck_attached`); sockets, the handshake and the engine set are the base's parts.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from shoal.client.transport.attach import (
    RECHECK_TIMEOUT_S,
    DeathNotice,
    LetGo,
    Purpose,
    RecheckNotice,
)
from shoal.client.transport.attach_driver import ENGINE_RETURN_WAIT_S
from shoal.client.transport.background_resources import BackgroundResources
from shoal.client.transport.connections import EngineAttachError
from shoal.client.transport.engine_set import EngineIdentity, EngineSet
from shoal.client.transport.mp_client import MPClient
from shoal.client.transport.output_classifier import OutputClassifier
from shoal.client.transport.output_dispatch import (
    PendingCalls,
    as_engine_error,
    format_exception,
    learn_death,
)
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineEndpoint,
    SchedulerStats,
    UtilityOutput,
)

logger = logging.getLogger(__name__)

# The output thread wakes this often to notice close(); a blocked utility call, to recheck.
_OUTPUT_THREAD_POLL_MS = 100
# How long a recheck that found its engine lost waits for the output thread to count it dead.
_LOSS_NOTICE_WAIT_S = 2.0


class _RecheckDue:
    """What the output thread queues to wake `get_output` for a recheck."""


_RECHECK_DUE = _RecheckDue()
_QueueItem = EngineCoreOutputs | Exception | _RecheckDue


class SyncMPClient(MPClient):
    """Blocking client: a daemon thread reads the output socket into a `queue.Queue`.

    Calls are not thread-safe: use one client per sending thread.
    """

    def __init__(self, endpoints: Sequence[EngineEndpoint], **kwargs: Any) -> None:
        super().__init__(endpoints, asyncio_mode=False, **kwargs)
        self.engine_set.returns.reattaches_launched = True  # `_reattach_if_alive`
        self.outputs_queue: queue.Queue[_QueueItem] = queue.Queue()
        self._recheck_due = threading.Event()  # set by the output thread
        self.output_socket.setsockopt(zmq.RCVTIMEO, _OUTPUT_THREAD_POLL_MS)
        thread = threading.Thread(
            target=_process_outputs_thread,
            args=(
                self.resources,
                self.engine_set,
                self.classifier,
                self.output_socket,
                self.outputs_queue,
                self.pending_calls,
                self._recheck_due,
            ),
            name="EngineCoreOutputThread",
            daemon=True,
        )
        self.resources.output_thread = thread
        thread.start()

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next outputs of any attached engine.

        Raises:
            EngineDeadError: an engine died (engine_index says which; None: all, or closed), or
                let this client go, losing the requests it had there.
            queue.Empty: nothing arrived within `timeout`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            outputs = self.outputs_queue.get(timeout=wait_s)
            if not isinstance(outputs, _RecheckDue):
                break
            self._recheck_attached()
        if isinstance(outputs, Exception):
            if self.resources.is_output_done:
                self.outputs_queue.put(outputs)  # terminal: every later call fails too
            raise format_exception(outputs)
        return outputs

    def add_request(self, request: EngineCoreRequest, engine_index: int | None = None) -> None:
        request.client_index = self.client_index
        self._send_input(EngineCoreRequestType.ADD, request, self._engine(engine_index))

    def abort_requests(self, request_ids: list[str], engine_index: int | None = None) -> None:
        """Aborts requests on one engine; nothing to do if it is dead (they went with it)."""
        if not request_ids:
            return
        engine = self._engine(engine_index, reattach=False)
        if not self.engine_set.is_dead(self._index_of(engine)):
            self._send_input(EngineCoreRequestType.ABORT, request_ids, engine)

    def call_utility(self, method: str, *args: Any, engine_index: int | None = None) -> Any:
        """Calls an allow-listed EngineCore method on one engine and waits for its result.

        Raises:
            EngineUtilityError: the method failed or is not allowed.
            EngineDeadError: the engine died before answering.
        """
        engine = self._engine(engine_index)
        call_id, message = self._new_utility_message(method, args)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.pending_calls.add(call_id, self._check_engine(engine), future)
        try:
            self._send_input_message(message, engine, args)
        except BaseException:
            self.pending_calls.discard(call_id)
            raise
        while True:  # an engine that let this client go never answers: recheck while waiting
            try:
                return future.result(timeout=_OUTPUT_THREAD_POLL_MS / 1000)
            except TimeoutError:
                self._recheck_attached()

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """As `AsyncMPClient.collective_rpc_async`: read-only runner methods only."""
        return self.call_utility("collective_rpc", method, args)

    def get_stats(self) -> SchedulerStats:
        """The first engine's load and counters (a `get_stats` utility call)."""
        return self.call_utility("get_stats")

    def step_outputs(self, timeout: float | None = None) -> list[EngineCoreOutputs]:
        """Blocks for the next outputs, then adds whatever else has already arrived.

        Raises:
            EngineDeadError, queue.Empty: as `get_output` (an error found after the first
                outputs is kept for the next call).
        """
        batch = [self.get_output(timeout)]
        while not self.outputs_queue.empty():
            item = self.outputs_queue.get_nowait()
            if not isinstance(item, EngineCoreOutputs):
                self.outputs_queue.put(item)
                break
            batch.append(item)
        return batch

    def _recheck_attached(self) -> None:
        """Asks every attached engine whether it still counts this client attached, if the
        output thread was told to (RECHECK_ATTACHED: see `shoal.client.transport.engine_monitor`).

        Runs in the caller's thread, before its next send or while it waits, as the question
        is a send (a RECHECK handshake, `shoal.client.transport.attach`). An engine that let this client
        go counts as lost, as in every client: its requests and calls there fail with
        `EngineDeadError`. This waits until the output thread has learned the loss, so that the
        caller's next send first attaches the engine again (`_reattach_if_alive`) and no
        request sent after the recheck is counted among the lost ones.
        """
        if not self._recheck_due.is_set():
            return
        self._recheck_due.clear()
        for index, (endpoint, known) in self.engine_set.attached_facts().items():
            try:
                handshake = self._attach.handshake_blocking(
                    endpoint, Purpose.RECHECK, RECHECK_TIMEOUT_S, known
                )
            except (EngineDeadError, zmq.ZMQError):
                continue  # dead: the engine monitor tells of it
            self._attach.settle(handshake)
            if isinstance(handshake.outcome, LetGo):
                self._await_loss(index)

    def _await_loss(self, engine_index: int) -> None:
        """Waits (briefly) until the output thread has counted a lost engine dead."""
        deadline = time.monotonic() + _LOSS_NOTICE_WAIT_S
        while not self.engine_set.is_dead(engine_index) and time.monotonic() < deadline:
            if self.resources.is_output_done:
                return
            time.sleep(_OUTPUT_THREAD_POLL_MS / 1000 / 10)

    def _engine(self, engine_index: int | None, *, reattach: bool = True) -> EngineIdentity:
        """The engine to send to (the first when None), after a recheck if one is due, and
        (with `reattach`) attached again first if this client launched it and lost it while
        it lives."""
        self._recheck_attached()
        if engine_index is None:
            engine = self.core_engine
            engine_index = self._index_of(engine)
        else:
            endpoint = self.engine_set.endpoint(engine_index)
            if endpoint is None:
                raise EngineDeadError("it is not attached", engine_index=engine_index)
            engine = endpoint.identity
        if reattach and self.engine_set.is_dead(engine_index):
            self._reattach_if_alive(engine_index)
        return engine

    def _reattach_if_alive(self, engine_index: int) -> None:
        """Says HELLO again to an engine this client launched and lost (its heartbeats timed out
        while it was stalled, say) whose process lives, waiting up to ENGINE_RETURN_WAIT_S for
        the answer; without one it stays counted dead. The engine replaces the old connection
        and drops its requests, which this client has already failed."""
        endpoint = self.engine_set.endpoint(engine_index)
        if endpoint is None or not self.engine_set.may_return(engine_index):
            return
        assert self.resources.engine_monitor is not None
        self.resources.engine_monitor.watch(engine_index, is_new_attach=False)
        try:
            handshake = self._attach.handshake_blocking(
                endpoint, Purpose.REATTACH, ENGINE_RETURN_WAIT_S
            )
            self._attach.settle(handshake, detach_on_failure=False)
        except (EngineAttachError, EngineDeadError, TimeoutError, zmq.ZMQError) as e:
            logger.warning("engine %d could not be attached again yet: %s", engine_index, e)
            return
        logger.info("engine %d is attached again", engine_index)

    def _index_of(self, engine: EngineIdentity) -> int:
        index = self.engine_set.index_of(engine)
        if index is None:
            raise EngineDeadError("no such engine is attached")
        return index

    def _send_input(
        self, request_type: EngineCoreRequestType, request: Any, engine: EngineIdentity
    ) -> None:
        message = self._encode_input(request_type, request)
        self._send_input_message(message, engine, request)

    def _send_input_message(
        self, message: tuple[Any, ...], engine: EngineIdentity, objects: Any
    ) -> None:
        index = self._check_engine(engine)
        msg = (engine, *message)
        try:
            if len(msg) <= 3:
                self.input_socket.send_multipart(msg)
                return
            tracker = self.input_socket.send_multipart(msg, copy=False, track=True)
            assert tracker is not None, "track=True always returns a tracker"
            self.resources.add_pending(tracker, objects)
        except zmq.ZMQError as e:
            raise as_engine_error(e, index) from e


def _process_outputs_thread(
    resources: BackgroundResources,
    engines: EngineSet,
    classifier: OutputClassifier,
    output_socket: zmq.Socket,
    outputs_queue: queue.Queue[_QueueItem],
    calls: PendingCalls,
    recheck_due: threading.Event,
) -> None:
    """SyncMPClient's output loop: the thread twin of the asyncio `process_outputs_socket`,
    a thin driver of the same classifier (elastic notifications are for DP clients only)."""
    final_error: Exception | None = None
    try:
        while not resources.is_closed:
            try:
                decision = classifier.classify(output_socket.recv_multipart(copy=False))
            except zmq.Again:
                continue
            if isinstance(decision, EngineCoreOutputs):
                if decision.outputs or decision.scheduler_stats:
                    outputs_queue.put(decision)
            elif isinstance(decision, UtilityOutput):
                calls.complete(decision)
            elif isinstance(decision, RecheckNotice):
                recheck_due.set()  # before the wake-up: `get_output` checks it
                outputs_queue.put(_RECHECK_DUE)
            elif isinstance(decision, DeathNotice):
                dead = learn_death(decision.engine_index, engines)
                if dead is None:
                    continue
                calls.fail(dead.engine_index, dead)
                if engines.is_terminal(dead):
                    final_error = dead
                    return
                outputs_queue.put(dead)
        final_error = EngineDeadError("the client was closed")
    except Exception as e:
        final_error = e
    finally:
        resources.is_output_done = True  # before the put: a consumer that sees it re-queues it
        calls.fail(None, format_exception(final_error or EngineDeadError()))
        if final_error is not None:
            outputs_queue.put(final_error)
