"""EngineCoreProc over real sockets: HELLO, routing by client, utilities, malformed frames, stats."""

from __future__ import annotations

import itertools
import os
import queue
import time

import msgspec
import pytest
import zmq

from shoal.engine.core.core_output import OutputThread
from shoal.engine.core.core_proc import EngineCoreProc
from shoal.engine.core.engine_process import start_engine_process
from shoal.engine.core.work_items import AttachClient, EngineDead
from shoal.engine.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreOutputs,
    EngineCoreRequestType,
    EngineFacts,
    EngineHello,
    FinishReason,
    SchedulerStats,
    UtilityOutput,
    UtilityResult,
)
from shoal.engine.serial import peek_call_id, peek_request_id
from tests.engine.core_proc_utils import (
    NUM_BLOCKS,
    RawPeer,
    ServedEngine,
    call_utility,
    request,
    running_engine,
    tiny_config,
    wait_until,
)

_call_ids = itertools.count(1000)
ADD = EngineCoreRequestType.ADD
UTILITY = EngineCoreRequestType.UTILITY


@pytest.fixture
def peer(engine: ServedEngine):
    raw = RawPeer(engine.endpoint, client_index=0)
    raw.hello()
    yield raw
    raw.close()


def test_hello_answers_with_the_engine_facts(engine: ServedEngine) -> None:
    peer = RawPeer(engine.endpoint)
    try:
        utility = peer.hello().utility_output
        assert utility is not None and utility.result is not None
        facts = utility.result.result
        assert isinstance(facts, EngineFacts)
        assert facts.identity == engine.proc.identity
        assert (facts.num_kv_blocks, facts.block_size, facts.max_model_len) == (NUM_BLOCKS, 16, 256)
    finally:
        peer.close()


def test_requests_stream_back_to_their_sender(peer: RawPeer) -> None:
    peer.send_typed(ADD, request("a", max_tokens=5))
    peer.send_typed(ADD, request("b", [9, 10, 11], max_tokens=3))
    seen = peer.collect_until_finished({"a", "b"})
    assert sum(len(o.new_token_ids) for o in seen["a"]) == 5
    assert sum(len(o.new_token_ids) for o in seen["b"]) == 3
    assert [o.finish_reason for o in seen["a"] if o.finished] == [FinishReason.LENGTH]


def test_wrong_protocol_version_is_refused(engine: ServedEngine) -> None:
    peer = RawPeer(engine.endpoint)
    try:
        utility = peer.hello(protocol_version=99).utility_output
        assert utility is not None and utility.failure_message is not None
        assert "protocol version 99" in utility.failure_message
        # Not attached: its requests are dropped, nothing comes back.
        peer.send_typed(ADD, request("x", max_tokens=2))
        assert peer.is_silent(0.5)
    finally:
        peer.close()


def test_client_index_taken_by_a_live_connection_is_refused_until_it_leaves(
    engine: ServedEngine, peer: RawPeer
) -> None:
    second = RawPeer(engine.endpoint, client_index=0)
    try:
        utility = second.hello().utility_output
        assert utility is not None and utility.failure_message is not None
        assert "already attached" in utility.failure_message
        peer.send(EngineCoreRequestType.GOODBYE.value)
        assert second.hello_until_accepted().failure_message is None
        second.send_typed(ADD, request("again", max_tokens=2))
        assert second.collect_until_finished({"again"})["again"][-1].finished
    finally:
        second.close()


def test_a_client_back_on_a_new_connection_replaces_its_old_one(
    engine: ServedEngine, peer: RawPeer
) -> None:
    # The client's input connection failed on its side while a request ran; it gave up on the
    # request and comes back on a new connection, with the same PULL.
    peer.send_typed(ADD, request("lost", list(range(1, 40)), max_tokens=200))
    assert peer.recv().outputs[0].request_id == "lost"
    back = RawPeer(engine.endpoint, client_index=peer.client_index)
    back.pull.close()
    back.pull, back.output_address = peer.pull, peer.output_address
    try:
        hello = EngineHello(peer.client_index, peer.output_address, call_id=next(_call_ids))
        back.send_typed(EngineCoreRequestType.HELLO, hello)
        assert back.recv_utility(hello.call_id).failure_message is None

        def old_request_is_gone() -> bool:
            stats = call_utility(back, next(_call_ids), "get_stats")
            return isinstance(stats, SchedulerStats) and stats.num_free_blocks == NUM_BLOCKS

        assert wait_until(old_request_is_gone, 5)
        back.send_typed(ADD, request("again", max_tokens=2))
        assert back.collect_until_finished({"again"})["again"][-1].finished
    finally:
        back.router.close(linger=0)
        back.ctx.term()


def test_client_index_in_requests_is_overwritten_by_the_bound_one(engine: ServedEngine) -> None:
    honest, liar = RawPeer(engine.endpoint, 1), RawPeer(engine.endpoint, 2)
    try:
        honest.hello()
        liar.hello()
        forged = request("forged", max_tokens=3)
        forged.client_index = 1  # pretends to be the other client
        liar.send_typed(ADD, forged)
        assert liar.collect_until_finished({"forged"})["forged"][-1].finished
        assert honest.is_silent(0.3)
    finally:
        honest.close()
        liar.close()


def test_frames_from_a_peer_that_never_said_hello_are_dropped(
    engine: ServedEngine, peer: RawPeer
) -> None:
    stranger = RawPeer(engine.endpoint, 5)
    try:
        stranger.send_typed(ADD, request("sneaky", max_tokens=50))
        time.sleep(0.2)
        stats = call_utility(peer, 1, "get_stats")
        assert isinstance(stats, SchedulerStats)
        assert stats.num_running_reqs == stats.num_waiting_reqs == 0
        assert stranger.is_silent(0.2)
    finally:
        stranger.close()


def test_utility_calls_results_failures_and_refusals(peer: RawPeer) -> None:
    assert call_utility(peer, 11, "echo", {"k": [1, 2]}) == {"k": [1, 2]}
    assert call_utility(peer, 12, "reset_prefix_cache") is True
    assert isinstance(call_utility(peer, 13, "get_stats"), SchedulerStats)
    # Nothing that changes the model or the KV cache is on the data plane; reading is.
    peer.send_typed(UTILITY, (0, 14, "collective_rpc", ("load_model", ())))
    reply = peer.recv().utility_output
    assert reply is not None and reply.call_id == 14
    assert reply.failure_message is not None and "read-only" in reply.failure_message
    [num_blocks] = call_utility(peer, 19, "collective_rpc", "determine_num_blocks", ())
    assert isinstance(num_blocks, int) and num_blocks > 0
    peer.send_typed(UTILITY, (0, 16, "echo", (1, 2)))  # arguments are checked
    reply = peer.recv().utility_output
    assert reply is not None and reply.failure_message is not None
    assert "takes 1 arguments, got 2" in reply.failure_message
    peer.send_typed(UTILITY, (0, 15, "shutdown", ()))
    reply = peer.recv().utility_output
    assert reply is not None and reply.call_id == 15
    assert reply.failure_message is not None
    assert "utility method 'shutdown' is not available" in reply.failure_message
    assert call_utility(peer, 17, "echo", 5) == 5  # the engine still serves


def test_unsendable_utility_result_becomes_a_failure() -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    work: queue.SimpleQueue = queue.SimpleQueue()
    thread = OutputThread(2, work, ctx)
    thread.start()
    try:
        unsendable = UtilityOutput(41, result=UtilityResult(object()))
        work.put(AttachClient(0, push, EngineCoreOutputs(utility_output=unsendable), 1))
        reply = msgspec.msgpack.decode(pull.recv(), type=EngineCoreOutputs).utility_output
        assert reply is not None and reply.call_id == 41
        assert reply.failure_message is not None and "cannot be sent" in reply.failure_message
        work.put(EngineDead())
        assert pull.recv_multipart() == [ENGINE_CORE_DEAD, b"2"]
        thread.join(timeout=5)
        assert not thread.is_alive()
    finally:
        ctx.destroy(linger=0)


def _truncated_add() -> bytes:
    payload = msgspec.msgpack.encode(request("truncated-id", max_tokens=3))
    return payload[: len(payload) - 6]


def _wrong_struct_add() -> bytes:
    return msgspec.msgpack.encode(["wrong-struct-id", "not a token list", []])


def _bad_params_add() -> bytes:
    bad = request("bad-params-id", max_tokens=3)
    bad.sampling_params.max_tokens = 0
    return msgspec.msgpack.encode(bad)


@pytest.mark.parametrize(
    "payload, request_id, message",
    [
        (_truncated_add(), "truncated-id", "malformed request"),
        (_wrong_struct_add(), "wrong-struct-id", "Expected `array`"),
        (_bad_params_add(), "bad-params-id", "max_tokens must be at least 1"),
    ],
    ids=["truncated", "wrong-struct", "bad-sampling-params"],
)
def test_malformed_add_gets_an_error_for_its_request(
    engine: ServedEngine, peer: RawPeer, payload: bytes, request_id: str, message: str
) -> None:
    bystander = RawPeer(engine.endpoint, 9)
    try:
        bystander.hello()
        bystander.send_typed(ADD, request("innocent", max_tokens=8))
        peer.send(ADD.value, payload)
        error = peer.recv().outputs
        assert [o.request_id for o in error] == [request_id]
        assert error[0].finish_reason is FinishReason.ERROR
        assert error[0].error_message is not None and message in error[0].error_message
        assert bystander.collect_until_finished({"innocent"})["innocent"][-1].finished
    finally:
        bystander.close()


@pytest.mark.parametrize(
    "frames",
    [
        [ADD.value, os.urandom(64)],
        [b"\x7f", msgspec.msgpack.encode(request("unknown-type"))],
        [ADD.value],
        [ADD.value, b"\x93\x01\x02\x03"],  # a request without a string id
        [UTILITY.value, os.urandom(8)],
        [EngineCoreRequestType.ABORT.value, b"\xc1"],
    ],
    ids=["random-bytes", "unknown-type", "no-payload", "int-id", "random-utility", "bad-abort"],
)
def test_unaddressable_garbage_is_dropped_and_the_engine_keeps_serving(
    peer: RawPeer, frames: list[bytes]
) -> None:
    peer.send(*frames)
    peer.send_typed(ADD, request("after", max_tokens=2))
    seen = peer.collect_until_finished({"after"})
    assert set(seen) == {"after"}  # nothing was answered for the garbage


def test_truncated_utility_call_fails_with_its_call_id(peer: RawPeer) -> None:
    payload = msgspec.msgpack.encode((0, 2**63 + 5, "echo", ["x" * 50]))
    peer.send(UTILITY.value, payload[:-10])
    reply = peer.recv().utility_output
    assert reply is not None and reply.call_id == 2**63 + 5
    assert reply.failure_message is not None and "malformed utility call" in reply.failure_message


def test_peeking_ids_out_of_broken_frames() -> None:
    encoded = msgspec.msgpack.encode(request("x" * 40))
    assert peek_request_id(encoded[:50]) == "x" * 40
    assert peek_request_id(encoded[:10]) is None
    assert peek_request_id(b"\xff\x00") is None
    assert peek_call_id(msgspec.msgpack.encode([1, -7, "m"])) == -7
    assert peek_call_id(msgspec.msgpack.encode([300, 2**64 - 1])) == 2**64 - 1
    assert peek_call_id(b"\x92\x01") is None


def test_abort_mid_stream_frees_the_blocks(peer: RawPeer) -> None:
    long_prompt = list(range(1, 40))
    peer.send_typed(ADD, request("long", long_prompt, max_tokens=200))
    first = peer.recv().outputs
    assert first and first[0].request_id == "long" and not first[0].finished
    busy = call_utility(peer, 31, "get_stats")
    assert isinstance(busy, SchedulerStats) and busy.num_free_blocks < NUM_BLOCKS
    peer.send_typed(EngineCoreRequestType.ABORT, ["long"])

    def is_freed() -> bool:
        stats = call_utility(peer, 32, "get_stats")
        return isinstance(stats, SchedulerStats) and stats.num_free_blocks == NUM_BLOCKS

    while not peer.is_silent(0.2):  # drain outputs sent before the abort
        peer.recv()
    assert wait_until(is_freed, 3)
    stats = call_utility(peer, 33, "get_stats")
    assert isinstance(stats, SchedulerStats)
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0


def test_a_client_cannot_abort_another_clients_request(engine: ServedEngine, peer: RawPeer) -> None:
    other = RawPeer(engine.endpoint, client_index=1)
    try:
        other.hello()
        peer.send_typed(ADD, request("mine", list(range(1, 20)), max_tokens=30))
        assert peer.recv().outputs[0].request_id == "mine"
        other.send_typed(EngineCoreRequestType.ABORT, ["mine"])
        outputs = peer.collect_until_finished({"mine"})
        assert sum(len(o.new_token_ids) for o in outputs["mine"]) == 29
        assert outputs["mine"][-1].finish_reason == FinishReason.LENGTH
    finally:
        other.close()


def test_clients_coming_and_going_never_disturb_the_engine_or_its_other_clients(
    engine: ServedEngine, peer: RawPeer
) -> None:
    peer.send_typed(ADD, request("steady", list(range(1, 20)), max_tokens=120))
    for i in range(30):
        visitor = RawPeer(engine.endpoint, client_index=100 + i)
        visitor.hello()
        visitor.send_typed(ADD, request(f"visit-{i}", max_tokens=50))
        assert visitor.recv().outputs[0].request_id == f"visit-{i}"
        if i % 2:  # half say goodbye; the rest just vanish mid-stream
            visitor.send(EngineCoreRequestType.GOODBYE.value)
        visitor.close()
    outputs = peer.collect_until_finished({"steady"})
    assert sum(len(o.new_token_ids) for o in outputs["steady"]) == 120
    assert not engine.errors and engine.thread.is_alive()
    # Every visitor's request is gone from the engine; a new client is served.
    assert wait_until(lambda: call_utility(peer, 1, "get_stats").num_running_reqs == 0, 10)
    late = RawPeer(engine.endpoint, client_index=200)
    try:
        late.hello()
        late.send_typed(ADD, request("late", max_tokens=3))
        assert sum(len(o.new_token_ids) for o in late.collect_until_finished({"late"})["late"]) == 3
    finally:
        late.close()


def test_fatal_error_tells_every_client_and_ends_the_loop(engine_checkpoint: str) -> None:
    served = ServedEngine(tiny_config(engine_checkpoint), engine_index=4)
    first, second = RawPeer(served.endpoint, 0), RawPeer(served.endpoint, 1)
    try:
        first.hello()
        second.hello()

        def broken_step() -> dict:
            raise RuntimeError("the device fell off the bus")

        served.proc.engine_core.step = broken_step  # type: ignore[method-assign]
        first.send_typed(ADD, request("doomed", max_tokens=5))
        assert first.recv_frames() == [ENGINE_CORE_DEAD, b"4"]
        assert second.recv_frames() == [ENGINE_CORE_DEAD, b"4"]
        served.thread.join(timeout=5)
        assert not served.thread.is_alive()
        assert "fell off the bus" in str(served.errors[0])
    finally:
        first.close()
        second.close()
        served.stop()


def test_shutdown_before_the_loop_runs_and_from_another_thread(engine_checkpoint: str) -> None:
    proc = EngineCoreProc(tiny_config(engine_checkpoint), transport="ipc")
    assert proc.input_address.startswith("ipc://")
    proc.shutdown()
    proc.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        proc.run_busy_loop()
    with running_engine(tiny_config(engine_checkpoint), transport="ipc") as served:
        peer = RawPeer(served.endpoint)
        try:
            peer.hello()
            peer.send_typed(ADD, request("ipc", max_tokens=2))
            assert peer.collect_until_finished({"ipc"})["ipc"][-1].finished
            started = time.monotonic()
            served.stop()
            assert time.monotonic() - started < 2
            assert peer.recv_frames() == [ENGINE_CORE_DEAD, b"0"]
        finally:
            peer.close()


@pytest.mark.slow
def test_engine_process_reports_a_startup_failure(tmp_path) -> None:
    config = tiny_config(str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="failed to start") as info:
        start_engine_process(config, startup_timeout_s=60)
    assert "Traceback" in str(info.value)
