"""The engine's input thread: client connections come and go without ever stopping it."""

from __future__ import annotations

import queue
import time
from typing import Any

import zmq

from shoal.engine.core.client_table import close_monitored
from shoal.engine.core.core_io import InputThread
from shoal.engine.core.work_items import AttachClient, DetachClient, InputItem
from shoal.engine.protocol import EngineCoreRequestType, EngineFacts, EngineHello
from shoal.engine.serial import MsgpackEncoder

FACTS = EngineFacts(0, b"engine-0", "tiny", 128, 10, 16, 512)


def _work(work_queue: queue.SimpleQueue[InputItem]) -> list[InputItem]:
    items = []
    while not work_queue.empty():
        items.append(work_queue.get_nowait())
    return items


def test_a_goodbye_and_its_disconnect_in_one_poll_leave_the_thread_serving() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    work_queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
    # Not started: the test takes the thread's turns itself, so it controls what one poll sees.
    thread = InputThread(ctx, router, FACTS, {}, work_queue)
    encoder = MsgpackEncoder()
    pushes: list[zmq.Socket] = []
    try:

        def attach(client_index: int) -> tuple[zmq.Socket, zmq.Socket]:
            client = ctx.socket(zmq.DEALER)
            client.connect(f"tcp://127.0.0.1:{port}")
            pull = ctx.socket(zmq.PULL)
            pull_port = pull.bind_to_random_port("tcp://127.0.0.1")
            hello = EngineHello(client_index, f"tcp://127.0.0.1:{pull_port}", call_id=1)
            client.send_multipart([EngineCoreRequestType.HELLO.value, *encoder.encode(hello)])
            deadline = time.monotonic() + 5
            while not (attached := [w for w in _work(work_queue) if isinstance(w, AttachClient)]):
                assert time.monotonic() < deadline, "no ATTACH"
                thread.serve_once(50)
            pushes.append(attached[0].push)  # the busy loop would hand it to the output thread
            for _ in range(5):  # the output connection's handshake
                thread.serve_once(50)
            return client, pull

        client, pull = attach(5)
        client.send_multipart([EngineCoreRequestType.GOODBYE.value])
        pull.close(linger=0)
        time.sleep(0.3)  # both the GOODBYE and the disconnect event are now waiting
        thread.serve_once(0)
        [detach] = _work(work_queue)
        assert isinstance(detach, DetachClient) and detach.client_index == 5
        close_monitored(pushes.pop(0), detach.monitor)  # what the output thread does with a DETACH

        attach(6)  # still serving: a new client attaches
    finally:
        for push in pushes:
            close_monitored(push, None)
        ctx.destroy(linger=0)
