"""Helpers for the transport tests: engine configs, engines on a thread, raw peers.

`RawPeer` speaks the client side of the wire by hand (a ROUTER and a PULL), so tests can send
frames no well-behaved client would send and see exactly what comes back.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import zmq

from shoal.engine.config import EngineConfig
from shoal.engine.core.core_proc import EngineCoreProc
from shoal.engine.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineEndpoint,
    EngineHello,
    SamplingParams,
    UtilityOutput,
)
from shoal.engine.serial import MsgpackDecoder, MsgpackEncoder

NUM_BLOCKS = 64
BLOCK_SIZE = 16


# Messages no engine sends, as some other peer of a client's output socket might push them;
# a client drops every one but the death notice of an engine it does not have
# (`OutputClassifier.num_dropped`).
MALFORMED_OUTPUT_MESSAGES: list[list[bytes | memoryview]] = [
    [b"\xc1 not msgpack"],
    [msgspec.msgpack.encode([0, [["r", "not a token list"]]])[:-3]],  # truncated
    [msgspec.msgpack.encode({"engine_index": "zero"})],  # a wrong struct
    [b""],
    [b"ENGINE_CORE_DEAD", b"not an index"],
    [b"ENGINE_CORE_DEAD", b"7"],  # no engine of this client
    [b"x", b"y", b"z"],
]


def tiny_config(path: str, **kwargs: Any) -> EngineConfig:
    kwargs.setdefault("num_gpu_blocks_override", NUM_BLOCKS)
    kwargs.setdefault("block_size", BLOCK_SIZE)
    kwargs.setdefault("max_model_len", 256)
    return EngineConfig.from_kwargs(path, **kwargs)


class ServedEngine:
    """An `EngineCoreProc` whose busy loop runs on a background thread."""

    def __init__(self, config: EngineConfig, **kwargs: Any) -> None:
        self.proc = EngineCoreProc(config, **kwargs)
        self.endpoint = self.proc.endpoint
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._serve, name="busy-loop", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.proc.run_busy_loop()
        except BaseException as e:
            self.errors.append(e)

    def stop(self) -> None:
        self.proc.shutdown()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "the busy loop did not stop on shutdown()"


@contextmanager
def running_engine(config: EngineConfig, **kwargs: Any) -> Iterator[ServedEngine]:
    """A `ServedEngine`, shut down on exit."""
    engine = ServedEngine(config, **kwargs)
    try:
        yield engine
    finally:
        engine.stop()


def request(request_id: str, prompt: list[int] | None = None, **params: Any) -> EngineCoreRequest:
    params.setdefault("temperature", 0.0)
    params.setdefault("ignore_eos", True)
    return EngineCoreRequest(request_id, prompt or [5, 6, 7, 8], SamplingParams(**params))


def on_each_rank(num_ranks: int, body: Callable[[int], object]) -> list[object]:
    """Runs `body(rank)` for every rank at once, one thread each (ranks meet in collectives);
    returns the results by rank and raises the first error."""
    results: list[object] = [None] * num_ranks
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


class WirePeer:
    """Sends frames by hand on a ROUTER connected to one engine; subclasses make the sockets
    (`router`, `endpoint`, `encoder`)."""

    router: zmq.Socket
    endpoint: EngineEndpoint
    encoder: MsgpackEncoder

    def send(self, *frames: bytes | memoryview) -> None:
        deadline = time.monotonic() + 5
        while True:
            try:
                self.router.send_multipart([self.endpoint.identity, *frames])
                return
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH or time.monotonic() > deadline:
                    raise
                time.sleep(0.005)

    def send_typed(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        self.send(request_type.value, *self.encoder.encode(payload))


class RawPeer(WirePeer):
    """A hand-driven client connection: one ROUTER to the engine, one bound PULL for outputs."""

    def __init__(self, endpoint: EngineEndpoint, client_index: int = 0) -> None:
        self.ctx = zmq.Context()
        self.endpoint = endpoint
        self.client_index = client_index
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.CONNECT_ROUTING_ID, endpoint.identity)
        self.router.connect(endpoint.input_address)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.output_address = f"tcp://127.0.0.1:{port}"
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)

    def hello(
        self,
        client_index: int | None = None,
        protocol_version: int | None = None,
        wants_kv_events: bool = False,
    ) -> EngineCoreOutputs:
        index = self.client_index if client_index is None else client_index
        hello = EngineHello(
            index,
            self.output_address,
            call_id=uuid.uuid4().int >> 65,
            wants_kv_events=wants_kv_events,
        )
        if protocol_version is not None:
            hello.protocol_version = protocol_version
        self.send_typed(EngineCoreRequestType.HELLO, hello)
        reply = self.recv()
        assert reply.utility_output is not None and reply.utility_output.call_id == hello.call_id
        return reply

    def hello_until_accepted(self, timeout_s: float = 5.0) -> UtilityOutput:
        """HELLO until the engine accepts it (a detach it is still processing may refuse it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self.hello().utility_output
            assert reply is not None
            if reply.failure_message is None or time.monotonic() > deadline:
                return reply
            time.sleep(0.05)

    def recv_utility(self, call_id: int, timeout_s: float = 5.0) -> UtilityOutput:
        """The reply to one utility call, skipping request outputs that arrive before it."""
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self.recv(max(0.0, deadline - time.monotonic())).utility_output
            if reply is not None and reply.call_id == call_id:
                return reply

    def recv_frames(self, timeout_s: float = 5.0) -> list[bytes]:
        if not self.pull.poll(int(timeout_s * 1000)):
            raise TimeoutError("no message from the engine")
        return self.pull.recv_multipart()

    def recv(self, timeout_s: float = 5.0) -> EngineCoreOutputs:
        frames = self.recv_frames(timeout_s)
        assert frames[0] != ENGINE_CORE_DEAD, "the engine died"
        return self.decoder.decode(frames)

    def is_silent(self, timeout_s: float) -> bool:
        return not self.pull.poll(int(timeout_s * 1000))

    def collect_until_finished(
        self, request_ids: set[str], timeout_s: float = 20.0
    ) -> dict[str, list[Any]]:
        """Every output of `request_ids` until each has finished."""
        seen: dict[str, list[Any]] = {rid: [] for rid in request_ids}
        unfinished = set(request_ids)
        deadline = time.monotonic() + timeout_s
        while unfinished:
            outputs = self.recv(max(0.0, deadline - time.monotonic()))
            for output in outputs.outputs:
                seen.setdefault(output.request_id, []).append(output)
                if output.finished:
                    unfinished.discard(output.request_id)
        return seen

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def call_utility(peer: RawPeer, call_id: int, method: str, *args: object) -> object:
    """A utility call that must succeed; returns its result."""
    peer.send_typed(EngineCoreRequestType.UTILITY, (peer.client_index, call_id, method, args))
    reply = peer.recv_utility(call_id)
    assert reply.failure_message is None, reply.failure_message
    assert reply.result is not None
    return reply.result.result
