"""`AsyncMPClient`: the engine-core client for an asyncio event loop (AsyncLLM, servers).

The output socket is read by one persistent task (`process_outputs_socket`) instead of a
thread; it routes utility replies to futures, EEP notifications to a new task, and outputs
through the optional `process_engine_outputs` hook into an `asyncio.Queue`. Subclasses (DP,
load balancing) hook in by defining those methods; this class knows nothing of ranks' load.
How its engine set changes while it serves is `shoal.client.async_engine_set`'s.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
import weakref
from collections.abc import Awaitable, Sequence
from typing import Any, cast

import zmq
import zmq.asyncio

from shoal.client.async_engine_set import AsyncEngineSetMixin
from shoal.client.attach import RecheckNotice, read_notice
from shoal.client.mp_client import BackgroundResources, EngineIdentity
from shoal.client.output_dispatch import (
    as_engine_error,
    fail_utility_calls,
    format_exception,
    learn_notice,
    process_utility_output,
)
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import (
    EEP_NOTIFICATION_CALL_ID,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineEndpoint,
    SchedulerStats,
)

logger = logging.getLogger(__name__)

# While a backlog is drained, the consumers get a turn after this many frames: fewer turns
# cost the output task less per frame, more let outputs pile up unconsumed.
_MAX_FRAMES_PER_TURN = 4
# Plain ints: pyzmq's flag enums cost microseconds per frame in arithmetic and wrapping.
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


class _FrameWaiter:
    """Wakes the output task when its socket has a message: one reader on the socket's ZMQ FD.

    Per reply this costs a future, where `zmq.asyncio`'s recv costs a future, its bookkeeping
    and several event checks: tens of microseconds less on every request's latency. The
    reader is registered in `BackgroundResources.output_reader`, which removes it before the
    socket (and so the FD) is closed.
    """

    def __init__(self, socket: zmq.Socket, loop: asyncio.AbstractEventLoop) -> None:
        self._socket = socket
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None

    @classmethod
    def start(cls, socket: zmq.Socket, resources: BackgroundResources) -> _FrameWaiter | None:
        """A waiter reading on the running loop, or None where that loop cannot watch an FD."""
        loop = asyncio.get_running_loop()
        waiter = cls(socket, loop)
        fd = cast(int, socket.get(zmq.FD))
        try:
            loop.add_reader(fd, waiter._on_readable)
        except NotImplementedError:
            return None
        resources.output_reader = (loop, fd)
        return waiter

    async def wait(self) -> None:
        """Returns once a message may be there (the caller checks, as wake-ups can be early)."""
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _on_readable(self) -> None:
        try:
            # The ZMQ FD signals edges: reading the events on every wake re-arms it.
            has_frame = cast(int, self._socket.getsockopt(_EVENTS)) & _POLLIN
        except zmq.ZMQError:  # closed meanwhile (a close from another thread)
            has_frame = True
        waiter = self._waiter
        if has_frame and waiter is not None and not waiter.done():
            waiter.set_result(None)


class AsyncMPClient(AsyncEngineSetMixin):
    """Asyncio client: zmq.asyncio sockets and one output task on the running loop.

    The output task starts in `__init__` when a loop is running, else on the first
    `add_request_async` / `call_utility_async` / `get_output_async`. Until it starts nothing
    reads the output socket: a death notice waits there and surfaces when the task starts.

    Args:
        endpoints, **kwargs: as for `MPClient`.
    """

    def __init__(self, endpoints: Sequence[EngineEndpoint], **kwargs: Any) -> None:
        super().__init__(endpoints, asyncio_mode=True, **kwargs)
        self.engine_set.reattach_launched_engines()  # `_on_engine_lost`
        self.outputs_queue: asyncio.Queue[EngineCoreOutputs | Exception] = asyncio.Queue()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # no loop yet: the task starts lazily on first use
        else:
            self._ensure_output_queue_task()

    def _ensure_output_queue_task(self) -> None:
        """Starts the output task once (idempotent); it holds the client only weakly."""
        resources = self.resources
        if resources.output_queue_task is not None:
            return
        # Locals, not attributes of self: the task must not keep the client alive.
        engines = self.engine_set
        decoder = self.decoder
        utility_results = self.utility_results
        utility_engines = self.utility_engines
        outputs_queue = self.outputs_queue
        output_socket = cast(zmq.asyncio.Socket, self.output_socket)
        output_handler = getattr(self.__class__, "process_engine_outputs", None)
        notification_callback_handler = getattr(
            self.__class__, "eep_process_engine_core_notification", None
        )
        _self_ref = weakref.ref(self)

        # A sync view of the same socket, for reads that need no await.
        drain_socket: zmq.Socket = zmq.Socket.shadow(output_socket.underlying)

        def read_queued() -> list[zmq.Frame] | None:
            """The next message if one is queued: a plain read, no future and no event check."""
            try:
                frame = drain_socket.recv(_NOBLOCK, copy=False)
            except zmq.Again:
                return None
            frames = [frame]
            while frame.more:  # the parts of a message arrive together
                frame = drain_socket.recv(_NOBLOCK, copy=False)
                frames.append(frame)
            return frames

        async def process_outputs_socket() -> None:
            try:
                num_unyielded = 0  # frames handled since the consumers last had a turn
                frame_waiter = _FrameWaiter.start(drain_socket, resources)
                while True:
                    # The consumers go first: every few frames of a backlog (a backlog starves
                    # them, and outputs that live through GC passes get promoted, making every
                    # full collection slower), and before this task waits (re-arming the wait
                    # would delay them).
                    if num_unyielded >= _MAX_FRAMES_PER_TURN:
                        num_unyielded = 0
                        await asyncio.sleep(0)
                    if resources.is_closed:
                        # Closed while this task waited: its socket may be gone, and its
                        # memory another socket's by now. Never read it again.
                        return
                    frames = read_queued()
                    if frames is not None:
                        num_unyielded += 1
                    elif num_unyielded:
                        num_unyielded = 0
                        await asyncio.sleep(0)
                        continue  # look once more before waiting
                    elif frame_waiter is not None:
                        await frame_waiter.wait()
                        # A reply after a wait is usually alone: its consumer goes first,
                        # before a read that would only find the socket empty.
                        num_unyielded = _MAX_FRAMES_PER_TURN - 1
                        continue
                    else:
                        frames = await output_socket.recv_multipart(copy=False)
                        num_unyielded = 1
                    notice = read_notice(frames)
                    if isinstance(notice, RecheckNotice):
                        if (_self := _self_ref()) is not None:
                            _self._recheck_attached()
                            del _self
                        continue
                    if notice is not None:
                        dead = learn_notice(notice, engines)
                        if dead is None:
                            continue
                        fail_utility_calls(
                            utility_results, utility_engines, dead.engine_index, dead
                        )
                        outputs_queue.put_nowait(dead)
                        if engines.is_terminal(dead):
                            return
                        if dead.engine_index is not None and (_self := _self_ref()) is not None:
                            _self._on_engine_lost(dead.engine_index)
                            del _self
                        continue
                    outputs = decoder.decode(frames)
                    if outputs is None:
                        continue  # malformed: dropped
                    if outputs.utility_output:
                        if (
                            outputs.utility_output.call_id == EEP_NOTIFICATION_CALL_ID
                            and notification_callback_handler is not None
                        ):
                            _self = _self_ref()
                            if not _self:
                                return
                            if outputs.utility_output.result is None:
                                continue
                            notification_data = outputs.utility_output.result.result
                            assert isinstance(notification_data, Sequence)
                            assert len(notification_data) == 2
                            task = asyncio.create_task(
                                notification_callback_handler(_self, notification_data)
                            )
                            resources.side_tasks.add(task)
                            task.add_done_callback(resources.side_tasks.discard)
                        else:
                            process_utility_output(outputs.utility_output, utility_results)
                            utility_engines.pop(outputs.utility_output.call_id, None)
                        continue

                    if output_handler is not None:
                        _self = _self_ref()
                        if not _self:
                            return  # the client was garbage-collected
                        await output_handler(_self, outputs)

                    if outputs.outputs or outputs.scheduler_stats:
                        outputs_queue.put_nowait(outputs)
            except Exception as e:
                if not resources.is_closed:  # else: the sockets were closed under this task
                    logger.exception("the engines' output stream failed")
                outputs_queue.put_nowait(e)
                fail_utility_calls(utility_results, utility_engines, None, format_exception(e))
            except asyncio.CancelledError:
                outputs_queue.put_nowait(EngineDeadError())
                fail_utility_calls(utility_results, utility_engines, None, EngineDeadError())
            finally:
                resources.remove_output_reader()

        def on_cancelled_before_start(task: asyncio.Task[None]) -> None:
            # A task cancelled before its first step never runs its except clause.
            if task.cancelled():
                outputs_queue.put_nowait(EngineDeadError())
                fail_utility_calls(utility_results, utility_engines, None, EngineDeadError())

        task = asyncio.create_task(process_outputs_socket(), name="EngineCoreOutputQueueTask")
        task.add_done_callback(on_cancelled_before_start)
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
            raise self._format_exception(outputs)
        return outputs

    _format_exception = staticmethod(format_exception)

    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop the output task runs on; None before it starts."""
        task = self.resources.output_queue_task
        return task.get_loop() if task is not None else None

    def latest_stats(self) -> dict[int, SchedulerStats]:
        """Nothing: this client subscribes to no stats stream (`DPAsyncMPClient` does)."""
        return {}

    def rank_of(self, request_id: str) -> int | None:
        """The engine serving a request: the first engine (single-engine calls go there)."""
        indices = self.engine_set.indices()
        return indices[0] if indices else None

    def is_moving(self, request_id: str) -> bool:
        """Never: with one engine a request has nowhere to move (`DPLBAsyncMPClient` moves)."""
        return False

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
            if not await self._wait_for_return(dead.engine_index):
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
        call_id = uuid.uuid1().int >> 64
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # Registered before the send: the reply may arrive before the send call returns.
        self.utility_results[call_id] = future
        self.utility_engines[call_id] = self._check_engine(engine)
        payload = self.encoder.encode((self.client_index, call_id, method, args))
        message = (EngineCoreRequestType.UTILITY.value, *payload)
        try:
            await self._send(self._send_input_message(message, engine, args), engine)
        except BaseException:
            self.utility_results.pop(call_id, None)
            self.utility_engines.pop(call_id, None)
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
