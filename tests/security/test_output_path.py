"""No client can hold an engine's output path: one that does not take its outputs is let go.

A HELLO that names a socket which never completes a PUSH → PULL exchange once hung an engine's
output thread for good, and a client that never read its outputs made the engine hold them
without bound. Both are now isolated: the engine lets that client go and its requests are
aborted, while every other client keeps streaming and getting answers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from shoal.engine.core import client_table, core_output
from shoal.engine.protocol import EngineHello, FinishReason
from tests.engine.core_proc_utils import RawPeer, ServedEngine, request, running_engine, tiny_config
from tests.security.peers import ADD, HELLO, ClosedEngine, KeyedPeer, closed_engine


@pytest.fixture
def quick_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small queues and short timeouts, so that a lagging client is let go within a second."""
    monkeypatch.setattr(client_table, "OUTPUT_SNDHWM", 4)
    monkeypatch.setattr(client_table, "CONNECT_GRACE_S", 1.0)
    monkeypatch.setattr(core_output, "MAX_BACKLOG_MESSAGES", 64)
    monkeypatch.setattr(core_output, "SEND_TIMEOUT_S", 1.0)


@pytest.fixture
def closed(engine_checkpoint: str, quick_limits: None) -> Iterator[ClosedEngine]:
    with closed_engine(engine_checkpoint, num_clients=3) as engine:
        yield engine


def _stream_while(victim: KeyedPeer, request_id: str, num_tokens: int) -> list[int]:
    victim.send_typed(ADD, request(request_id, max_tokens=num_tokens))
    tokens: list[int] = []
    deadline = time.monotonic() + 30
    while True:
        for output in victim.recv(max(0.0, deadline - time.monotonic())).outputs:
            assert output.request_id == request_id
            tokens += output.new_token_ids
            if output.finished:
                assert output.finish_reason == FinishReason.LENGTH
                return tokens


def _num_running(peer: KeyedPeer | RawPeer) -> int:
    if isinstance(peer, KeyedPeer):
        reply = peer.call("get_stats")
    else:
        from tests.engine.core_proc_utils import call_utility

        return call_utility(peer, 99, "get_stats").num_running_reqs  # type: ignore[attr-defined]
    assert reply.result is not None
    return reply.result.result.num_running_reqs  # type: ignore[no-any-return]


def _is_let_go(attacker: KeyedPeer | RawPeer, observer: KeyedPeer | RawPeer) -> bool:
    """Whether the engine has detached `attacker`: a request it sends is no longer taken."""
    deadline = time.monotonic() + 10
    for i in range(1000):
        attacker.send_typed(ADD, request(f"probe-{i}", max_tokens=250))
        time.sleep(0.2)
        if _num_running(observer) == 0:
            return True
        if time.monotonic() > deadline:
            return False
    return False


def test_a_hello_to_a_socket_that_never_takes_outputs_holds_nothing(closed: ClosedEngine) -> None:
    ctx = zmq.Context()
    sink = ctx.socket(zmq.ROUTER)  # never completes a PUSH → PULL exchange
    sink_port = sink.bind_to_random_port("tcp://127.0.0.1")
    victim, attacker = closed.attached_peer(1), closed.peer(2)
    try:
        attacker.send_typed(HELLO, EngineHello(2, f"tcp://127.0.0.1:{sink_port}", call_id=3))
        for i in range(20):  # outputs for it: they once blocked the output thread for good
            attacker.send_typed(ADD, request(f"held-{i}", max_tokens=50))
        assert len(_stream_while(victim, "flows", 60)) == 60
        assert victim.call("echo", "answered").result.result == "answered"  # type: ignore[union-attr]
        late = closed.attached_peer(3)  # HELLO answers still go out
        late.close()
        assert _is_let_go(attacker, victim)
    finally:
        victim.close()
        attacker.close()
        ctx.destroy(linger=0)


def test_the_same_hello_cannot_hold_an_engine_without_keys(
    engine_checkpoint: str, quick_limits: None
) -> None:
    with running_engine(tiny_config(engine_checkpoint)) as served:
        _hold_an_open_engine(served)


def _hold_an_open_engine(served: ServedEngine) -> None:
    """Without CURVE anyone may HELLO: the output path must hold up by itself."""
    ctx = zmq.Context()
    sink = ctx.socket(zmq.ROUTER)
    sink_port = sink.bind_to_random_port("tcp://127.0.0.1")
    victim, attacker = RawPeer(served.endpoint, client_index=1), RawPeer(served.endpoint, 2)
    try:
        victim.hello()
        attacker.send_typed(HELLO, EngineHello(2, f"tcp://127.0.0.1:{sink_port}", call_id=3))
        for i in range(20):
            attacker.send_typed(ADD, request(f"held-{i}", max_tokens=50))
        victim.send_typed(ADD, request("flows", max_tokens=60))
        seen = victim.collect_until_finished({"flows"}, timeout_s=30)
        assert sum(len(o.new_token_ids) for o in seen["flows"]) == 60
        assert _is_let_go(attacker, victim)
    finally:
        victim.close()
        attacker.close()
        ctx.destroy(linger=0)


def test_a_client_that_never_reads_its_outputs_is_let_go(closed: ClosedEngine) -> None:
    # Tiny receive queues: the engine's queue for it fills within a few steps.
    greedy = closed.attached_peer(2, rcvhwm=8)
    victim = closed.attached_peer(1)
    try:
        for i in range(40):
            greedy.send_typed(ADD, request(f"unread-{i}", max_tokens=200, logprobs=5))
        assert len(_stream_while(victim, "flows", 100)) == 100
        assert _is_let_go(greedy, victim)  # its requests aborted, its queue freed
        assert len(_stream_while(victim, "again", 5)) == 5
    finally:
        greedy.close()
        victim.close()
