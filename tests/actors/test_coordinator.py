"""CoordinatorActor over real ZMQ: engines PUSH reports, clients SUB to rate-limited snapshots."""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import ray
import zmq

from shoal.actors.coordinator import CoordinatorActor, bind_previous_or_new
from shoal.engine.protocol import DPStatsSnapshot, EngineStatsReport, SchedulerStats

_decoder = msgspec.msgpack.Decoder(DPStatsSnapshot)
_encoder = msgspec.msgpack.Encoder()


@pytest.fixture(scope="module")
def coordinator(ray_local: str) -> Iterator[Any]:
    actor: Any = ray.remote(CoordinatorActor).options(num_cpus=0).remote("127.0.0.1")
    ray.get(actor.addresses.remote())
    yield actor
    ray.get(actor.shutdown.remote())
    ray.kill(actor)


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _subscribe(context: zmq.Context[zmq.Socket[bytes]], coordinator: Any) -> zmq.Socket[bytes]:
    _, publish_address = ray.get(coordinator.addresses.remote())
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publish_address)
    return sub


def _pusher(context: zmq.Context[zmq.Socket[bytes]], coordinator: Any) -> zmq.Socket[bytes]:
    report_address, _ = ray.get(coordinator.addresses.remote())
    push = context.socket(zmq.PUSH)
    push.connect(report_address)
    return push


def _receive(sub: zmq.Socket[bytes], timeout_s: float) -> tuple[float, DPStatsSnapshot] | None:
    if not sub.poll(int(timeout_s * 1000)):
        return None
    return time.monotonic(), _decoder.decode(sub.recv())


def _receive_for(sub: zmq.Socket[bytes], duration_s: float) -> list[tuple[float, DPStatsSnapshot]]:
    received = []
    deadline = time.monotonic() + duration_s
    while (remaining := deadline - time.monotonic()) > 0:
        item = _receive(sub, remaining)
        if item is not None:
            received.append(item)
    return received


def _report(rank: int, num_waiting: int, step: int = 0) -> bytes:
    stats = SchedulerStats(num_waiting_reqs=num_waiting, step_counter=step)
    return _encoder.encode(EngineStatsReport(rank, stats, timestamp=time.time()))


def test_new_subscriber_gets_a_snapshot_at_once(
    coordinator: Any, zmq_context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    first = _subscribe(zmq_context, coordinator)
    assert _receive(first, 3.0) is not None
    # The next heartbeat is ~1 s away: an answer well before it can only be the join rule.
    joined_at = time.monotonic()
    second = _subscribe(zmq_context, coordinator)
    item = _receive(second, 3.0)
    assert item is not None
    assert item[0] - joined_at < 0.5


def test_snapshot_carries_latest_report_of_every_rank(
    coordinator: Any, zmq_context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    sub = _subscribe(zmq_context, coordinator)
    push = _pusher(zmq_context, coordinator)
    push.send(_report(1, num_waiting=5))
    push.send(_report(0, num_waiting=2))
    push.send(_report(1, num_waiting=7))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        item = _receive(sub, 1.5)
        assert item is not None
        waiting = {r.engine_index: r.stats.num_waiting_reqs for r in item[1].reports}
        if waiting == {0: 2, 1: 7}:
            assert [r.engine_index for r in item[1].reports] == [0, 1]
            break
    else:
        raise AssertionError("the snapshot never showed both ranks' latest reports")
    stats: dict[int, dict[str, Any]] = ray.get(coordinator.latest_stats.remote())
    assert stats[1]["num_waiting_reqs"] == 7 and stats[1]["timestamp"] > 0


def test_publishes_at_most_every_100_ms_while_changing(
    coordinator: Any, zmq_context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    sub = _subscribe(zmq_context, coordinator)
    assert _receive(sub, 3.0) is not None  # the join snapshot
    push = _pusher(zmq_context, coordinator)
    received: list[tuple[float, DPStatsSnapshot]] = []
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < 1.5:  # a new report every 10 ms
        step += 1
        push.send(_report(0, num_waiting=step % 7, step=step))
        item = _receive(sub, 0.01)
        if item is not None:
            received.append(item)
    received += _receive_for(sub, 0.2)
    times = [t for t, _ in received]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # 1.5 s of constant change: about 15 publishes, far more than heartbeats, never bunched.
    assert 8 <= len(received) <= 18, len(received)
    assert min(gaps) > 0.06, gaps
    seqs = [s.seq for _, s in received]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert received[-1][1].reports[0].stats.step_counter == step


def test_heartbeat_about_once_a_second_when_unchanged(
    coordinator: Any, zmq_context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    sub = _subscribe(zmq_context, coordinator)
    assert _receive(sub, 3.0) is not None
    time.sleep(0.2)  # let anything already changing settle
    received = _receive_for(sub, 3.3)
    times = [t for t, _ in received]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert 2 <= len(received) <= 4, len(received)
    assert all(0.7 < g < 1.4 for g in gaps), gaps
    reports = [s.reports for _, s in received]
    assert all(r == reports[0] for r in reports)  # a heartbeat repeats the same view


def test_malformed_reports_are_dropped_and_the_loop_keeps_running(
    coordinator: Any, zmq_context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    push = _pusher(zmq_context, coordinator)
    push.send(_report(3, num_waiting=4))
    push.send(b"\xc1not msgpack")
    push.send(_encoder.encode({"engine_index": 3}))
    push.send(_encoder.encode([3, {"num_running_reqs": "many"}]))
    push.send_multipart([_report(3, num_waiting=99), b"extra frame"])
    push.send(_encoder.encode(EngineStatsReport(-1, SchedulerStats())))
    push.send(_report(4, num_waiting=1))  # sent last: once it shows, the rest was handled
    deadline = time.monotonic() + 5
    stats: dict[int, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        stats = ray.get(coordinator.latest_stats.remote())
        if 4 in stats:
            break
        time.sleep(0.05)
    assert stats[3]["num_waiting_reqs"] == 4
    assert -1 not in stats
    sub = _subscribe(zmq_context, coordinator)
    item = _receive(sub, 3.0)
    assert item is not None
    assert {r.engine_index: r.stats.num_waiting_reqs for r in item[1].reports}[3] == 4
    for rank in (3, 4):
        ray.get(coordinator.forget_rank.remote(rank))
    assert not {3, 4} & set(ray.get(coordinator.latest_stats.remote()))


def test_a_restarted_coordinator_binds_its_old_address_or_else_a_new_one(
    zmq_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with socket.socket() as probe:  # a port that was in use and is free again
        probe.bind(("127.0.0.1", 0))
        old = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    again = zmq_context.socket(zmq.PULL)
    assert bind_previous_or_new(again, "127.0.0.1", old) == old  # free again: the same address
    taken = zmq_context.socket(zmq.PULL)
    new = bind_previous_or_new(taken, "127.0.0.1", old)  # still bound by `again`: a new port
    assert new != old and new.startswith("tcp://127.0.0.1:")
    again.close(linger=0)
    taken.close(linger=0)
