"""The engine set of an asyncio client while it serves: attach, attach again, recheck.

`AsyncEngineSetMixin` is the half of `AsyncMPClient` that changes which engines it talks to
without blocking the event loop: HELLO answers come back through the output task. An engine
counted dead is attached again by whoever may (a cluster link, or the client itself for an
engine it launched); on the engine monitor's RECHECK_ATTACHED the client asks every engine
whether it still counts it attached; a request for an engine being attached again waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import zmq

from shoal.client.attach import RECHECK_TIMEOUT_S, Handshake, Purpose
from shoal.client.mp_client import (
    ENGINE_RETURN_WAIT_S,
    EngineAttachError,
    EngineIdentity,
    MPClient,
)
from shoal.client.output_dispatch import EngineUtilityError
from shoal.client.sockets import send_hello
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import EngineCoreOutputs, EngineEndpoint, EngineFacts

logger = logging.getLogger(__name__)

_RETURN_POLL_S = 0.05


class AsyncEngineSetMixin(MPClient):
    """Run-time engine-set changes of `AsyncMPClient` (see the module docstring)."""

    # AsyncMPClient's: its output task, which HELLO answers come back through, and its queue.
    outputs_queue: asyncio.Queue[EngineCoreOutputs | Exception]
    _ensure_output_queue_task: Callable[[], None]
    # The running recheck, and whether another was asked for while it ran.
    _recheck_task: asyncio.Task[None] | None = None
    _is_recheck_due = False

    def add_engine(
        self, endpoint: EngineEndpoint, process: BaseProcess | None = None
    ) -> EngineFacts:
        """Blocking attach; only before the output task runs (then use `add_engine_async`)."""
        if self.resources.output_queue_task is not None:
            raise RuntimeError("the output task is running: use `await add_engine_async(...)`")
        return super().add_engine(endpoint, process)

    def _on_engine_removed(self, engine_index: int, was_dead: bool) -> None:
        """If the engine's death was not reported yet, the consumer now learns it: requests
        still on it will get no more outputs, so an `EngineDeadError` for it is queued exactly
        as if the engine had died."""
        super()._on_engine_removed(engine_index, was_dead)
        if not was_dead:
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
        return await self._hello_async(endpoint, Purpose.ATTACH)

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
        (this client does that itself: `_on_engine_lost`). Otherwise the death of its last
        engine has ended the output task.

        Args:
            detach_on_failure: whether an engine that refuses or does not answer is removed
                from this client (else it stays, counted dead, to be asked again).

        Raises:
            ValueError: the engine is not attached, or not counted dead, or may not come back.
            EngineAttachError, EngineDeadError, TimeoutError: as for `add_engine_async`.
        """
        engines = self.engine_set
        endpoint = engines.endpoint(engine_index)
        if endpoint is None or not engines.is_dead(engine_index):
            raise ValueError(f"engine {engine_index} is not an attached engine counted dead")
        if not engines.may_return(engine_index):
            raise ValueError(f"engine {engine_index} may not come back to this client")
        self._ensure_output_queue_task()
        assert self.resources.engine_monitor is not None
        self.resources.engine_monitor.watch(engine_index, is_new_attach=False)
        # The facts of the attach that ended go: until the answer brings new ones, no stats
        # report can say this client is not attached (`DPAsyncMPClient._is_detached_by`).
        engines.begin_reattach(engine_index)
        # Counted dead until it answers: a request meanwhile waits (`_wait_for_return`) rather
        # than go to an engine that may never take it.
        return await self._hello_async(
            endpoint, Purpose.REATTACH, detach_on_failure=detach_on_failure
        )

    def _on_engine_lost(self, engine_index: int) -> None:
        """Called by the output task for an engine it learned is dead, but not for good.

        An engine this client launched, lost while its process lives (it let this client go
        while the client was paused past its heartbeat timeout, say), is attached again in a
        side task. Subclasses add what a loss means to them.
        """
        resources = self.resources
        if self.engine_set.engines_can_return or not self.engine_set.may_return(engine_index):
            return  # whoever set engines_can_return attaches them again
        task = asyncio.create_task(
            _reattach_while_alive(weakref.ref(self), engine_index), name=f"Reattach{engine_index}"
        )
        resources.side_tasks.add(task)
        task.add_done_callback(resources.side_tasks.discard)

    async def _hello_async(
        self, endpoint: EngineEndpoint, purpose: Purpose, *, detach_on_failure: bool = True
    ) -> EngineFacts:
        """Attaches (ATTACH, REATTACH) through a handshake; a failure detaches the engine, or
        with `detach_on_failure=False` leaves it counted dead."""
        try:
            handshake = await self._handshake_async(endpoint, purpose, self._hello_timeout_s)
        except zmq.ZMQError:
            self._on_hello_failed(endpoint.engine_index, detach_on_failure)
            raise
        facts = self._settle(handshake, detach_on_failure=detach_on_failure)
        assert facts is not None, "an attach that settles has facts"
        return facts

    async def _handshake_async(
        self,
        endpoint: EngineEndpoint,
        purpose: Purpose,
        timeout_s: float,
        known: EngineFacts | None = None,
    ) -> Handshake:
        """Drives one handshake without blocking the loop; the output task hands the answer
        over as it does a utility call's.

        Returns:
            The finished handshake (its `outcome` says how it ended).

        Raises:
            EngineDeadError, zmq.ZMQError: the engine died, or could not be sent to.
        """
        handshake = self._hellos.handshake(endpoint, purpose, timeout_s=timeout_s, known=known)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self.utility_results[handshake.call_id] = future
        self.utility_engines[handshake.call_id] = endpoint.engine_index
        router: zmq.Socket = zmq.Socket.shadow(self.input_socket.underlying)
        try:
            step = handshake.start(loop.time())
            while step.outcome is None:
                frames = self._hello_frames(handshake, step)
                if frames is not None:
                    await _send_hello_async(router, endpoint.identity, frames, handshake.deadline)
                try:
                    wait_s = handshake.wait_s(loop.time())
                    result = await asyncio.wait_for(asyncio.shield(future), wait_s)
                except TimeoutError:
                    step = self._tick(handshake, loop.time())
                except EngineUtilityError as e:
                    step = handshake.on_refusal(str(e))
                else:
                    step = handshake.on_answer(result)
            return handshake
        finally:
            self.utility_results.pop(handshake.call_id, None)
            self.utility_engines.pop(handshake.call_id, None)

    def _on_hello_failed(self, engine_index: int, detach: bool) -> None:
        if detach:
            self.remove_engine(engine_index)  # else it stays counted dead, to be asked again

    def _recheck_attached(self) -> None:
        """Asks, in a side task, whether every attached engine still counts this client attached
        (on the monitor's RECHECK_ATTACHED: one may have let this client go without a word).

        Each question is a RECHECK handshake (`shoal.client.attach`); an engine that let this
        client go counts as lost (`MPClient._on_let_go`): the requests there fail, and it is
        attached again as any lost engine is. An engine that does not answer is left to the
        monitor.
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
            known = self.engine_set.attached_facts().values()
            handshakes = await asyncio.gather(
                *(
                    self._handshake_async(endpoint, Purpose.RECHECK, RECHECK_TIMEOUT_S, facts)
                    for endpoint, facts in known
                ),
                return_exceptions=True,
            )
            for handshake in handshakes:
                if not isinstance(handshake, BaseException):  # else dead or removed: told apart
                    self._settle(handshake)

    async def _wait_for_return(self, engine_index: int | None) -> bool:
        """Waits up to ENGINE_RETURN_WAIT_S for a dead engine to be attached again.

        Returns:
            Whether it is attached again (False at once for one that may not come back).
        """
        if engine_index is None:
            return False
        engines = self.engine_set
        is_back = await wait_for_engines(
            lambda: not engines.is_dead(engine_index), lambda: engines.may_return(engine_index)
        )
        return is_back and engine_index in engines


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
    client_ref: weakref.ReferenceType[AsyncEngineSetMixin], engine_index: int
) -> None:
    """HELLO to a launched engine the client lost, until it answers or its process exits.

    Holds the client only weakly between tries, so a dropped client is still collected.
    """
    while (client := client_ref()) is not None:
        engines = client.engine_set
        if not engines.is_dead(engine_index) or not engines.may_return(engine_index):
            return
        try:
            await client.reattach_engine_async(engine_index, detach_on_failure=False)
            logger.info("engine %d is attached again", engine_index)
            return
        except (EngineAttachError, EngineDeadError, TimeoutError, zmq.ZMQError) as e:
            logger.warning("engine %d could not be attached again yet: %s", engine_index, e)
        del client, engines
        await asyncio.sleep(_REATTACH_RETRY_S)


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
