"""SyncMPClient against real engines: requests, utilities, engine set changes, close, processes."""

from __future__ import annotations

import gc
import os
import queue
import signal
import weakref

import pytest
import zmq

from shoal.client import EngineAttachError, EngineUtilityError, SyncMPClient
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import EngineCoreOutput, FinishReason, SchedulerStats
from tests.engine.core_proc_utils import (
    MALFORMED_OUTPUT_MESSAGES,
    NUM_BLOCKS,
    ServedEngine,
    request,
    running_engine,
    tiny_config,
    wait_until,
)


def collect(client: SyncMPClient, request_ids: set[str]) -> dict[str, list[EngineCoreOutput]]:
    seen: dict[str, list[EngineCoreOutput]] = {}
    unfinished = set(request_ids)
    while unfinished:
        for output in client.get_output(timeout=10).outputs:
            seen.setdefault(output.request_id, []).append(output)
            if output.finished:
                unfinished.discard(output.request_id)
    return seen


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_requests_and_utilities(engine: ServedEngine, transport: str) -> None:
    client = SyncMPClient([engine.endpoint], transport=transport)
    try:
        assert client.output_address.startswith(f"{transport}://")
        assert client.engine_set.facts(0).num_kv_blocks == NUM_BLOCKS
        for i in range(8):
            client.add_request(request(f"s{i}", [i + 1, 7, 9], max_tokens=i + 1))
        seen = collect(client, {f"s{i}" for i in range(8)})
        for i in range(8):
            assert sum(len(o.new_token_ids) for o in seen[f"s{i}"]) == i + 1
            assert seen[f"s{i}"][-1].finish_reason is FinishReason.LENGTH
        assert isinstance(client.call_utility("get_stats"), SchedulerStats)
        # collective_rpc reaches only the runner methods that read; nothing that mutates.
        assert client.collective_rpc("determine_num_blocks") == [NUM_BLOCKS]
        with pytest.raises(EngineUtilityError, match="only the read-only runner methods"):
            client.collective_rpc("load_model")
        with pytest.raises(EngineUtilityError, match="'step' is not available"):
            client.call_utility("step")
        assert len(client.pending_calls) == 0
        with pytest.raises(queue.Empty):
            client.get_output(timeout=0.1)
    finally:
        client.shutdown()


def test_abort_frees_the_blocks(engine: ServedEngine) -> None:
    client = SyncMPClient([engine.endpoint])
    try:
        client.add_request(request("long", list(range(1, 60)), max_tokens=200))
        assert not client.get_output(timeout=10).outputs[0].finished
        client.abort_requests(["long"])
        assert wait_until(lambda: client.call_utility("get_stats").num_free_blocks == NUM_BLOCKS, 3)
    finally:
        client.shutdown()


def test_a_second_client_with_the_same_index_is_refused(engine: ServedEngine) -> None:
    first = SyncMPClient([engine.endpoint], client_index=4)
    try:
        with pytest.raises(EngineAttachError, match="already attached"):
            SyncMPClient([engine.endpoint], client_index=4)
        assert first.call_utility("echo", "still served") == "still served"
    finally:
        first.shutdown()


def test_engines_are_added_and_removed_at_run_time(engine_checkpoint: str) -> None:
    with (
        running_engine(tiny_config(engine_checkpoint), engine_index=0) as zero,
        running_engine(tiny_config(engine_checkpoint), engine_index=5) as five,
    ):
        client = SyncMPClient([zero.endpoint])
        try:
            facts = client.add_engine(five.endpoint)
            assert facts.engine_index == 5 and set(client.engine_set.indices()) == {0, 5}
            client.add_request(request("on-five", max_tokens=3), engine_index=5)
            assert collect(client, {"on-five"})["on-five"][-1].finished
            assert client.call_utility("echo", 5, engine_index=5) == 5
            client.remove_engine(5)
            with pytest.raises(EngineDeadError):
                client.call_utility("echo", 5, engine_index=5)
            with pytest.raises(ValueError):
                client.remove_engine(5)
            assert client.call_utility("echo", 0) == 0
        finally:
            client.shutdown()


def test_engine_death_fails_waiters_and_later_calls(engine_checkpoint: str) -> None:
    served = ServedEngine(tiny_config(engine_checkpoint), engine_index=2)
    client = SyncMPClient([served.endpoint])
    try:
        client.add_request(request("cut", max_tokens=200))
        client.get_output(timeout=10)
        served.stop()
        with pytest.raises(EngineDeadError) as info:
            while True:
                client.get_output(timeout=5)
        assert info.value.engine_index == 2
        with pytest.raises(EngineDeadError):
            client.call_utility("echo", 1)
        with pytest.raises(EngineDeadError):
            client.get_output(timeout=1)  # the thread ended: the error stays
    finally:
        client.shutdown()
        served.stop()


def test_close_wakes_the_consumer_and_dropping_the_client_stops_its_thread(
    engine: ServedEngine,
) -> None:
    client = SyncMPClient([engine.endpoint])
    client.shutdown()
    with pytest.raises(EngineDeadError):
        client.get_output(timeout=5)
    other = SyncMPClient([engine.endpoint])
    thread = other.resources.output_thread
    assert thread is not None and thread.is_alive()
    ref = weakref.ref(other)
    del other
    gc.collect()
    assert ref() is None
    thread.join(timeout=5)
    assert not thread.is_alive()


@pytest.mark.slow
def test_make_local_launches_the_engine_process_and_close_stops_it(engine_checkpoint: str) -> None:
    client = SyncMPClient.make_local(tiny_config(engine_checkpoint), engine_index=1)
    process = client.engine_set.process(1)
    try:
        assert process.is_alive()
        client.add_request(request("local", max_tokens=4))
        assert collect(client, {"local"})["local"][-1].finished
    finally:
        client.shutdown()
    assert not process.is_alive()
    assert process.exitcode == 0  # SIGTERM is a clean exit


def _until_dead(client: SyncMPClient) -> EngineDeadError:
    with pytest.raises(EngineDeadError) as info:
        while True:
            client.get_output(timeout=10)
    return info.value


@pytest.mark.slow
def test_a_launched_engine_that_stalled_is_attached_again_at_the_next_call_until_it_is_gone(
    engine_checkpoint: str,
) -> None:
    client = SyncMPClient.make_local(tiny_config(engine_checkpoint), engine_index=0)
    pid = client.engine_set.process(0).pid
    assert pid is not None
    try:
        client.add_request(request("stalled", max_tokens=400))
        client.get_output(timeout=10)
        os.kill(pid, signal.SIGSTOP)  # its heartbeats stop: lost, but not for good
        try:
            assert _until_dead(client).engine_index == 0
        finally:
            os.kill(pid, signal.SIGCONT)
        client.add_request(request("resumed", max_tokens=3))  # says HELLO again first
        finished: list[str] = []
        while "resumed" not in finished:  # the given-up request's last outputs may come first
            finished += [o.request_id for o in client.get_output(timeout=10).outputs if o.finished]
        os.kill(pid, signal.SIGKILL)  # gone for good: told once more, and final
        assert _until_dead(client).engine_index == 0
        assert client.resources.is_output_done
        with pytest.raises(EngineDeadError):
            client.add_request(request("after", max_tokens=2))
    finally:
        client.shutdown()


def test_malformed_messages_on_the_output_socket_are_dropped(engine: ServedEngine) -> None:
    client = SyncMPClient([engine.endpoint])
    try:
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(client.output_address)
        for frames in MALFORMED_OUTPUT_MESSAGES:
            push.send_multipart(frames)
        push.close(linger=2000)
        ctx.term()
        expected = len(MALFORMED_OUTPUT_MESSAGES) - 1  # all but a death notice of no engine here
        assert wait_until(lambda: client.classifier.num_dropped == expected, timeout_s=10)
        client.add_request(request("after", max_tokens=3))
        assert sum(len(o.new_token_ids) for o in collect(client, {"after"})["after"]) == 3
        assert client.engine_set.dead() == []
    finally:
        client.shutdown()
