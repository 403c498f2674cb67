"""`SyncMPClient`: the blocking engine-core client; a daemon thread reads the output socket.

It adds to `MPClient` only how outputs are consumed (a thread and a `queue.Queue`) and blocking
calls; sockets, the handshake and the engine set are the base class's.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import zmq

from client.mp_client import (
    AnyFuture,
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
    SchedulerStats,
)
from engine.serial import MsgpackDecoder

# The output thread wakes this often to notice close().
_OUTPUT_THREAD_POLL_MS = 100


class SyncMPClient(MPClient):
    """Blocking client: a daemon thread reads the output socket into a `queue.Queue`.

    Calls are not thread-safe: use one client per sending thread.
    """

    def __init__(self, endpoints: Sequence[EngineEndpoint], **kwargs: Any) -> None:
        super().__init__(endpoints, asyncio_mode=False, **kwargs)
        self.outputs_queue: queue.Queue[EngineCoreOutputs | Exception] = queue.Queue()
        self.output_socket.setsockopt(zmq.RCVTIMEO, _OUTPUT_THREAD_POLL_MS)
        thread = threading.Thread(
            target=_process_outputs_thread,
            args=(
                self.resources,
                self.decoder,
                self.output_socket,
                self.outputs_queue,
                self.utility_results,
                self.utility_engines,
            ),
            name="EngineCoreOutputThread",
            daemon=True,
        )
        self.resources.output_thread = thread
        thread.start()

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next outputs of any attached engine.

        Raises:
            EngineDeadError: an engine died (engine_index says which; None: all, or closed).
            queue.Empty: nothing arrived within `timeout`.
        """
        outputs = self.outputs_queue.get(timeout=timeout)
        if isinstance(outputs, Exception):
            if self.resources.is_output_done:
                self.outputs_queue.put(outputs)  # terminal: every later call fails too
            raise format_exception(outputs)
        return outputs

    def add_request(self, request: EngineCoreRequest, engine_index: int | None = None) -> None:
        request.client_index = self.client_index
        self._send_input(EngineCoreRequestType.ADD, request, self._engine(engine_index))

    def abort_requests(self, request_ids: list[str], engine_index: int | None = None) -> None:
        if request_ids:
            self._send_input(EngineCoreRequestType.ABORT, request_ids, self._engine(engine_index))

    def call_utility(self, method: str, *args: Any, engine_index: int | None = None) -> Any:
        """Calls an allow-listed EngineCore method on one engine and waits for its result.

        Raises:
            EngineUtilityError: the method failed or is not allowed.
            EngineDeadError: the engine died before answering.
        """
        engine = self._engine(engine_index)
        call_id, message = self._new_utility_message(method, args)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.utility_results[call_id] = future
        self.utility_engines[call_id] = self._check_engine(engine)
        try:
            self._send_input_message(message, engine, args)
        except BaseException:
            self.utility_results.pop(call_id, None)
            self.utility_engines.pop(call_id, None)
            raise
        return future.result()

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
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
            if isinstance(item, Exception):
                self.outputs_queue.put(item)
                break
            batch.append(item)
        return batch

    def add_engine(
        self, endpoint: EngineEndpoint, process: BaseProcess | None = None
    ) -> EngineFacts:
        self._connect_engine(endpoint, process)
        call_id, message = self._hello_message()
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.utility_results[call_id] = future
        self.utility_engines[call_id] = endpoint.engine_index
        deadline = time.monotonic() + self._hello_timeout_s
        send_hello(self.input_socket, endpoint.identity, message, deadline)
        try:
            facts = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except EngineUtilityError as e:
            self.remove_engine(endpoint.engine_index)
            raise EngineAttachError(
                f"engine {endpoint.engine_index} refused this client: {e}"
            ) from None
        self.engine_facts[endpoint.engine_index] = facts
        return facts

    def _engine(self, engine_index: int | None) -> EngineIdentity:
        if engine_index is None:
            return self.core_engine
        endpoint = self.engines.get(engine_index)
        if endpoint is None:
            raise EngineDeadError("it is not attached", engine_index=engine_index)
        return endpoint.identity

    def _send_input(
        self, request_type: EngineCoreRequestType, request: Any, engine: EngineIdentity
    ) -> None:
        message = (request_type.value, *self.encoder.encode(request))
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
    decoder: MsgpackDecoder,
    output_socket: zmq.Socket,
    outputs_queue: queue.Queue[EngineCoreOutputs | Exception],
    utility_results: dict[int, AnyFuture],
    utility_engines: dict[int, int],
) -> None:
    """SyncMPClient's output loop: the thread twin of the asyncio `process_outputs_socket`."""
    final_error: Exception | None = None
    try:
        while not resources.is_closed:
            try:
                frames = output_socket.recv_multipart(copy=False)
            except zmq.Again:
                continue
            try:
                if not resources.validate_alive(frames):
                    continue
            except EngineDeadError as dead:
                fail_utility_calls(utility_results, utility_engines, dead.engine_index, dead)
                if resources.is_terminal(dead):
                    final_error = dead
                    return
                outputs_queue.put(dead)
                continue
            outputs: EngineCoreOutputs = decoder.decode(frames)
            utility = outputs.utility_output
            if utility is not None:
                if utility.call_id != EEP_NOTIFICATION_CALL_ID:
                    process_utility_output(utility, utility_results)
                    utility_engines.pop(utility.call_id, None)
                continue
            if outputs.outputs or outputs.scheduler_stats:
                outputs_queue.put(outputs)
        final_error = EngineDeadError("the client was closed")
    except Exception as e:
        final_error = e
    finally:
        resources.is_output_done = True  # before the put: a consumer that sees it re-queues it
        error = format_exception(final_error or EngineDeadError())
        fail_utility_calls(utility_results, utility_engines, None, error)
        if final_error is not None:
            outputs_queue.put(final_error)
