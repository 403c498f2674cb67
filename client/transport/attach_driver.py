"""`AttachDriver`: drives a client's HELLO handshakes and applies how each one ends.

The handshake itself is `shoal.client.transport.attach`'s state machine, which makes the
frames and reads the answers. This part moves the frames and keeps the time, in the three ways
a client waits for an answer:

    attach_from_socket   at construction, reading the output socket itself (nothing else
                         reads it yet)
    handshake_blocking   from a caller's thread, while the blocking client's output thread
                         hands the answer over as a utility reply
    handshake_async      from the event loop, while the output task hands it over

Each driver sends what a step says (`_frames`), waits, and turns what the wait gave into the
handshake's next event (`_after_wait`: a timeout is a tick, a failure message a refusal, a
result an answer); `settle` applies the outcome, the same for all: the facts of an attach go to
the engine set and `engine_added` is emitted; a let-go engine counts as lost through the
monitor's death notice; a refused or silent engine is removed (or, asked so, stays counted
dead). On the asyncio side it also rechecks the engines when the monitor says the client may
have been let go, and attaches again an engine the client launched and lost, while its process
lives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import zmq

from shoal.client.transport.attach import (
    RECHECK_TIMEOUT_S,
    Attached,
    DeathNotice,
    Frames,
    Handshake,
    HelloMaker,
    LetGo,
    Purpose,
    Refused,
    Step,
    TimedOut,
)
from shoal.client.transport.background_resources import BackgroundResources
from shoal.client.transport.connections import EngineAttachError, EngineConnections
from shoal.client.transport.engine_set import EngineIdentity, EngineSet
from shoal.client.transport.events import ClientEvents
from shoal.client.transport.output_classifier import OutputClassifier
from shoal.client.transport.output_dispatch import EngineUtilityError, PendingCalls, learn_death
from shoal.client.transport.sockets import send_hello
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import EngineEndpoint, EngineFacts, UtilityOutput

logger = logging.getLogger(__name__)

# How long a request for an engine that is being attached again waits for it.
ENGINE_RETURN_WAIT_S = 10.0
_RETURN_POLL_S = 0.05
# Between HELLOs to a launched engine that was lost and has not answered yet.
_REATTACH_RETRY_S = 1.0


class _NoAnswer:
    """What a wait gives when the answer did not come in time."""


_NO_ANSWER = _NoAnswer()


class AttachDriver:
    """The HELLO drivers of one client (see the module docstring).

    Args:
        hellos: makes this client's handshakes.
        input_socket: the client's ROUTER (HELLOs go out on it).
        engines, connections, calls, events: the client's parts.
        resources: the client's resources (its monitor, and the side tasks of the asyncio
            driver).
        hello_timeout_s: how long an attach waits for its answer.
    """

    def __init__(
        self,
        hellos: HelloMaker,
        input_socket: zmq.Socket,
        engines: EngineSet,
        connections: EngineConnections,
        calls: PendingCalls,
        events: ClientEvents,
        resources: BackgroundResources,
        hello_timeout_s: float,
    ) -> None:
        self._hellos = hellos
        self._router: zmq.Socket = zmq.Socket.shadow(input_socket.underlying)  # a sync view
        self._engines = engines
        self._connections = connections
        self._calls = calls
        self._events = events
        self._resources = resources
        self.hello_timeout_s = hello_timeout_s
        # The running recheck, and whether another was asked for while it ran.
        self._recheck_task: asyncio.Task[None] | None = None
        self._is_recheck_due = False

    # --- what every driver shares --------------------------------------------------------------

    def _tick(self, handshake: Handshake, now: float) -> Step:
        """The handshake's time event, or its key refusal once the engine monitor saw one."""
        monitor = self._resources.engine_monitor
        assert monitor is not None
        if monitor.is_key_refused(handshake.endpoint.engine_index):
            return handshake.on_key_refused()
        return handshake.on_tick(now)

    def _frames(self, handshake: Handshake, step: Step) -> Frames | None:
        """The frames a step says to send, noting a resend."""
        if step.is_resend:
            logger.warning(
                "engine %d has not answered HELLO yet; asking again",
                handshake.endpoint.engine_index,
            )
        return step.send

    def _after_wait(self, handshake: Handshake, waited: Any, now: float) -> Step:
        """The handshake's event for what a wait gave: no answer, a refusal, or a result."""
        if waited is _NO_ANSWER:
            return self._tick(handshake, now)
        if isinstance(waited, EngineUtilityError):
            return handshake.on_refusal(str(waited))
        return handshake.on_answer(waited)

    def settle(self, handshake: Handshake, *, detach_on_failure: bool = True) -> EngineFacts | None:
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
            self._engines.mark_attached(index, outcome.facts)
            self._events.engine_added.emit(index, outcome.facts)
            return outcome.facts
        if isinstance(outcome, LetGo):
            self.let_go(index, outcome.evidence)
        if handshake.purpose is Purpose.RECHECK:
            return None  # a recheck that timed out has no verdict: the monitor finds deaf ones
        if detach_on_failure:
            self._connections.remove(index)
        if isinstance(outcome, Refused):
            raise EngineAttachError(outcome.reason)
        assert isinstance(outcome, TimedOut), f"an attach cannot end {outcome}"
        raise TimeoutError(outcome.reason)

    def let_go(self, engine_index: int, evidence: str) -> None:
        """An engine let this client go: the requests there are lost, so it counts as lost
        (once), through the monitor's death notice, as every lost engine does."""
        monitor = self._resources.engine_monitor
        assert monitor is not None
        if monitor.declare_lost(engine_index):
            logger.warning(
                "engine %d no longer counts this client attached (%s); its requests there are lost",
                engine_index,
                evidence,
            )

    # --- the blocking drivers ----------------------------------------------------------------

    def attach_from_socket(
        self,
        engines: Sequence[tuple[EngineEndpoint, BaseProcess | None]],
        output_socket: zmq.Socket,
        classifier: OutputClassifier,
        *,
        detach_on_failure: bool = True,
    ) -> None:
        """Connects and says HELLO to each engine, and waits for every answer on the output
        socket directly: only while nothing else reads it (construction, or before the
        output task or thread starts).

        Raises:
            EngineAttachError, TimeoutError: as `settle`.
            EngineDeadError: an engine died meanwhile.
        """
        router = self._router
        pull: zmq.Socket = zmq.Socket.shadow(output_socket.underlying)
        waiting: dict[int, Handshake] = {}

        def drive(handshake: Handshake, step: Step) -> None:
            frames = self._frames(handshake, step)
            if frames is not None:
                send_hello(router, handshake.endpoint.identity, frames, handshake.deadline)
            if step.outcome is not None:
                del waiting[handshake.call_id]
                self.settle(handshake, detach_on_failure=detach_on_failure)

        for endpoint, process in engines:
            self._connections.connect(endpoint, process)
            handshake = self._hellos.handshake(
                endpoint, Purpose.ATTACH, timeout_s=self.hello_timeout_s
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
            decision = classifier.classify(pull.recv_multipart(copy=False))
            if isinstance(decision, DeathNotice):
                dead = learn_death(decision.engine_index, self._engines)
                if dead is not None:
                    raise dead
            elif isinstance(decision, UtilityOutput) and decision.call_id in waiting:
                answered = waiting[decision.call_id]
                drive(answered, answered.on_reply(decision))
            else:
                logger.debug("dropped an unexpected message during the HELLO handshake")

    def handshake_blocking(
        self,
        endpoint: EngineEndpoint,
        purpose: Purpose,
        timeout_s: float,
        known: EngineFacts | None = None,
    ) -> Handshake:
        """Drives one handshake from the caller's thread; the output thread hands the answer
        over as it does a utility call's.

        Returns:
            The finished handshake (its `outcome` says how it ended).

        Raises:
            EngineDeadError, zmq.ZMQError: the engine died, or could not be sent to.
        """
        handshake = self._hellos.handshake(endpoint, purpose, timeout_s=timeout_s, known=known)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        router = self._router
        with self._calls.waiting(handshake.call_id, endpoint.engine_index, future):
            step = handshake.start(time.monotonic())
            while step.outcome is None:
                frames = self._frames(handshake, step)
                if frames is not None:
                    send_hello(router, endpoint.identity, frames, handshake.deadline)
                waited = _wait_blocking(future, handshake.wait_s(time.monotonic()))
                step = self._after_wait(handshake, waited, time.monotonic())
        return handshake

    # --- the asyncio driver --------------------------------------------------------------------

    async def handshake_async(
        self,
        endpoint: EngineEndpoint,
        purpose: Purpose,
        timeout_s: float,
        known: EngineFacts | None = None,
    ) -> Handshake:
        """`handshake_blocking` without blocking the loop; the output task hands the answer
        over."""
        handshake = self._hellos.handshake(endpoint, purpose, timeout_s=timeout_s, known=known)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        router = self._router
        with self._calls.waiting(handshake.call_id, endpoint.engine_index, future):
            step = handshake.start(loop.time())
            while step.outcome is None:
                frames = self._frames(handshake, step)
                if frames is not None:
                    await _send_hello_async(router, endpoint.identity, frames, handshake.deadline)
                waited = await _wait_async(future, handshake.wait_s(loop.time()))
                step = self._after_wait(handshake, waited, loop.time())
        return handshake

    async def attach_async(
        self, endpoint: EngineEndpoint, purpose: Purpose, *, detach_on_failure: bool = True
    ) -> EngineFacts:
        """Attaches (ATTACH, REATTACH) through a handshake; a failure detaches the engine, or
        with `detach_on_failure=False` leaves it counted dead.

        Raises:
            EngineAttachError, TimeoutError: as `settle`.
            EngineDeadError, zmq.ZMQError: the engine died, or could not be sent to.
        """
        try:
            handshake = await self.handshake_async(endpoint, purpose, self.hello_timeout_s)
        except zmq.ZMQError:
            if detach_on_failure:
                self._connections.remove(endpoint.engine_index)
            raise
        facts = self.settle(handshake, detach_on_failure=detach_on_failure)
        assert facts is not None, "an attach that settles has facts"
        return facts

    async def reattach_async(
        self, engine_index: int, *, detach_on_failure: bool = True
    ) -> EngineFacts:
        """Says HELLO again to an engine counted dead that may come back (see
        `AsyncMPClient.reattach_engine_async`).

        Raises:
            ValueError: the engine is not attached, or not counted dead, or may not come back.
            EngineAttachError, EngineDeadError, TimeoutError, zmq.ZMQError: as `attach_async`.
        """
        engines = self._engines
        endpoint = engines.endpoint(engine_index)
        if endpoint is None or not engines.is_dead(engine_index):
            raise ValueError(f"engine {engine_index} is not an attached engine counted dead")
        if not engines.may_return(engine_index):
            raise ValueError(f"engine {engine_index} may not come back to this client")
        monitor = self._resources.engine_monitor
        assert monitor is not None
        monitor.watch(engine_index, is_new_attach=False)
        # The facts of the attach that ended go: until the answer brings new ones, no stats
        # report can say this client is not attached (`DPAsyncMPClient._is_detached_by`).
        engines.begin_reattach(engine_index)
        # Counted dead until it answers: a request meanwhile waits (`wait_for_return`) rather
        # than go to an engine that may never take it.
        return await self.attach_async(
            endpoint, Purpose.REATTACH, detach_on_failure=detach_on_failure
        )

    def reattach_while_alive(self, engine_index: int) -> None:
        """Attaches again, in a side task, an engine this client launched and lost while its
        process lives (it let the client go while the client was paused past its heartbeat
        timeout, say). Engines a cluster link attaches again are its own."""
        engines = self._engines
        if engines.returns.engines_can_return or not engines.may_return(engine_index):
            return
        self._spawn(self._reattach_while_alive(engine_index), f"Reattach{engine_index}")

    async def _reattach_while_alive(self, engine_index: int) -> None:
        engines = self._engines
        while engines.is_dead(engine_index) and engines.may_return(engine_index):
            try:
                await self.reattach_async(engine_index, detach_on_failure=False)
                logger.info("engine %d is attached again", engine_index)
                return
            except (EngineAttachError, EngineDeadError, TimeoutError, zmq.ZMQError) as e:
                logger.warning("engine %d could not be attached again yet: %s", engine_index, e)
            await asyncio.sleep(_REATTACH_RETRY_S)

    def recheck_soon(self) -> None:
        """Asks, in a side task, whether every attached engine still counts this client attached
        (on the monitor's RECHECK_ATTACHED: one may have let this client go without a word).

        Each question is a RECHECK handshake; an engine that let this client go counts as lost
        (`let_go`). An engine that does not answer is left to the monitor.
        """
        if self._recheck_task is not None and not self._recheck_task.done():
            self._is_recheck_due = True  # asked again while asking: once more after
            return
        self._recheck_task = self._spawn(self._recheck_async(), "RecheckAttached")

    async def _recheck_async(self) -> None:
        self._is_recheck_due = True
        while self._is_recheck_due:
            self._is_recheck_due = False
            known = self._engines.attached_facts().values()
            handshakes = await asyncio.gather(
                *(
                    self.handshake_async(endpoint, Purpose.RECHECK, RECHECK_TIMEOUT_S, facts)
                    for endpoint, facts in known
                ),
                return_exceptions=True,
            )
            for handshake in handshakes:
                if not isinstance(handshake, BaseException):  # else dead or removed: told apart
                    self.settle(handshake)

    def _spawn(self, coroutine: Any, name: str) -> asyncio.Task[None]:
        """A side task, cancelled when the client closes."""
        side_tasks = self._resources.side_tasks
        task: asyncio.Task[None] = asyncio.create_task(coroutine, name=name)
        side_tasks.add(task)
        task.add_done_callback(side_tasks.discard)
        return task


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


async def wait_for_return(engines: EngineSet, engine_index: int | None) -> bool:
    """Waits up to ENGINE_RETURN_WAIT_S for a dead engine to be attached again.

    Returns:
        Whether it is attached again (False at once for one that may not come back).
    """
    if engine_index is None:
        return False
    is_back = await wait_for_engines(
        lambda: not engines.is_dead(engine_index), lambda: engines.may_return(engine_index)
    )
    return is_back and engine_index in engines


def _wait_blocking(future: concurrent.futures.Future[Any], timeout_s: float) -> Any:
    """The future's result, its `EngineUtilityError`, or `_NO_ANSWER` after `timeout_s`."""
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        return _NO_ANSWER
    except EngineUtilityError as e:
        return e


async def _wait_async(future: asyncio.Future[Any], timeout_s: float) -> Any:
    """As `_wait_blocking`, on the event loop (the future outlives a timeout)."""
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)
    except TimeoutError:
        return _NO_ANSWER
    except EngineUtilityError as e:
        return e


async def _send_hello_async(
    router: zmq.Socket, identity: EngineIdentity, frames: tuple[Any, ...], deadline: float
) -> None:
    """Sends HELLO without blocking the loop, retrying while the connection is being set up."""
    loop = asyncio.get_running_loop()
    while True:  # connection setup, not the data path
        try:
            send_hello(router, identity, frames, deadline=0.0)
            return
        except zmq.ZMQError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.005)
