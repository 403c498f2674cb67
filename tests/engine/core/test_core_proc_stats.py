"""EngineCoreProc's stats reports: their pace, busy and idle, and the attached clients they list."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from shoal.engine.protocol import EngineCoreRequestType, EngineFacts, EngineStatsReport
from tests.engine.core_proc_utils import RawPeer, call_utility, request, running_engine, tiny_config

ADD = EngineCoreRequestType.ADD


@pytest.fixture
def stats_pull() -> Iterator[tuple[zmq.Socket, str]]:
    """A bound PULL standing in for the coordinator, and the address engines push to."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield pull, f"tcp://127.0.0.1:{port}"
    finally:
        ctx.destroy(linger=0)


@pytest.mark.slow
def test_stats_are_pushed_while_busy_at_most_every_50ms_and_each_second_when_idle(
    engine_checkpoint: str, stats_pull: tuple[zmq.Socket, str]
) -> None:
    pull, address = stats_pull
    decoder = msgspec.msgpack.Decoder(EngineStatsReport)
    config = tiny_config(engine_checkpoint)
    with running_engine(config, engine_index=3, stats_address=address) as served:
        # Reports are dropped until the stats connection is up: wait for the first one.
        assert pull.poll(5000)
        pull.recv()
        peer = RawPeer(served.endpoint)
        peer.hello()
        peer.send_typed(ADD, request("s", max_tokens=240))  # runs for several reports
        reports: list[EngineStatsReport] = []
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            if pull.poll(100):
                reports.append(decoder.decode(pull.recv()))
        peer.close()
    assert all(r.engine_index == 3 for r in reports)
    assert any(r.stats.num_running_reqs == 1 for r in reports)
    assert reports[-1].stats.num_running_reqs == 0  # the idle state was reported too
    # The engine's pace, from when each report was made (arrival times add the delivery's
    # jitter on a loaded machine).
    gaps = [b.timestamp - a.timestamp for a, b in itertools.pairwise(reports)]
    assert min(gaps) >= 0.04
    assert max(gaps) <= 1.3
    idle_gaps = gaps[-2:]
    assert all(g >= 0.9 for g in idle_gaps), gaps  # heartbeats only once idle


def test_stats_say_which_clients_are_attached_as_of_which_attach(
    engine_checkpoint: str, stats_pull: tuple[zmq.Socket, str]
) -> None:
    pull, address = stats_pull
    decoder = msgspec.msgpack.Decoder(EngineStatsReport)

    def next_report_with(predicate: Any) -> EngineStatsReport:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if pull.poll(200) and predicate(report := decoder.decode(pull.recv())):
                return report
        raise AssertionError("no such report")

    config = tiny_config(engine_checkpoint)
    with running_engine(config, stats_address=address) as served:
        first, second = RawPeer(served.endpoint, 0), RawPeer(served.endpoint, 1)
        serials = []
        for peer in (first, second):
            utility = peer.hello().utility_output
            assert utility is not None and utility.result is not None
            facts = utility.result.result
            assert isinstance(facts, EngineFacts)
            serials.append(facts.attach_serial)
        assert serials == [1, 2]
        report = next_report_with(lambda r: r.attaches_seen == 2)
        assert report.attached_clients == [0, 1]
        # A client the engine lets go is missing from every later report.
        second.send(EngineCoreRequestType.GOODBYE.value)
        report = next_report_with(lambda r: r.attached_clients == [0])
        assert report.attaches_seen == 2
        first.close()
        second.close()


@pytest.mark.slow
def test_stats_heartbeat_keeps_its_pace_while_utility_calls_arrive(
    engine_checkpoint: str, stats_pull: tuple[zmq.Socket, str]
) -> None:
    pull, address = stats_pull
    config = tiny_config(engine_checkpoint)
    with running_engine(config, stats_address=address) as served:
        peer = RawPeer(served.endpoint)
        peer.hello()
        assert pull.poll(2000)  # the first report
        pull.recv()
        num_reports, started, call_id = 0, time.monotonic(), 100
        while time.monotonic() - started < 2.6:  # busy with calls, load unchanged
            call_id += 1
            call_utility(peer, call_id, "echo", call_id)
            while pull.poll(0):
                pull.recv()
                num_reports += 1
            time.sleep(0.03)
        peer.close()
    assert 2 <= num_reports <= 4
