"""`AsyncMPClient`: the engine-core client for an asyncio event loop (AsyncLLM, servers).

The output socket is read by one persistent task (`process_outputs_socket`), a thin driver of
the output classifier: replies complete their pending calls, outputs go through the `outputs`
event into an `asyncio.Queue`, deaths are told to the consumer and through `engine_dead`, and
elastic notifications through `scale_notice`. It holds the client's parts, never the client.
While it serves, the client attaches engines through its `AttachDriver` without blocking the
loop; this class knows nothing of ranks' load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Sequence
from multiprocessing.process import BaseProcess
from typing import Any, Protocol, cast

import zmq
import zmq.asyncio

from shoal.client.transport.attach import DeathNotice, Purpose, RecheckNotice
from shoal.client.transport.attach_driver import AttachDriver, wait_for_return
from shoal.client.transport.background_resources import BackgroundResources
from shoal.client.transport.engine_set import EngineIdentity, EngineSet
from shoal.client.transport.events import ClientEvents
from shoal.client.transport.frame_reader import read_frames
from shoal.client.transport.mp_client import MPClient
from shoal.client.transport.output_classifier import Decision, ScaleNotification
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
    EngineFacts,
    SchedulerStats,
    UtilityOutput,
)

logger = logging.getLogger(__name__)

OutputsQueue = asyncio.Queue[EngineCoreOutputs | Exception]


class RequestPlacement(Protocol):
    """Where a client's requests are: the first engine, or wherever a router sent them."""

    def rank_of(self, request_id: str) -> int | None: ...

    def is_moving(self, request_id: str) -> bool: ...


class _FirstEngine:
    """A client without a router sends every request to its first engine, never moves one."""

    def __init__(self, engines: EngineSet) -> None:
        self._engines = engines

    def rank_of(self, request_id: str) -> int | None:
        indices = self._engines.indices()
        return indices[0] if indices else None

    def is_moving(self, request_id: str) -> bool:
        return False


class AsyncMPClient(MPClient):
    """Asyncio client: zmq.asyncio sockets and one output task on the running loop.

    The output task starts in `__init__` when a loop is running, else on the first
    `add_request_async` / `call_utility_async` / `get_output_async`. Until it starts nothing
    reads the output socket: a death notice waits there and surfaces when the task starts.

    Args:
        endpoints, **kwargs: as for `MPClient`.
    """

    def __init__(self, endpoints: Sequence[EngineEndpoint], **kwargs: Any) -> None:
        super().__init__(endpoints, asyncio_mode=True, **kwargs)
        self.outputs_queue: OutputsQueue = asyncio.Queue()
        self.placement: RequestPlacement = _FirstEngine(self.engine_set)
        # Each rank's load as last published to this client (a DP client subscribes).
        self._latest_stats: dict[int, SchedulerStats] = {}
        # An engine it launched and lost is attached again (`AttachDriver.reattach_while_alive`).
        self.engine_set.returns.reattaches_launched = True
        self.events.engine_dead.subscribe(self._attach.reattach_while_alive)
        # Last: the parts undo what they kept for the engine first (a router moves its
        # requests), then the consumer hears of it.
        self.events.engine_removed.subscribe(self._tell_removed, last=True)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # no loop yet: the task starts lazily on first use
        else:
            self._ensure_output_queue_task()

    def _tell_removed(self, engine_index: int, was_dead: bool) -> None:
        """If a removed engine's death was not told yet, the consumer learns it now: requests
        still on it get no more outputs, as if it had died."""
        if not was_dead:
            self.outputs_queue.put_nowait(
                EngineDeadError("it was removed from this client", engine_index=engine_index)
            )

    def _ensure_output_queue_task(self) -> None:
        """Starts the output task once (idempotent); it holds the client's parts, not the client."""
        resources = self.resources
        if resources.output_queue_task is not None:
            return
        socket = cast(zmq.asyncio.Socket, self.output_socket)
        dispatch = _OutputDispatch(
            self.engine_set, self.pending_calls, self.events, self.outputs_queue,
            self._attach, resources,
        )  # fmt: skip
        classifier = self.classifier

        async def process_outputs_socket() -> None:
            try:
                async with contextlib.aclosing(read_frames(socket, resources)) as messages:
                    async for frames in messages:
                        if not dispatch.handle(classifier.classify(frames)):
                            return
            except Exception as e:
                if not resources.is_closed:  # else: the sockets were closed under this task
                    logger.exception("the engines' output stream failed")
                dispatch.end(e, format_exception(e))
            except asyncio.CancelledError:
                dispatch.end(EngineDeadError(), EngineDeadError())
            finally:
                resources.remove_output_reader()

        task = asyncio.create_task(process_outputs_socket(), name="EngineCoreOutputQueueTask")
        task.add_done_callback(dispatch.on_cancelled_before_start)
        resources.output_queue_task = task

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next outputs of any attached engine.

        Raises:
            EngineDeadError: an engine died (engine_index says which; None: all of them, the
                output task was cancelled, or it failed — the cause is attached).
        """
        self._ensure_output_queue_task()
        outputs = await self.outputs_queue.get()
        if isinstance(outputs, Exception):
            task = self.resources.output_queue_task
            if task is not None and task.done():
                self.outputs_queue.put_nowait(outputs)  # terminal: every later call fails too
            raise format_exception(outputs)
        return outputs

    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the output task runs on; None before it starts."""
        task = self.resources.output_queue_task
        return task.get_loop() if task is not None else None

    def latest_stats(self) -> dict[int, SchedulerStats]:
        """Each attached rank's load as last published to this client (empty without a stats
        subscription, which `DPAsyncMPClient` has)."""
        return {r: s for r, s in self._latest_stats.items() if r in self.engine_set}

    def rank_of(self, request_id: str) -> int | None:
        """The engine serving a request (`placement`: the first engine, or the router's)."""
        return self.placement.rank_of(request_id)

    def is_moving(self, request_id: str) -> bool:
        """Whether a request left a failed engine for another one (never, with one engine)."""
        return self.placement.is_moving(request_id)

    # --- the engine set while serving ---------------------------------------------------------

    async def add_engine_async(
        self, endpoint: EngineEndpoint, process: BaseProcess | None = None
    ) -> EngineFacts:
        """Attaches one more engine while serving; its HELLO answer arrives through the task.

        Raises:
            ValueError: an engine with this index is already attached.
            EngineAttachError: the engine refused this client.
            EngineDeadError, TimeoutError: it died or did not answer in time.
        """
        self._ensure_output_queue_task()
        await asyncio.sleep(self._connections.reconnect_wait_s(endpoint.identity))
        self._connections.connect(endpoint, process)
        return await self._attach.attach_async(endpoint, Purpose.ATTACH)

    async def reattach_engine_async(
        self, engine_index: int, *, detach_on_failure: bool = True
    ) -> EngineFacts:
        """Says HELLO again to an engine this client counted dead, whose process lives on.

        For a connection that failed on this client's side (its heartbeats timed out while the
        engine was paused, say): ZMQ connects the socket again by itself, and the engine, given
        a HELLO from this client's output address on a new connection, drops the old one with
        its requests (this client has already failed them). The engine keeps its identity, so
        the socket is not disconnected and connected again: libzmq refuses a routing id that a
        closing connection still holds (libzmq#1572).

        Only for an engine that may come back (`EngineSet.may_return`): one of a client whose
        engines a cluster link re-attaches, or one this client launched whose process lives
        (this client does that itself: `AttachDriver.reattach_while_alive`). Otherwise the
        death of its last engine has ended the output task.

        Args:
            detach_on_failure: whether an engine that refuses or does not answer is removed
                from this client (else it stays, counted dead, to be asked again).

        Raises:
            ValueError: the engine is not attached, or not counted dead, or may not come back.
            EngineAttachError, EngineDeadError, TimeoutError: as for `add_engine_async`.
        """
        self._ensure_output_queue_task()
        return await self._attach.reattach_async(engine_index, detach_on_failure=detach_on_failure)

    # --- input ----------------------------------------------------------------------------------

    def _send_input(
        self,
        request_type: EngineCoreRequestType,
        request: Any,
        engine: EngineIdentity | None = None,
    ) -> Awaitable[Any]:
        if engine is None:
            engine = self.core_engine
        message = self._encode_input(request_type, request)
        return self._send_input_message(message, engine, request)

    def _send_input_message(
        self, message: tuple[Any, ...], engine: EngineIdentity, objects: Any
    ) -> Awaitable[Any]:
        """Sends on the input ROUTER; tensor frames go zero-copy and are kept until sent."""
        self._check_engine(engine)
        msg = (engine, *message)
        input_socket = cast(zmq.asyncio.Socket, self.input_socket)
        if len(msg) <= 3:
            return input_socket.send_multipart(msg)
        future = cast(
            "asyncio.Future[zmq.MessageTracker]",
            input_socket.send_multipart(msg, copy=False, track=True),
        )
        resources = self.resources

        def add_pending(f: asyncio.Future[zmq.MessageTracker]) -> None:
            if not f.cancelled() and f.exception() is None:
                resources.add_pending(f.result(), objects)

        future.add_done_callback(add_pending)
        return future

    async def _send(self, awaitable: Awaitable[Any], engine: EngineIdentity) -> None:
        try:
            await awaitable
        except zmq.ZMQError as e:
            raise as_engine_error(e, self._check_engine(engine)) from e

    async def add_request_async(
        self,
        request: EngineCoreRequest,
        engine: EngineIdentity | None = None,
        *,
        session_id: str | None = None,
    ) -> None:
        """Sends one request (to `engine`, default the first); outputs come from get_output_async.

        `session_id` only matters to a client that routes (`DPLBAsyncMPClient`).

        To an engine counted dead that may come back (`EngineSet.may_return`), it is sent once
        the engine is attached again, if that happens within ENGINE_RETURN_WAIT_S.

        Raises:
            EngineDeadError: the engine is dead or gone (and did not come back in time).
        """
        request.client_index = self.client_index
        engine = engine or self.core_engine
        try:
            sent = self._send_input(EngineCoreRequestType.ADD, request, engine)
        except EngineDeadError as dead:
            if not await wait_for_return(self.engine_set, dead.engine_index):
                raise
            sent = self._send_input(EngineCoreRequestType.ADD, request, engine)
        await self._send(sent, engine)
        self._ensure_output_queue_task()

    async def abort_requests_async(
        self, request_ids: list[str], engine: EngineIdentity | None = None
    ) -> None:
        if request_ids:
            engine = engine or self.core_engine
            await self._send(
                self._send_input(EngineCoreRequestType.ABORT, request_ids, engine), engine
            )

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Calls an allow-listed EngineCore method on the first engine and awaits its result.

        Raises:
            EngineUtilityError: the method failed or is not allowed (the message says why).
            EngineDeadError: the engine died before answering.
        """
        return await self._call_utility_async(method, *args, engine=self.core_engine)

    async def _call_utility_async(self, method: str, *args: Any, engine: EngineIdentity) -> Any:
        call_id, message = self._new_utility_message(method, args)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # Registered before the send: the reply may arrive before the send call returns.
        self.pending_calls.add(call_id, self._check_engine(engine), future)
        try:
            await self._send(self._send_input_message(message, engine, args), engine)
        except BaseException:
            self.pending_calls.discard(call_id)
            raise
        self._ensure_output_queue_task()
        return await future

    async def collective_rpc_async(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Runs a read-only model-runner method on every worker of the engine; one result per
        worker. The engine refuses anything that would change it (`READ_ONLY_RUNNER_METHODS`).

        Raises:
            EngineUtilityError: the method is not one a client may run.
        """
        return await self.call_utility_async("collective_rpc", method, args)


class _OutputDispatch:
    """What the output task does with each decision; holds the client's parts, not the client
    (so the task never keeps a dropped client alive)."""

    def __init__(
        self,
        engines: EngineSet,
        calls: PendingCalls,
        events: ClientEvents,
        queue: OutputsQueue,
        attach: AttachDriver,
        resources: BackgroundResources,
    ) -> None:
        self._engines = engines
        self._calls = calls
        self._events = events
        self._queue = queue
        self._attach = attach
        self._resources = resources

    def handle(self, decision: Decision) -> bool:
        """Acts on one decision; returns False once the stream has ended for good."""
        if isinstance(decision, EngineCoreOutputs):
            self._events.outputs.emit(decision)
            if decision.outputs or decision.scheduler_stats:
                self._queue.put_nowait(decision)
        elif isinstance(decision, UtilityOutput):
            self._calls.complete(decision)
        elif isinstance(decision, DeathNotice):
            return self._on_death(decision.engine_index)
        elif isinstance(decision, RecheckNotice):
            self._attach.recheck_soon()
        elif isinstance(decision, ScaleNotification):
            self._events.scale_notice.emit(decision.notification)
        return True

    def _on_death(self, engine_index: int) -> bool:
        dead = learn_death(engine_index, self._engines)
        if dead is None:
            return True
        self._calls.fail(engine_index, dead)
        if self._engines.is_terminal(dead):
            self._queue.put_nowait(dead)
            return False
        # Before the death: the requests the loss fails one by one (lost, poison) reach the
        # consumer with their own errors first.
        self._events.engine_dead.emit(engine_index)
        self._queue.put_nowait(dead)
        return True

    def end(self, told: Exception, error: BaseException) -> None:
        """The task ended on `told` (queued for the consumer); pending calls fail with `error`."""
        self._queue.put_nowait(told)
        self._calls.fail(None, error)

    def on_cancelled_before_start(self, task: asyncio.Task[None]) -> None:
        # A task cancelled before its first step never runs its except clause.
        if task.cancelled():
            self.end(EngineDeadError(), EngineDeadError())
