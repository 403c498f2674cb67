"""The output thread lends its sockets to the busy loop while idle, never reordering a send."""

from __future__ import annotations

import queue

import msgspec
import zmq

from engine.core_io import Op
from engine.core_output import OutputThread
from engine.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutput,
    EngineCoreOutputs,
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
    thread = OutputThread(3, queue.SimpleQueue(), None)
    thread.start()
    try:
        hello = EngineCoreOutputs(utility_output=UtilityOutput(7, result=UtilityResult(None)))
        # The client's PUSH only exists once ATTACH is handled: a send that overtook it would
        # find no socket and be dropped.
        thread.submit((Op.ATTACH, 0, push, hello))
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

        thread.submit((Op.DEAD,))
        assert pull.recv_multipart() == [ENGINE_CORE_DEAD, b"3"]
        thread.join(timeout=5)
        assert not thread.is_alive()
    finally:
        ctx.destroy(linger=0)
