"""An engine serves a bounded number of clients: past the cap a HELLO first displaces a client
whose outputs never connected (a flood's), and is otherwise refused with the reason."""

from __future__ import annotations

import queue

import zmq

from shoal.engine.core.client_table import close_monitored
from shoal.engine.core.core_io import InputThread
from shoal.engine.core.work_items import AttachClient, DetachClient, InputItem
from shoal.engine.protocol import EngineCoreOutputs, EngineCoreRequestType, EngineFacts, EngineHello
from shoal.engine.serial import MsgpackDecoder, MsgpackEncoder

FACTS = EngineFacts(0, b"engine-0", "tiny", 128, 10, 16, 512)


def test_past_the_cap_a_flood_is_displaced_and_a_live_client_keeps_its_slot() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    work: queue.SimpleQueue[InputItem] = queue.SimpleQueue()
    # Not started: the test takes the thread's turns, so it sees each decision.
    thread = InputThread(ctx, router, FACTS, {}, work, max_clients=2)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    pushes: list[zmq.Socket] = []

    def hello(client_index: int, output_address: str) -> None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        message = EngineHello(client_index, output_address, call_id=client_index)
        dealer.send_multipart([EngineCoreRequestType.HELLO.value, *encoder.encode(message)])

    def turns(num_turns: int = 10) -> list[InputItem]:
        for _ in range(num_turns):
            thread.serve_once(30)
        items = []
        while not work.empty():
            item = work.get_nowait()
            if isinstance(item, AttachClient):
                pushes.append(item.push)  # what the output thread would own
            items.append(item)
        return items

    try:
        live = ctx.socket(zmq.PULL)
        live_address = f"tcp://127.0.0.1:{live.bind_to_random_port('tcp://127.0.0.1')}"
        hello(1, live_address)
        assert [type(i) for i in turns()] == [AttachClient]  # its outputs connect
        hello(2, "tcp://127.0.0.1:9")  # a flood's: nothing listens there
        assert [type(i) for i in turns()] == [AttachClient]
        hello(3, "tcp://127.0.0.1:9")  # full: the one that never connected makes room
        items = turns()
        assert [type(i) for i in items] == [DetachClient, AttachClient]
        assert items[0].client_index == 2  # type: ignore[union-attr]
        second = ctx.socket(zmq.PULL)
        second_address = f"tcp://127.0.0.1:{second.bind_to_random_port('tcp://127.0.0.1')}"
        hello(4, second_address)  # a live client: 3 (never connected) gives way again
        items = turns()
        assert [type(i) for i in items] == [DetachClient, AttachClient]
        assert items[0].client_index == 3  # type: ignore[union-attr]
        # Both slots are live now: the next HELLO is refused, with the reason, on its socket.
        late = ctx.socket(zmq.PULL)
        late_address = f"tcp://127.0.0.1:{late.bind_to_random_port('tcp://127.0.0.1')}"
        hello(5, late_address)
        assert turns() == []
        assert late.poll(5000)
        reply = decoder.decode(late.recv_multipart()).utility_output
        assert reply is not None and "its maximum" in (reply.failure_message or "")
    finally:
        for push in pushes:
            close_monitored(push, None)
        ctx.destroy(linger=0)
