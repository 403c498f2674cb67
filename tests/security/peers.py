"""Peers for the security tests: keyed clients that speak the wire by hand, and the engine.

`KeyedPeer` is a client the engine admitted (its key is in the engine's `EngineKeys`), so a
test can act as a legitimate client, or as one that holds a key and misbehaves. An attacker
that holds no cluster key is a plain `RawPeer` (`tests.engine.core_proc_utils`) or a bare
socket; `is_shut_out` says whether such a peer gets anything from an engine.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import zmq

from shoal.engine.core.curve import (
    ClientCurve,
    CurveKeyPair,
    EngineKeys,
)
from shoal.engine.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequestType,
    EngineEndpoint,
    EngineHello,
    UtilityOutput,
)
from shoal.engine.serial import MsgpackDecoder, MsgpackEncoder
from tests.engine.core_proc_utils import (
    RawPeer,
    ServedEngine,
    WirePeer,
    running_engine,
    tiny_config,
)

HELLO = EngineCoreRequestType.HELLO
ADD = EngineCoreRequestType.ADD
UTILITY = EngineCoreRequestType.UTILITY


class KeyedPeer(WirePeer):
    """A client holding an admitted key: a CURVE ROUTER to the engine and a CURVE PULL whose
    ZAP handler takes only the engine's pushes."""

    def __init__(
        self,
        endpoint: EngineEndpoint,
        keys: CurveKeyPair,
        client_index: int,
        *,
        rcvhwm: int | None = None,
        rcvbuf: int | None = None,
    ) -> None:
        self.ctx = zmq.Context()
        self.endpoint = endpoint
        self.client_index = client_index
        self.curve = ClientCurve(self.ctx, keys, f"test client {client_index}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        self.curve.secure_input_socket(self.router)
        self.curve.admit_engine(self.router, endpoint.engine_index, endpoint.public_key)
        self.router.setsockopt(zmq.CONNECT_ROUTING_ID, endpoint.identity)
        self.router.connect(endpoint.input_address)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        if rcvhwm is not None:
            self.pull.setsockopt(zmq.RCVHWM, rcvhwm)
        if rcvbuf is not None:
            self.pull.setsockopt(zmq.RCVBUF, rcvbuf)
        self.curve.secure_output_socket(self.pull)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.output_address = f"tcp://127.0.0.1:{port}"
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)

    def hello(self, client_index: int | None = None, output_address: str | None = None) -> Any:
        """HELLO (as `client_index`, with outputs to `output_address`); the engine's answer."""
        index = self.client_index if client_index is None else client_index
        address = output_address or self.output_address
        hello = EngineHello(index, address, call_id=uuid.uuid4().int >> 65)
        self.send_typed(HELLO, hello)
        return self.recv_utility(hello.call_id)

    def recv(self, timeout_s: float = 5.0) -> EngineCoreOutputs:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.pull.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                raise TimeoutError("no message from the engine")
            try:
                frames = self.pull.recv_multipart(zmq.NOBLOCK)
                break
            except zmq.Again:  # a wake-up without a whole message (tiny receive queues)
                time.sleep(0.001)
        assert frames[0] != ENGINE_CORE_DEAD, "the engine died"
        return self.decoder.decode(frames)

    def recv_utility(self, call_id: int, timeout_s: float = 5.0) -> UtilityOutput:
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self.recv(max(0.0, deadline - time.monotonic())).utility_output
            if reply is not None and reply.call_id == call_id:
                return reply

    def call(self, method: str, *args: Any, timeout_s: float = 5.0) -> UtilityOutput:
        call_id = uuid.uuid4().int >> 65
        self.send_typed(UTILITY, (self.client_index, call_id, method, args))
        return self.recv_utility(call_id, timeout_s)

    def generate(self, request_id: str, **params: Any) -> list[int]:
        """Token ids of one greedy request, start to finish."""
        from tests.engine.core_proc_utils import request

        self.send_typed(ADD, request(request_id, **params))
        tokens: list[int] = []
        deadline = time.monotonic() + 20
        while True:
            for output in self.recv(max(0.0, deadline - time.monotonic())).outputs:
                if output.request_id == request_id:
                    assert output.error_message is None, output.error_message
                    tokens += output.new_token_ids
                    if output.finished:
                        return tokens

    def close(self) -> None:
        # The ZAP handler first: destroying the context closes its socket under its poll.
        assert self.curve.close(), "the peer's ZAP handler did not stop"
        self.ctx.destroy(linger=0)


class ClosedEngine:
    """An engine with CURVE and the keys of `num_clients` admitted clients (indices 1..n)."""

    def __init__(self, served: ServedEngine, keys: dict[int, CurveKeyPair]) -> None:
        self.served = served
        self.endpoint = served.endpoint
        self.client_keys = keys

    def peer(self, client_index: int, **kwargs: Any) -> KeyedPeer:
        return KeyedPeer(self.endpoint, self.client_keys[client_index], client_index, **kwargs)

    def attached_peer(self, client_index: int, **kwargs: Any) -> KeyedPeer:
        peer = self.peer(client_index, **kwargs)
        reply = peer.hello()
        assert reply.failure_message is None, reply.failure_message
        return peer


@contextmanager
def closed_engine(
    checkpoint: str,
    num_clients: int = 3,
    *,
    max_connections: int | None = None,
    **kwargs: Any,
) -> Iterator[ClosedEngine]:
    """Config `kwargs` go to `tiny_config`; `max_connections` to the engine."""
    keys = {i: CurveKeyPair.generate() for i in range(1, num_clients + 1)}
    engine_keys = EngineKeys(CurveKeyPair.generate(), {i: k.public for i, k in keys.items()})
    extra = {} if max_connections is None else {"max_connections": max_connections}
    config = tiny_config(checkpoint, **kwargs)
    with running_engine(config, keys=engine_keys, **extra) as served:
        yield ClosedEngine(served, keys)


def is_shut_out(endpoint: EngineEndpoint, wait_s: float = 1.0) -> bool:
    """Whether a peer without the cluster's keys gets nothing from the engine: its HELLO
    cannot even be sent (no connection completes), or is never answered."""
    peer = RawPeer(endpoint)
    try:
        hello = EngineHello(0, peer.output_address, call_id=1)
        try:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    peer.router.send_multipart(
                        [endpoint.identity, HELLO.value, *peer.encoder.encode(hello)]
                    )
                    break
                except zmq.ZMQError:
                    if time.monotonic() > deadline:
                        return True  # the connection never came up
                    time.sleep(0.01)
        except zmq.ZMQError:
            return True
        return peer.is_silent(wait_s)
    finally:
        peer.close()
