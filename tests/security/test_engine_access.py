"""Only admitted clients reach an engine, and what they can do there cannot hurt the others.

Each test replays one finding of an attack on an engine's input (a peer that knows nothing but
its address, or a client that holds a key and misbehaves) while a legitimate client on the same
engine is served correctly throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from shoal.client import AsyncMPClient, EngineAttachError, SyncMPClient
from shoal.engine.core.curve import CurveKeyPair, curve_client
from shoal.engine.errors import RequestError
from shoal.engine.protocol import EngineHello, FinishReason, SamplingParams
from tests.engine.core_proc_utils import request
from tests.security.peers import ADD, HELLO, UTILITY, ClosedEngine, closed_engine, is_shut_out


@pytest.fixture(scope="module")
def closed(engine_checkpoint: str) -> Iterator[ClosedEngine]:
    with closed_engine(engine_checkpoint, num_clients=4) as engine:
        yield engine


def _finishes(peer, request_ids: set[str], timeout_s: float = 20.0) -> dict[str, list]:  # type: ignore[no-untyped-def]
    """Every output of `request_ids` until each has finished (outputs after a finish too)."""
    seen: dict[str, list] = {rid: [] for rid in request_ids}
    unfinished = set(request_ids)
    deadline = time.monotonic() + timeout_s
    while unfinished:
        for output in peer.recv(max(0.0, deadline - time.monotonic())).outputs:
            seen.setdefault(output.request_id, []).append(output)
            if output.finished:
                unfinished.discard(output.request_id)
    return seen


def test_a_peer_without_keys_gets_nothing_while_an_admitted_client_is_served(
    closed: ClosedEngine,
) -> None:
    assert is_shut_out(closed.endpoint)
    peer = closed.attached_peer(1)
    try:
        assert len(peer.generate("ok", max_tokens=4)) == 4
    finally:
        peer.close()


def test_an_unknown_key_is_refused_and_logged_once(
    closed: ClosedEngine, caplog: pytest.LogCaptureFixture
) -> None:
    stranger = CurveKeyPair.generate()
    ctx = zmq.Context()
    try:
        with caplog.at_level(logging.WARNING, logger="shoal.engine.core.curve"):
            for _ in range(5):  # the same stranger comes back again and again
                router = ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                curve_client(router, stranger, closed.endpoint.public_key)
                router.connect(closed.endpoint.input_address)
            time.sleep(1.0)
        lines = [r for r in caplog.records if stranger.public.decode() in r.getMessage()]
        assert len(lines) == 1 and "not admitted" in lines[0].getMessage()
    finally:
        ctx.destroy(linger=0)
    peer = closed.attached_peer(1)
    try:
        assert peer.call("echo", "still here").result.result == "still here"  # type: ignore[union-attr]
    finally:
        peer.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_client_whose_key_was_never_admitted_is_refused_at_once(
    closed: ClosedEngine, mode: str
) -> None:
    keys = CurveKeyPair.generate()  # a well-formed key the cluster never handed out
    start = time.monotonic()
    with pytest.raises(EngineAttachError, match="not admitted"):
        if mode == "sync":
            SyncMPClient([closed.endpoint], client_index=9, curve_keys=keys, hello_timeout_s=30)
        else:
            asyncio.run(_attach_async(closed, keys))
    assert time.monotonic() - start < 5.0, "refused at the handshake, not at the HELLO timeout"
    peer = closed.attached_peer(1)
    try:
        assert len(peer.generate("still served", max_tokens=3)) == 3
    finally:
        peer.close()


async def _attach_async(closed: ClosedEngine, keys: CurveKeyPair) -> None:
    client = AsyncMPClient([], client_index=9, curve_keys=keys, hello_timeout_s=30)
    try:
        await client.add_engine_async(closed.endpoint)
    finally:
        client.shutdown()


def test_no_utility_reaches_the_model_weights_or_kv_cache(closed: ClosedEngine) -> None:
    victim, attacker = closed.attached_peer(1), closed.attached_peer(2)
    try:
        before = victim.generate("before", max_tokens=8)
        for args in (
            ("load_model", ()),
            ("initialize_kv_cache", (1,)),
            ("execute_model", ()),
            ("determine_num_blocks", (1,)),
        ):
            reply = attacker.call("collective_rpc", *args)
            assert reply.failure_message is not None
            assert "only the read-only runner methods" in reply.failure_message
        for method in ("step", "abort_client_requests", "shutdown"):
            reply = attacker.call(method)
            assert reply.failure_message is not None and "not available" in reply.failure_message
        # What only reads the engine stays reachable.
        reply = attacker.call("collective_rpc", "determine_num_blocks", ())
        assert reply.failure_message is None and reply.result is not None
        reply = attacker.call("echo", 1, 2)
        assert reply.failure_message is not None and "takes 1 arguments" in reply.failure_message
        assert victim.generate("after", max_tokens=8) == before  # the same weights, the same cache
    finally:
        victim.close()
        attacker.close()


def test_a_hello_cannot_claim_another_clients_index(closed: ClosedEngine) -> None:
    victim, attacker = closed.attached_peer(1), closed.attached_peer(2)
    try:
        victim.send_typed(ADD, request("long", max_tokens=40))
        # Claiming the victim's index and output address: refused, and the refusal cannot even
        # reach the victim's socket (it is pushed to the holder of the attacker's key).
        hijack = EngineHello(1, victim.output_address, call_id=5)
        attacker.send_typed(HELLO, hijack)
        reply = attacker.hello(client_index=1)
        assert (
            reply.failure_message is not None
            and "cannot claim client_index 1" in reply.failure_message
        )
        assert is_shut_out(closed.endpoint)  # nor can a peer without keys
        seen = _finishes(victim, {"long"})
        assert sum(len(o.new_token_ids) for o in seen["long"]) == 40
        assert [o.finish_reason for o in seen["long"] if o.finished] == [FinishReason.LENGTH]
    finally:
        victim.close()
        attacker.close()


def test_echo_never_returns_memory_the_peer_did_not_send(closed: ClosedEngine) -> None:
    peer = closed.attached_peer(3)
    try:
        nested = msgspec.msgpack.Encoder()
        # A tensor with a shape and no bytes: once answered with uninitialized engine memory.
        header = nested.encode(("float32", (1000, 1000), b""))
        forged = msgspec.msgpack.Ext(1, header)
        peer.send_typed(UTILITY, (3, 77, "echo", [forged]))
        reply = peer.recv_utility(77)
        assert reply.failure_message is not None and "4000000 bytes" in reply.failure_message
        import torch

        echoed = peer.call("echo", torch.arange(6, dtype=torch.float32)).result.result  # type: ignore[union-attr]
        assert echoed.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    finally:
        peer.close()


def test_a_hello_flood_without_keys_does_not_keep_a_client_out(
    closed: ClosedEngine, caplog: pytest.LogCaptureFixture
) -> None:
    ctx = zmq.Context()
    hello = msgspec.msgpack.encode(EngineHello(0, "tcp://127.0.0.1:9", call_id=1))
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(12):  # 1,200 connections, 100 open at a time
                sockets = []
                for _ in range(100):
                    router = ctx.socket(zmq.ROUTER)
                    router.setsockopt(zmq.LINGER, 0)
                    router.setsockopt(zmq.CONNECT_ROUTING_ID, closed.endpoint.identity)
                    router.connect(closed.endpoint.input_address)
                    sockets.append(router)
                for router in sockets:
                    # No connection comes up: each is refused at the handshake.
                    with contextlib.suppress(zmq.ZMQError):
                        router.send_multipart(
                            [closed.endpoint.identity, HELLO.value, hello], zmq.NOBLOCK
                        )
                peer = closed.attached_peer(4)  # a client attaches in the middle of it
                try:
                    assert len(peer.generate("during", max_tokens=2)) == 2
                finally:
                    peer.close()
                for router in sockets:
                    router.close(linger=0)
        assert not [r for r in caplog.records if r.exc_info]  # no traceback for any of them
    finally:
        ctx.destroy(linger=0)


def test_dropped_frames_are_logged_at_a_bounded_rate(
    closed: ClosedEngine, caplog: pytest.LogCaptureFixture
) -> None:
    peer = closed.attached_peer(1)
    try:
        with caplog.at_level(logging.WARNING, logger="shoal.engine.core.core_io"):
            for i in range(2000):
                peer.send(ADD.value, b"\xc1 not msgpack %d" % i)
            assert peer.call("echo", "after").result.result == "after"  # type: ignore[union-attr]
        assert 1 <= len(caplog.records) <= 3
    finally:
        peer.close()


def test_inf_nan_and_out_of_range_values_are_request_errors(closed: ClosedEngine) -> None:
    with pytest.raises(RequestError, match="finite"):
        SamplingParams(temperature=float("inf"))
    with pytest.raises(RequestError, match="finite"):
        SamplingParams(top_p=float("nan"))
    with pytest.raises(RequestError, match="64 bits"):
        SamplingParams(seed=2**70)
    peer = closed.attached_peer(2)
    try:
        hot = request("hot")
        hot.sampling_params.temperature = float("inf")  # past the client's own check
        big = request("big")
        big.sampling_params.seed = 2**63 + 5  # a uint64: msgpack carries it, int64 does not
        peer.send_typed(ADD, hot)
        peer.send_typed(ADD, big)
        seen = _finishes(peer, {"hot", "big"})
        assert "finite" in (seen["hot"][-1].error_message or "")
        assert "64 bits" in (seen["big"][-1].error_message or "")
        assert len(peer.generate("fine", max_tokens=3)) == 3
    finally:
        peer.close()


def test_each_request_id_finishes_once_and_belongs_to_its_client(closed: ClosedEngine) -> None:
    one, two = closed.attached_peer(1), closed.attached_peer(2)
    try:
        one.send_typed(ADD, request("same", max_tokens=12))
        one.send_typed(ADD, request("same", max_tokens=12))  # a duplicate of a live id
        two.send_typed(ADD, request("same", max_tokens=5))  # another client's id: its own
        mine, theirs = _finishes(one, {"same"}), _finishes(two, {"same"})
        time.sleep(0.3)  # a second finish would have arrived by now
        assert one.pull.poll(0) == 0
        assert [o.finish_reason for o in mine["same"] if o.finished] == [FinishReason.LENGTH]
        assert sum(len(o.new_token_ids) for o in mine["same"]) == 12
        assert sum(len(o.new_token_ids) for o in theirs["same"]) == 5
    finally:
        one.close()
        two.close()
