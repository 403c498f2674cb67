"""AsyncMPClient against real engines over real sockets: every behaviour the seed describes."""

from __future__ import annotations

import asyncio
import gc
import inspect
import random
import weakref
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from shoal.client import AsyncMPClient, EngineUtilityError
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.errors import EngineDeadError, RequestError
from shoal.engine.protocol import (
    EEP_NOTIFICATION_CALL_ID,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    SchedulerStats,
    UtilityOutput,
    UtilityResult,
)
from shoal.engine.serial import MsgpackEncoder
from tests.client.async_utils import TIMEOUT_S, collect
from tests.engine.core_proc_utils import (
    MALFORMED_OUTPUT_MESSAGES,
    NUM_BLOCKS,
    ServedEngine,
    request,
    running_engine,
    tiny_config,
)


def push_frames(client: AsyncMPClient, *messages: list[bytes | memoryview]) -> None:
    """Pushes crafted messages straight into the client's output socket, as an engine would."""
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    try:
        push.connect(client.output_address)
        for frames in messages:
            push.send_multipart(frames)
    finally:
        push.close(linger=2000)
        ctx.term()


def _encode(outputs: EngineCoreOutputs) -> list[bytes | memoryview]:
    return MsgpackEncoder().encode(outputs)


# --- construction and the output task ----------------------------------------------------------


def test_task_starts_lazily_when_built_outside_a_loop(engine: ServedEngine) -> None:
    client = AsyncMPClient([engine.endpoint])
    try:
        assert isinstance(client.ctx, zmq.asyncio.Context)
        assert isinstance(client.input_socket, zmq.asyncio.Socket)
        assert isinstance(client.output_socket, zmq.asyncio.Socket)
        assert client.resources.output_queue_task is None

        async def first_use() -> None:
            await client.add_request_async(request("lazy", max_tokens=2))
            assert client.resources.output_queue_task is not None
            seen = await collect(client, {"lazy"})
            assert seen["lazy"][-1].finished

        asyncio.run(first_use())
    finally:
        client.shutdown()


async def test_task_starts_at_once_inside_a_loop_and_only_once(engine: ServedEngine) -> None:
    client = AsyncMPClient([engine.endpoint])
    try:
        task = client.resources.output_queue_task
        assert task is not None and not task.done()
        for _ in range(3):
            client._ensure_output_queue_task()
        await client.add_request_async(request("once", max_tokens=1))
        await client.call_utility_async("echo", 1)
        assert client.resources.output_queue_task is task
        names = [t.get_name() for t in asyncio.all_tasks()]
        assert names.count("EngineCoreOutputQueueTask") == 1
    finally:
        client.shutdown()


async def test_dropping_the_client_collects_it_and_ends_the_task(engine: ServedEngine) -> None:
    client = AsyncMPClient([engine.endpoint])
    await client.add_request_async(request("gc", max_tokens=2))
    await collect(client, {"gc"})
    task = client.resources.output_queue_task
    assert task is not None
    ref = weakref.ref(client)
    del client
    gc.collect()
    assert ref() is None, "the output task (or something else) kept the client alive"
    await asyncio.wait_for(asyncio.shield(task), TIMEOUT_S)
    assert task.done()


async def test_cancelling_the_task_makes_get_output_raise(engine: ServedEngine) -> None:
    client = AsyncMPClient([engine.endpoint])
    try:
        task = client.resources.output_queue_task
        assert task is not None
        task.cancel()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(client.get_output_async(), TIMEOUT_S)
        with pytest.raises(EngineDeadError):  # every later call too: the task is gone
            await asyncio.wait_for(client.get_output_async(), TIMEOUT_S)
    finally:
        client.shutdown()


def _fail(outputs: EngineCoreOutputs) -> None:
    raise RuntimeError("the hook failed")


async def test_a_failure_in_the_task_surfaces_with_its_cause(engine: ServedEngine) -> None:
    client = AsyncMPClient([engine.endpoint])
    client.events.outputs.subscribe(_fail)
    try:
        await client.add_request_async(request("doomed", max_tokens=2))
        with pytest.raises(EngineDeadError) as info:
            await asyncio.wait_for(client.get_output_async(), TIMEOUT_S)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert "the hook failed" in str(info.value)
    finally:
        client.shutdown()


async def test_malformed_messages_on_the_output_socket_are_dropped(engine: ServedEngine) -> None:
    client = AsyncMPClient([engine.endpoint])
    try:
        push_frames(client, *MALFORMED_OUTPUT_MESSAGES)
        # The first request's outputs come after them: they were dropped by then.
        await client.add_request_async(request("first", max_tokens=1))
        await collect(client, {"first"})
        # Every one but the death notice of an engine this client does not have.
        assert client.classifier.num_dropped == len(MALFORMED_OUTPUT_MESSAGES) - 1
        await client.add_request_async(request("after", max_tokens=3))
        outputs = await collect(client, {"after"})
        assert sum(len(o.new_token_ids) for o in outputs["after"]) == 3
        assert client.engine_set.dead() == []
    finally:
        client.shutdown()


async def test_only_outputs_or_stats_reach_the_queue(engine: ServedEngine) -> None:
    client = AsyncMPClient([engine.endpoint])
    try:
        stats = SchedulerStats(num_running_reqs=7)
        push_frames(
            client,
            _encode(EngineCoreOutputs(engine_index=0)),
            _encode(EngineCoreOutputs(engine_index=0, finished_requests=["x"])),
            _encode(EngineCoreOutputs(engine_index=0, scheduler_stats=stats)),
        )
        first = await asyncio.wait_for(client.get_output_async(), TIMEOUT_S)
        assert first.scheduler_stats == stats
        assert client.outputs_queue.empty()
    finally:
        client.shutdown()


# --- the events the output task emits -------------------------------------------------------


async def test_the_outputs_event_sees_outputs_before_the_queue(engine: ServedEngine) -> None:
    client = AsyncMPClient([engine.endpoint])
    seen: list[EngineCoreOutputs] = []
    client.events.outputs.subscribe(seen.append)
    try:
        await client.add_request_async(request("hooked", max_tokens=3))
        received: list[EngineCoreOutputs] = []
        while not (received and received[-1].outputs[-1].finished):
            received.append(await asyncio.wait_for(client.get_output_async(), TIMEOUT_S))
        assert seen == received
    finally:
        client.shutdown()


class _Listening(AsyncMPClient):
    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        pass


async def test_a_listening_client_is_collected_too(engine: ServedEngine) -> None:
    """The task holds the client's events, which hold a bound method of the client weakly."""
    client = _Listening([engine.endpoint])
    client.events.outputs.subscribe(client.on_outputs)
    await client.add_request_async(request("gc", max_tokens=2))
    await collect(client, {"gc"})
    task = client.resources.output_queue_task
    assert task is not None
    ref = weakref.ref(client)
    del client
    gc.collect()
    assert ref() is None, "the output task (or something else) kept the client alive"
    await asyncio.wait_for(asyncio.shield(task), TIMEOUT_S)


async def test_eep_notification_reaches_its_event_and_never_the_future_table(
    engine: ServedEngine,
) -> None:
    client = AsyncMPClient([engine.endpoint])
    loop = asyncio.get_running_loop()
    notified: asyncio.Future[Any] = loop.create_future()
    client.events.scale_notice.subscribe(notified.set_result)
    try:
        decoy = loop.create_future()
        client.pending_calls.add(EEP_NOTIFICATION_CALL_ID, 0, decoy)
        notice = UtilityOutput(
            EEP_NOTIFICATION_CALL_ID, result=UtilityResult(["RECONFIGURE_FINISHED", 4])
        )
        push_frames(client, _encode(EngineCoreOutputs(engine_index=0, utility_output=notice)))
        client._ensure_output_queue_task()
        assert await asyncio.wait_for(notified, TIMEOUT_S) == ["RECONFIGURE_FINISHED", 4]
        assert len(client.pending_calls) == 1
        assert not decoy.done()
        assert client.outputs_queue.empty()
    finally:
        client.shutdown()


# --- utility calls ----------------------------------------------------------------------------


async def test_utility_results_failures_and_refusals(engine: ServedEngine) -> None:
    client = AsyncMPClient([engine.endpoint])
    try:
        assert await client.call_utility_async("echo", {"a": [1, None]}) == {"a": [1, None]}
        stats = await client.call_utility_async("get_stats")
        assert isinstance(stats, SchedulerStats) and stats.num_total_blocks == NUM_BLOCKS
        # collective_rpc reaches only the runner methods that read; nothing that mutates.
        assert await client.collective_rpc_async("determine_num_blocks") == [NUM_BLOCKS]
        with pytest.raises(EngineUtilityError, match="only the read-only runner methods"):
            await client.collective_rpc_async("initialize_kv_cache", (1,))
        with pytest.raises(EngineUtilityError, match="'abort_client_requests' is not available"):
            await client.call_utility_async("abort_client_requests", 0)
        assert len(client.pending_calls) == 0
    finally:
        client.shutdown()


async def test_tensor_arguments_are_sent_tracked_and_kept_alive(engine: ServedEngine) -> None:
    client = AsyncMPClient([engine.endpoint])
    try:
        tensor = torch.randn(64, 256)
        echoed = await client.call_utility_async("echo", tensor)
        assert torch.equal(echoed, tensor)
        assert len(client.resources.pending_messages) == 1
        tracker, kept = client.resources.pending_messages[0]
        assert isinstance(tracker, zmq.MessageTracker)
        assert kept[0] is tensor
    finally:
        client.shutdown()


async def test_send_input_returns_an_awaitable_and_tracks_tensor_frames(
    engine: ServedEngine,
) -> None:
    client = AsyncMPClient([engine.endpoint])
    try:
        plain = client._send_input(EngineCoreRequestType.ADD, request("awaited", max_tokens=1))
        assert inspect.isawaitable(plain)
        await plain
        assert (await collect(client, {"awaited"}))["awaited"][-1].finished
        assert len(client.resources.pending_messages) == 0
        payload = (client.client_index, 99, "echo", (torch.zeros(1000),))
        message = (EngineCoreRequestType.UTILITY.value, *client.encoder.encode(payload))
        tracked = client._send_input_message(message, client.core_engine, payload)
        assert isinstance(tracked, asyncio.Future)
        assert isinstance(await tracked, zmq.MessageTracker)
        await asyncio.sleep(0)  # done callbacks run on the next loop turn
        assert len(client.resources.pending_messages) == 1
    finally:
        client.shutdown()


class RecordingClient(AsyncMPClient):
    calls: list[str]

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self.calls.append(method)
        return await super().call_utility_async(method, *args)


async def test_collective_rpc_goes_through_call_utility_async(engine: ServedEngine) -> None:
    client = RecordingClient([engine.endpoint])
    client.calls = []
    try:
        assert await client.collective_rpc_async("determine_num_blocks") == [NUM_BLOCKS]
        assert client.calls == ["collective_rpc"]
    finally:
        client.shutdown()


def test_the_base_class_defines_no_hooks() -> None:
    """Its parts meet by events; only the DP clients handle outputs and notifications."""
    assert not hasattr(AsyncMPClient, "process_engine_outputs")
    assert not hasattr(AsyncMPClient, "eep_process_engine_core_notification")


# --- requests -------------------------------------------------------------------------------


async def test_add_request_sets_the_client_index(engine: ServedEngine) -> None:
    client = AsyncMPClient([engine.endpoint], client_index=3)
    try:
        sent = request("indexed", max_tokens=1)
        await client.add_request_async(sent)
        assert sent.client_index == 3
        assert (await collect(client, {"indexed"}))["indexed"][-1].finished
    finally:
        client.shutdown()


def _reference_tokens(
    engine_checkpoint: str, requests: list[EngineCoreRequest]
) -> dict[str, list[int]]:
    core = EngineCore(tiny_config(engine_checkpoint, num_gpu_blocks_override=256))
    for r in requests:
        core.add_request(msgspec.structs.replace(r))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while core.has_unfinished_requests():
        for outputs in core.step().values():
            for output in outputs.outputs:
                tokens[output.request_id].extend(output.new_token_ids)
    return tokens


async def test_many_concurrent_requests_each_get_exactly_their_own_tokens(
    engine_checkpoint: str,
) -> None:
    rng = random.Random(0)
    requests = [
        request(
            f"req-{i}",
            [rng.randrange(1, 500) for _ in range(rng.randint(2, 12))],
            max_tokens=rng.randint(1, 10),
        )
        for i in range(100)
    ]
    expected = _reference_tokens(engine_checkpoint, requests)
    with running_engine(tiny_config(engine_checkpoint, num_gpu_blocks_override=256)) as served:
        client = AsyncMPClient([served.endpoint])
        try:
            await asyncio.gather(*(client.add_request_async(r) for r in requests))
            seen = await collect(client, {r.request_id for r in requests})
        finally:
            client.shutdown()
    assert set(seen) == set(expected)
    for r in requests:
        outputs = seen[r.request_id]
        assert [o.new_token_ids for o in outputs if o.new_token_ids]
        assert sum(o.finished for o in outputs) == 1 and outputs[-1].finished
        assert [t for o in outputs for t in o.new_token_ids] == expected[r.request_id]


async def test_abort_mid_stream_frees_the_blocks(engine: ServedEngine) -> None:
    client = AsyncMPClient([engine.endpoint])
    try:
        await client.add_request_async(request("endless", list(range(1, 50)), max_tokens=200))
        first = await asyncio.wait_for(client.get_output_async(), TIMEOUT_S)
        assert first.outputs[0].request_id == "endless" and not first.outputs[0].finished
        assert (await client.call_utility_async("get_stats")).num_free_blocks < NUM_BLOCKS
        await client.abort_requests_async(["endless"])
        for _ in range(100):
            stats = await client.call_utility_async("get_stats")
            if stats.num_free_blocks == NUM_BLOCKS:
                break
            await asyncio.sleep(0.02)
        assert stats.num_free_blocks == NUM_BLOCKS
        assert stats.num_running_reqs == stats.num_waiting_reqs == 0
    finally:
        client.shutdown()


async def test_clients_never_see_each_others_outputs_and_late_ones_are_served(
    engine: ServedEngine,
) -> None:
    first = AsyncMPClient([engine.endpoint], client_index=0)
    second = AsyncMPClient([engine.endpoint], client_index=1)
    late: AsyncMPClient | None = None
    try:
        for i in range(5):
            await first.add_request_async(request(f"first-{i}", [i + 1, 2, 3], max_tokens=4))
            await second.add_request_async(request(f"second-{i}", [i + 1, 4, 5], max_tokens=6))
        seen_first = await collect(first, {f"first-{i}" for i in range(5)})
        seen_second = await collect(second, {f"second-{i}" for i in range(5)})
        assert all(rid.startswith("first-") for rid in seen_first)
        assert all(rid.startswith("second-") for rid in seen_second)
        assert first.outputs_queue.empty() and second.outputs_queue.empty()
        late = AsyncMPClient([engine.endpoint], client_index=2)
        await late.add_request_async(request("late", max_tokens=3))
        assert (await collect(late, {"late"}))["late"][-1].finish_reason is FinishReason.LENGTH
        assert first.outputs_queue.empty() and second.outputs_queue.empty()
    finally:
        for client in (first, second, late):
            if client is not None:
                client.shutdown()


async def test_a_value_the_wire_cannot_carry_is_a_request_error(engine: ServedEngine) -> None:
    client = AsyncMPClient([engine.endpoint])
    try:
        bad = request("too-big", max_tokens=2)
        bad.sampling_params.seed = 1 << 70  # changed after the params validated themselves
        with pytest.raises(RequestError, match="cannot be sent"):
            await client.add_request_async(bad)
        await client.add_request_async(request("fine", max_tokens=2))  # the client serves on
        assert (await collect(client, {"fine"}))["fine"][-1].finished
    finally:
        client.shutdown()
