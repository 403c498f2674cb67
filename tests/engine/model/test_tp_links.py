"""The ZMQ links between a tensor-parallel driver and a worker that is not its child: frames
both ways, and each end learning that the other's process is gone (pidfds)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from multiprocessing.connection import wait
from typing import Any

import pytest
import zmq

from shoal.engine.model.tp_links import ZmqDriverLink, ZmqWorkerLink

# A worker that echoes every frame until it gets b"exit".
_ECHO_WORKER = """
import os, sys
from shoal.engine.model.tp_links import ZmqDriverLink
link = ZmqDriverLink(sys.argv[1], int(sys.argv[2]))
while (frame := link.recv_bytes()) != b"exit":
    link.send_bytes(frame)
"""


@pytest.fixture
def context() -> Any:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.term()


def test_frames_go_both_ways_and_the_driver_sees_the_worker_exit(context: Any) -> None:
    stopped: list[bool] = []
    link = ZmqWorkerLink(context, on_stop=lambda: stopped.append(True))
    worker = subprocess.Popen([sys.executable, "-c", _ECHO_WORKER, link.address, str(os.getpid())])
    link.attach(worker.pid)
    assert link.pid == worker.pid and link.is_alive()
    link.send_bytes(b"\x91\x01")
    assert link.poll(30.0) and link.recv_bytes() == b"\x91\x01"
    link.send_bytes(b"exit")
    assert wait([link.sentinel], timeout=30.0) == [link.sentinel]  # readable once it exits
    worker.wait(5)
    assert not link.is_alive() and link.exitcode is not None
    with pytest.raises(EOFError):
        link.recv_bytes()
    with pytest.raises(OSError, match="is gone"):
        link.send_bytes(b"late")
    link.stop(0.1)
    assert not stopped  # it had exited: nothing to end


def test_a_worker_waiting_for_a_call_ends_when_the_driver_is_gone(context: Any) -> None:
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    socket = context.socket(zmq.PAIR)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    end = ZmqDriverLink(f"tcp://127.0.0.1:{port}", driver.pid)
    try:
        socket.send(b"call")
        assert end.recv_bytes() == b"call"
        driver.kill()
        driver.wait(5)
        start = time.monotonic()
        with pytest.raises(EOFError):
            end.recv_bytes()
        assert time.monotonic() - start < 5.0
    finally:
        end.close()
        socket.close(linger=0)


def test_a_worker_that_will_not_exit_is_ended_by_its_host(context: Any) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    link = ZmqWorkerLink(context, on_stop=sleeper.kill)
    link.attach(sleeper.pid)
    link.stop(0.2)
    assert sleeper.wait(5) != 0
