"""The output thread: lends its sockets to the busy loop while idle, never reordering a send;
stats reports never hold up outputs."""

from __future__ import annotations

import queue
import socket
import time

import msgspec
import zmq

from shoal.engine.core.core_output import STATS_SNDHWM, OutputThread
from shoal.engine.core.work_items import (
    AttachClient,
    EngineDead,
    MoveStats,
    ReportStats,
    SendOutputs,
)
from shoal.engine.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineStatsReport,
    SchedulerStats,
    UtilityOutput,
    UtilityResult,
)


def _received(pull: zmq.Socket, count: int) -> list[EngineCoreOutputs]:
    return [msgspec.msgpack.decode(pull.recv(), type=EngineCoreOutputs) for _ in range(count)]


def test_sends_never_overtake_submitted_work_and_go_inline_once_idle() -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, 5000)  # a dropped or lost message fails, not hangs
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    thread = OutputThread(3, queue.SimpleQueue(), ctx)
    thread.start()
    try:
        hello = EngineCoreOutputs(utility_output=UtilityOutput(7, result=UtilityResult(None)))
        # The client's PUSH only exists once ATTACH is handled: a send that overtook it would
        # find no socket and be dropped.
        thread.submit(AttachClient(0, push, hello, 1))
        for i in range(50):
            thread.send_or_submit(0, EngineCoreOutputs(outputs=[EngineCoreOutput(f"r{i}")]))
        first = _received(pull, 51)
        assert first[0].utility_output is not None and first[0].utility_output.call_id == 7
        assert [o.outputs[0].request_id for o in first[1:]] == [f"r{i}" for i in range(50)]

        # Idle now: these are sent by this (the calling) thread, still in order.
        for i in range(50, 60):
            thread.send_or_submit(0, EngineCoreOutputs(outputs=[EngineCoreOutput(f"r{i}")]))
        later = _received(pull, 10)
        assert [o.outputs[0].request_id for o in later] == [f"r{i}" for i in range(50, 60)]

        thread.submit(EngineDead())
        assert pull.recv_multipart() == [ENGINE_CORE_DEAD, b"3"]
        thread.join(timeout=5)
        assert not thread.is_alive()
    finally:
        ctx.destroy(linger=0)


def test_stats_for_an_absent_coordinator_are_dropped_not_queued_ahead_of_outputs() -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, 5000)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    with socket.socket() as probe:  # a port nobody listens on: a dead coordinator's
        probe.bind(("127.0.0.1", 0))
        coordinator_port = probe.getsockname()[1]
    thread = OutputThread(0, queue.SimpleQueue(), ctx, f"tcp://127.0.0.1:{coordinator_port}")
    thread.start()
    try:
        hello = EngineCoreOutputs(utility_output=UtilityOutput(1, result=UtilityResult(None)))
        thread.submit(AttachClient(0, push, hello, 1))
        report = EngineStatsReport(0, SchedulerStats())
        for _ in range(STATS_SNDHWM * 4):  # would fill the queue and block the next send
            thread.submit(ReportStats(report))
        thread.submit(SendOutputs(0, EngineCoreOutputs(outputs=[EngineCoreOutput("after")])))
        received = _received(pull, 2)
        assert received[1].outputs[0].request_id == "after"

        # The coordinator comes back on another address: reports follow it there.
        reports = ctx.socket(zmq.PULL)
        reports.setsockopt(zmq.RCVTIMEO, 5000)
        new_port = reports.bind_to_random_port("tcp://127.0.0.1")
        thread.submit(MoveStats(f"tcp://127.0.0.1:{new_port}"))
        deadline = time.monotonic() + 5
        while not reports.poll(100):  # the connection comes up in the background
            assert time.monotonic() < deadline
            thread.submit(ReportStats(report))
        assert msgspec.msgpack.decode(reports.recv(), type=EngineStatsReport).engine_index == 0
        thread.submit(EngineDead())
        thread.join(timeout=5)
    finally:
        ctx.destroy(linger=0)
