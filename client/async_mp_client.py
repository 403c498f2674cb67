"""`AsyncMPClient`: the engine-core client for an asyncio event loop (AsyncLLM, servers).

The output socket is read by one persistent task (`process_outputs_socket`) instead of a
thread; it routes utility replies to futures, EEP notifications to a new task, and outputs
through the optional `process_engine_outputs` hook into an `asyncio.Queue`. Subclasses (DP,
load balancing) hook in by defining those methods; this class knows nothing of ranks' load.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
import weakref
from collections.abc import Awaitable, Callable, Sequence
from multiprocessing.process import BaseProcess
from typing import Any, cast

import zmq
import zmq.asyncio

from client.engine_monitor import is_recheck_notice
from client.mp_client import (
    HELLO_RESEND_S,
    BackgroundResources,
    EngineAttachError,
    EngineIdentity,
    EngineUtilityError,
    MPClient,
    as_engine_error,
    fail_utility_calls,
    format_exception,
    process_utility_output,
    send_hello,
)
from engine.errors import EngineDeadError
from engine.protocol import (
    EEP_NOTIFICATION_CALL_ID,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineEndpoint,
    EngineFacts,
)

logger = logging.getLogger(__name__)

# How long a request for an engine that is being attached again waits for it.
ENGINE_RETURN_WAIT_S = 10.0
_RETURN_POLL_S = 0.05
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
        self.resources.reattaches_launched_engines = True  # `_on_engine_lost`
        self._recheck_task: asyncio.Task[None] | None = None
        self._is_recheck_due = False
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
                    try:
                        if not resources.validate_alive(frames):
                            if is_recheck_notice(frames) and (_self := _self_ref()) is not None:
                                _self._recheck_attached()
                                del _self
                            continue
                    except EngineDeadError as dead:
                        fail_utility_calls(
                            utility_results, utility_engines, dead.engine_index, dead
                        )
                        outputs_queue.put_nowait(dead)
                        if resources.is_terminal(dead):
                            return
                        if dead.engine_index is not None and (_self := _self_ref()) is not None:
                            _self._on_engine_lost(dead.engine_index)
                            del _self
                        continue
                    outputs: EngineCoreOutputs = decoder.decode(frames)
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

    def _send_input(
        self,
        request_type: EngineCoreRequestType,
        request: Any,
        engine: EngineIdentity | None = None,
    ) -> Awaitable[Any]:
        if engine is None:
            engine = self.core_engine
        message = (request_type.value, *self.encoder.encode(request))
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
        self, request: EngineCoreRequest, engine: EngineIdentity | None = None
    ) -> None:
        """Sends one request (to `engine`, default the first); outputs come from get_output_async.

        To an engine counted dead that may come back (`resources.may_return`), it is sent once
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

    async def _wait_for_return(self, engine_index: int | None) -> bool:
        """Waits up to ENGINE_RETURN_WAIT_S for a dead engine to be attached again.

        Returns:
            Whether it is attached again (False at once for one that may not come back).
        """
        if engine_index is None:
            return False
        resources = self.resources
        is_back = await wait_for_engines(
            lambda: engine_index not in resources.dead_engines,
            lambda: resources.may_return(engine_index),
        )
        return is_back and engine_index in self.engines

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
        """Runs a model-runner method on the engine; one result per worker."""
        return await self.call_utility_async("collective_rpc", method, args)

    # --- the engine set at run time -----------------------------------------------------------

    def add_engine(
        self, endpoint: EngineEndpoint, process: BaseProcess | None = None
    ) -> EngineFacts:
        """Blocking attach; only before the output task runs (then use `add_engine_async`)."""
        if self.resources.output_queue_task is not None:
            raise RuntimeError("the output task is running: use `await add_engine_async(...)`")
        return super().add_engine(endpoint, process)

    def remove_engine(self, engine_index: int) -> None:
        """Detaches an engine; if its death was not reported yet, the consumer now learns it.

        Requests still on that engine will get no more outputs, so an `EngineDeadError` for
        it is queued exactly as if the engine had died.
        """
        was_reported = engine_index in self.resources.dead_engines
        super().remove_engine(engine_index)
        if not was_reported:
            self.outputs_queue.put_nowait(
                EngineDeadError("it was removed from this client", engine_index=engine_index)
            )

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
        await asyncio.sleep(self._reconnect_wait_s(endpoint.identity))
        self._connect_engine(endpoint, process)
        return await self._hello_async(endpoint)

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

        Only for an engine that may come back (`resources.may_return`): one of a client whose
        engines a cluster link re-attaches, or one this client launched whose process lives
        (this client does that itself: `_on_engine_lost`). Otherwise the death of its last
        engine has ended the output task.

        Args:
            detach_on_failure: whether an engine that refuses or does not answer is removed
                from this client (else it stays, counted dead, to be asked again).

        Raises:
            ValueError: the engine is not attached, or not counted dead, or may not come back.
            EngineAttachError, EngineDeadError, TimeoutError: as for `add_engine_async`.
        """
        endpoint = self.engines.get(engine_index)
        if endpoint is None or engine_index not in self.resources.dead_engines:
            raise ValueError(f"engine {engine_index} is not an attached engine counted dead")
        if not self.resources.may_return(engine_index):
            raise ValueError(f"engine {engine_index} may not come back to this client")
        self._ensure_output_queue_task()
        assert self.resources.engine_monitor is not None
        self.resources.engine_monitor.watch(engine_index, endpoint.input_address, None)
        # The facts of the attach that ended go: until the answer brings new ones, no stats
        # report can say this client is not attached (`DPAsyncMPClient._is_detached_by`).
        self.engine_facts.pop(engine_index, None)
        # Counted dead until it answers: a request meanwhile waits (`_wait_for_return`) rather
        # than go to an engine that may never take it.
        facts = await self._hello_async(endpoint, detach_on_failure=detach_on_failure)
        self.resources.forget_death(engine_index)
        return facts

    def _on_engine_lost(self, engine_index: int) -> None:
        """Called by the output task for an engine it learned is dead, but not for good.

        An engine this client launched, lost while its process lives (it let this client go
        while the client was paused past its heartbeat timeout, say), is attached again in a
        side task. Subclasses add what a loss means to them.
        """
        resources = self.resources
        if resources.engines_can_return or not resources.may_return(engine_index):
            return  # whoever set engines_can_return attaches them again
        task = asyncio.create_task(
            _reattach_while_alive(weakref.ref(self), engine_index), name=f"Reattach{engine_index}"
        )
        resources.side_tasks.add(task)
        task.add_done_callback(resources.side_tasks.discard)

    async def _hello_async(
        self, endpoint: EngineEndpoint, *, detach_on_failure: bool = True
    ) -> EngineFacts:
        """HELLO on the connected input socket until answered; a failure detaches the engine,
        or with `detach_on_failure=False` leaves it counted dead."""
        engine_index = endpoint.engine_index
        try:
            facts = await self._ask_hello(endpoint, self._hello_timeout_s)
        except EngineUtilityError as e:
            self._on_hello_failed(engine_index, detach_on_failure)
            raise EngineAttachError(f"engine {engine_index} refused this client: {e}") from None
        except TimeoutError:
            self._on_hello_failed(engine_index, detach_on_failure)
            raise TimeoutError(f"engine {engine_index} did not answer HELLO in time") from None
        except zmq.ZMQError:
            self._on_hello_failed(engine_index, detach_on_failure)
            raise
        self.engine_facts[engine_index] = facts
        return facts

    async def _ask_hello(self, endpoint: EngineEndpoint, timeout_s: float) -> EngineFacts:
        """Says HELLO, again every HELLO_RESEND_S (as `_attach_blocking` does), until answered.

        Raises:
            EngineUtilityError: the engine refused.
            TimeoutError: no answer within `timeout_s`.
            EngineDeadError, zmq.ZMQError: the engine died, or could not be sent to.
        """
        call_id, message = self._hello_message()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self.utility_results[call_id] = future
        self.utility_engines[call_id] = endpoint.engine_index
        deadline = loop.time() + timeout_s
        router: zmq.Socket = zmq.Socket.shadow(self.input_socket.underlying)
        try:
            await _send_hello_async(router, endpoint.identity, message, deadline)
            while True:
                wait_s = min(HELLO_RESEND_S, max(0.0, deadline - loop.time()))
                try:
                    facts: EngineFacts = await asyncio.wait_for(asyncio.shield(future), wait_s)
                    return facts
                except TimeoutError:
                    if loop.time() >= deadline:
                        raise
                logger.warning(
                    "engine %d has not answered HELLO yet; asking again", endpoint.engine_index
                )
                await _send_hello_async(router, endpoint.identity, message, deadline)
        finally:
            self.utility_results.pop(call_id, None)
            self.utility_engines.pop(call_id, None)

    def _on_hello_failed(self, engine_index: int, detach: bool) -> None:
        if detach:
            self.remove_engine(engine_index)
        else:
            self.resources.dead_engines.add(engine_index)  # sends to it fail at once again

    def _recheck_attached(self) -> None:
        """Asks, in a side task, whether every attached engine still counts this client attached
        (on the monitor's RECHECK_ATTACHED: one may have let this client go without a word).

        The question is a repeated HELLO on the same connection: an engine that still has this
        client attached answers it with the same attach serial; one that let it go attaches it
        afresh, under a new serial. The requests this client had there are gone, so such an
        engine counts as lost (`EngineMonitor.declare_lost`): they fail, and it is attached
        again as any lost engine is. An engine that does not answer is left to the monitor.
        """
        if self._recheck_task is not None and not self._recheck_task.done():
            self._is_recheck_due = True  # asked again while asking: once more after
            return
        task = asyncio.create_task(self._recheck_attached_async(), name="RecheckAttached")
        self._recheck_task = task
        self.resources.side_tasks.add(task)
        task.add_done_callback(self.resources.side_tasks.discard)

    async def _recheck_attached_async(self) -> None:
        self._is_recheck_due = True
        while self._is_recheck_due:
            self._is_recheck_due = False
            known = {
                index: facts
                for index, facts in self.engine_facts.items()
                if index in self.engines and index not in self.resources.dead_engines
            }
            answers = await asyncio.gather(
                *(self._ask_hello(self.engines[i], _RECHECK_TIMEOUT_S) for i in known),
                return_exceptions=True,
            )
            for (index, facts), answer in zip(known.items(), answers, strict=True):
                if isinstance(answer, BaseException):
                    continue  # dead, hung or removed: the monitor or a removal tells of it
                if answer.attach_serial != facts.attach_serial:
                    self._on_let_go(index, "it attached this client afresh")

    def _on_let_go(self, engine_index: int, evidence: str) -> None:
        """An engine let this client go (it took it for dead): the requests there are lost, so
        it counts as lost (once), and is attached again as any lost engine is."""
        assert self.resources.engine_monitor is not None
        if self.resources.engine_monitor.declare_lost(engine_index):
            logger.warning(
                "engine %d no longer counts this client attached (%s); its requests there are lost",
                engine_index,
                evidence,
            )


# How long an engine may take to answer a recheck's HELLO.
_RECHECK_TIMEOUT_S = 5.0


async def wait_for_engines(is_ready: Callable[[], bool], may_be: Callable[[], bool]) -> bool:
    """Polls, for up to ENGINE_RETURN_WAIT_S, until `is_ready()`; gives up once not `may_be()`.

    For requests that arrive while engines are being attached again: a rare path, so a poll.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ENGINE_RETURN_WAIT_S
    while not is_ready():
        if not may_be() or loop.time() >= deadline:
            return False
        await asyncio.sleep(_RETURN_POLL_S)
    return True


# Between HELLOs to a launched engine that was lost and has not answered yet.
_REATTACH_RETRY_S = 1.0


async def _reattach_while_alive(
    client_ref: weakref.ReferenceType[AsyncMPClient], engine_index: int
) -> None:
    """HELLO to a launched engine the client lost, until it answers or its process exits.

    Holds the client only weakly between tries, so a dropped client is still collected.
    """
    while (client := client_ref()) is not None:
        resources = client.resources
        if engine_index not in resources.dead_engines or not resources.may_return(engine_index):
            return
        try:
            await client.reattach_engine_async(engine_index, detach_on_failure=False)
            logger.info("engine %d is attached again", engine_index)
            return
        except (EngineAttachError, EngineDeadError, TimeoutError, zmq.ZMQError) as e:
            logger.warning("engine %d could not be attached again yet: %s", engine_index, e)
        del client, resources
        await asyncio.sleep(_REATTACH_RETRY_S)


async def _send_hello_async(
    router: zmq.Socket, identity: EngineIdentity, message: tuple[Any, ...], deadline: float
) -> None:
    """Sends HELLO without blocking the loop, retrying while the connection is being set up."""
    loop = asyncio.get_running_loop()
    while True:  # connection setup, not the data path
        try:
            send_hello(router, identity, message, deadline=0.0)
            return
        except zmq.ZMQError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.005)
