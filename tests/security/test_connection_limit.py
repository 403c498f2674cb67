"""An engine holds a bounded number of connections: past the cap a handshake that proves no
cluster key is refused at once (ZAP status 400), while the cluster's own clients still get in
(`shoal.engine.core.connection_gate`)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import zmq
from zmq.utils.monitor import recv_monitor_message

from shoal.engine.core.curve import CurveKeyPair, curve_client
from tests.engine.core_proc_utils import running_engine, tiny_config
from tests.security.peers import closed_engine


def _wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@contextmanager
def _silent_connections(address: str, count: int) -> Iterator[list[socket.socket]]:
    """`count` TCP connections that never start a handshake (a descriptor flood)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with ExitStack() as stack:
        yield [
            stack.enter_context(socket.create_connection((host, int(port)))) for _ in range(count)
        ]


def _handshake_outcome(
    ctx: zmq.Context,
    address: str,
    kept: list[zmq.Socket],
    curve: tuple[CurveKeyPair, bytes] | None = None,
) -> tuple[int, int]:
    """Connects a peer, without CURVE or with (its key pair, the server's key), kept open in
    `kept`; its monitor's first handshake event and that event's value (for
    HANDSHAKE_FAILED_AUTH, the ZAP status)."""
    dealer = ctx.socket(zmq.DEALER)
    kept.append(dealer)
    dealer.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve_client(dealer, *curve)
    monitor = dealer.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )
    dealer.connect(address)
    try:
        assert monitor.poll(5000), "no handshake outcome"
        event = recv_monitor_message(monitor)
        return event["event"], event["value"]
    finally:
        dealer.disable_monitor()
        monitor.close(linger=0)


def test_a_descriptor_flood_does_not_keep_a_cluster_client_out(engine_checkpoint: str) -> None:
    with closed_engine(engine_checkpoint, num_clients=1, max_connections=4) as closed:
        gate = closed.served.proc._socket.gate
        with _silent_connections(closed.endpoint.input_address, 8):
            _wait_for(lambda: gate.live >= 8)  # counted, handshake or not: over the cap
            peer = closed.attached_peer(1)  # a cluster key is admitted all the same
            try:
                assert len(peer.generate("during-flood", max_tokens=4)) == 4
            finally:
                peer.close()
        # The flood's descriptors are released as its connections close.
        _wait_for(lambda: gate.live == 0)
        assert gate.num_refused == 0  # nobody was refused for room: only cluster keys came


def test_past_the_cap_an_open_engine_refuses_with_the_limit_status(engine_checkpoint: str) -> None:
    ctx = zmq.Context()
    peers: list[zmq.Socket] = []
    with running_engine(tiny_config(engine_checkpoint), max_connections=3) as served:
        address = served.endpoint.input_address
        gate = served.proc._socket.gate
        try:
            for _ in range(3):
                assert _handshake_outcome(ctx, address, peers)[0] == zmq.EVENT_HANDSHAKE_SUCCEEDED
            _wait_for(lambda: gate.live == 3)
            # The fourth is refused at once, with a status libzmq does not retry.
            assert _handshake_outcome(ctx, address, peers) == (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)
            assert gate.num_refused == 1
        finally:
            ctx.destroy(linger=0)
            peers.clear()
        # With the three gone, there is room again.
        _wait_for(lambda: gate.live == 0)
        ctx = zmq.Context()
        try:
            assert _handshake_outcome(ctx, address, peers)[0] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        finally:
            ctx.destroy(linger=0)


def test_past_the_cap_made_up_keys_are_refused_as_the_limit(engine_checkpoint: str) -> None:
    ctx = zmq.Context()
    peers: list[zmq.Socket] = []
    with closed_engine(engine_checkpoint, num_clients=1, max_connections=2) as closed:
        gate = closed.served.proc._socket.gate
        address, server_key = closed.endpoint.input_address, closed.endpoint.public_key
        try:
            with _silent_connections(address, 4):
                _wait_for(lambda: gate.live >= 4)
                for _ in range(3):  # each a key nobody handed out
                    stranger = (CurveKeyPair.generate(), server_key)
                    outcome = _handshake_outcome(ctx, address, peers, curve=stranger)
                    assert outcome == (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)
                # Counted (and logged) as the limit, not as three unknown keys.
                assert gate.num_refused == 3
                peer = closed.attached_peer(1)
                try:
                    assert len(peer.generate("past-the-cap", max_tokens=4)) == 4
                finally:
                    peer.close()
        finally:
            ctx.destroy(linger=0)
