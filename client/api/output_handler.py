"""`OutputHandler`: the one task of an `AsyncLLM` that turns its client's outputs into streams.

It reads the engine client's outputs, has the `OutputProcessor` detokenize them and apply stop
strings (aborting in the engine a request a stop string finished), and hands each request's
outputs to its stream. An engine's death fails the streams it ends: on a rank that died, only
the requests still routed there and not moving to another rank; when no engine can serve any
more, every stream, and the client stays dead (`dead_error`). It also owns the loop the client
is bound to, and closing: open streams fail, the task stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator

from shoal.client.api.output_processor import OutputProcessor, RequestOutputCollector
from shoal.client.api.outputs import RequestOutput
from shoal.client.routing.migration import RequestsLostError
from shoal.client.transport.engine_client import EngineCoreClient
from shoal.engine.errors import EngineDeadError, RequestError
from shoal.engine.protocol import EngineCoreRequest

logger = logging.getLogger(__name__)


class OutputHandler:
    """The output task of one `AsyncLLM` (see the module docstring).

    Args:
        client: the engine client whose outputs it reads.
        processor: the requests' states (detokenizers, stop strings, streams).
    """

    def __init__(self, client: EngineCoreClient, processor: OutputProcessor) -> None:
        self._client = client
        self._processor = processor
        self._task: asyncio.Task[None] | None = None
        # Set once no engine can serve this client any more, or it shut down.
        self.dead_error: EngineDeadError | None = None

    async def stream(
        self, request: EngineCoreRequest, prompt: str | None, session_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """One request's outputs, from its send until it finishes; closing the stream before
        then (the consumer was cancelled, or stopped) aborts the request in its engine.

        Raises:
            RequestError: the engine rejected the request (the message says why).
            EngineDeadError: the engine serving it died, or none can serve any more.
            RuntimeError: on another event loop (`check_loop`).
        """
        self.check_loop()
        if self.dead_error is not None:
            raise self.dead_error
        collector = RequestOutputCollector(request.sampling_params.output_kind)
        state = self._processor.add_request(request, prompt, collector)
        self.ensure_started()
        try:
            await self._client.add_request_async(request, session_id=session_id)
        except BaseException:
            self._processor.remove_request(request.request_id)
            raise
        state.engine_index = self._client.rank_of(request.request_id)
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                if output.error is not None:
                    raise RequestError(output.error)
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                await self.abort(request.request_id)
            raise

    def ensure_started(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="AsyncLLMOutputHandler")

    def check_loop(self) -> None:
        """Refuses a loop other than the one the client's tasks run on.

        Its output tasks (this one and its engine client's) and queues belong to the loop that
        first used it. A second `asyncio.run()` would otherwise wait for outputs that nothing
        reads.

        Raises:
            RuntimeError: called on another event loop.
        """
        loop = asyncio.get_running_loop()
        task = self._task
        loops = (task.get_loop() if task is not None else None, self._client.event_loop())
        if any(bound is not None and bound is not loop for bound in loops):
            raise RuntimeError(
                "this AsyncLLM runs on another event loop (a second asyncio.run()?); "
                "create the AsyncLLM inside the loop that uses it, or shut it down and make a "
                "new one"
            )

    async def abort(self, request_id: str) -> None:
        """Ends a request here as aborted, and in its engine while one can serve."""
        self._processor.abort_requests([request_id])
        if self.dead_error is None and not self._client.is_closed:
            with contextlib.suppress(EngineDeadError):  # nothing left to abort there
                await self._client.abort_requests_async([request_id])

    async def _run(self) -> None:
        client = self._client
        processor = self._processor
        while True:
            try:
                outputs = await client.get_output_async()
            except RequestsLostError as lost:  # requests that could not move off a failed rank
                processor.fail_requests(lost.request_ids, lost)
                continue
            except EngineDeadError as dead:
                if self._fail_on_death(dead):
                    continue
                return
            processed = processor.process_outputs(outputs.outputs, outputs.engine_index)
            if processed.reqs_to_abort:
                # A dead engine's death is reported through this loop anyway.
                with contextlib.suppress(EngineDeadError):
                    await client.abort_requests_async(processed.reqs_to_abort)

    def _fail_on_death(self, dead: EngineDeadError) -> bool:
        """Fails the streams a death ends; returns whether an engine can still serve."""
        client = self._client
        processor = self._processor
        alive = not client.is_terminal(dead)
        if alive and dead.engine_index is not None:
            # Not those the rank handed to another one before it went (a resize), nor those
            # moving to another one now (a failure).
            ids = [
                rid
                for rid in processor.request_ids_on_engine(dead.engine_index)
                if client.rank_of(rid) in (None, dead.engine_index) and not client.is_moving(rid)
            ]
        else:
            ids = processor.request_ids()
        processor.fail_requests(ids, dead)
        if not alive:
            logger.error("no engine can serve this client any more: %s", dead)
            self.dead_error = dead
        return alive

    def close(self) -> None:
        """Fails every open stream and stops the task, from any thread (with or without a
        running loop). Idempotent."""
        self._fail_all()
        task = self._task
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.get_loop().call_soon_threadsafe(task.cancel)

    async def aclose(self) -> None:
        """`close` from a coroutine: also aborts the open requests in the engines, and waits
        for the task to end. From another loop (the first one has closed) its tasks are over,
        and detaching (GOODBYE) aborts the requests in the engines anyway."""
        task = self._task
        on_own_loop = task is None or task.get_loop() is asyncio.get_running_loop()
        pending = self._fail_all()
        if pending and on_own_loop:
            with contextlib.suppress(EngineDeadError):
                await self._client.abort_requests_async(pending)
        if task is not None and on_own_loop:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _fail_all(self) -> list[str]:
        """Fails every open stream; returns their request ids."""
        pending = self._processor.request_ids()
        if pending:
            self._processor.fail_requests(pending, EngineDeadError("the client shut down"))
        self.dead_error = EngineDeadError("the client shut down")
        return pending
