"""Failure contract over real processes: engines killed under clients, clients killed under engines."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from shoal.client import AsyncLLM, AsyncMPClient, SamplingParams, SyncMPClient
from shoal.engine.core.engine_process import start_engine_process, stop_engine_process
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import (
    EngineCoreOutputs,
    EngineEndpoint,
    EngineFacts,
    EngineHello,
    UtilityOutput,
    UtilityResult,
)
from shoal.engine.serial import MsgpackDecoder, MsgpackEncoder, tag_structs
from tests.engine.core_proc_utils import (
    ServedEngine,
    request,
    running_engine,
    tiny_config,
    wait_until,
)
from tests.factories import make_tiny_checkpoint
from tests.pausable_driver import ALL_OK, pause_and_resume

ROOT = Path(__file__).resolve().parents[2]
DETECTION_LIMIT_S = 2.0


async def _raises_dead(awaitable: Awaitable[Any]) -> EngineDeadError:
    with pytest.raises(EngineDeadError) as info:
        await asyncio.wait_for(awaitable, 10)
    return info.value


async def _drain_until_dead(client: AsyncMPClient) -> None:
    while True:
        await client.get_output_async()


@pytest.fixture
def launched(engine_checkpoint: str) -> Iterator[tuple[AsyncMPClient, int]]:
    """A client with an engine process of its own (engine 0), and that process's pid."""
    client = AsyncMPClient.make_local(tiny_config(engine_checkpoint), engine_index=0)
    pid = client.engine_set.process(0).pid
    assert pid is not None
    yield client, pid
    client.shutdown()


async def _first_output(client: AsyncMPClient, request_id: str, max_tokens: int) -> None:
    await client.add_request_async(request(request_id, max_tokens=max_tokens))
    await asyncio.wait_for(client.get_output_async(), 10)


@pytest.mark.slow
async def test_killed_engine_fails_every_pending_consumer_within_two_seconds(
    launched: tuple[AsyncMPClient, int],
) -> None:
    client, pid = launched
    await _first_output(client, "streaming", max_tokens=200)
    os.kill(pid, signal.SIGSTOP)  # frozen: the utility call below stays pending
    pending_call = asyncio.ensure_future(client.call_utility_async("get_stats"))
    consumers = [asyncio.ensure_future(_drain_until_dead(client)) for _ in range(3)]
    await asyncio.sleep(0.2)
    assert not pending_call.done()
    # The pending call: an asyncio future, under a call id from uuid1's high 64 bits.
    [(call_id, future)] = client.pending_calls.items()
    assert isinstance(future, asyncio.Future) and 0 <= call_id < 2**64
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    errors = [await _raises_dead(f) for f in (pending_call, *consumers)]
    assert time.monotonic() - killed_at < DETECTION_LIMIT_S
    assert all(e.engine_index == 0 for e in errors)
    with pytest.raises(EngineDeadError):
        await client.add_request_async(request("after-death", max_tokens=2))


@pytest.mark.slow
async def test_killed_engine_without_a_parent_link_is_noticed_by_the_socket_monitor(
    engine_checkpoint: str,
) -> None:
    process, endpoint = start_engine_process(tiny_config(engine_checkpoint), engine_index=6)
    try:
        client = AsyncMPClient([endpoint])  # attached by address only: no process sentinel
        assert client.engine_set.process(6) is None
        await client.add_request_async(request("orphaned", max_tokens=200))
        await asyncio.wait_for(client.get_output_async(), 10)
        assert process.pid is not None
        killed_at = time.monotonic()
        os.kill(process.pid, signal.SIGKILL)
        error = await _raises_dead(_drain_until_dead(client))
        assert error.engine_index == 6
        assert time.monotonic() - killed_at < DETECTION_LIMIT_S
        client.shutdown()
    finally:
        stop_engine_process(process)


@pytest.mark.slow
async def test_a_paused_engine_counts_as_dead_and_is_attached_again_once_it_answers(
    engine_checkpoint: str,
) -> None:
    process, endpoint = start_engine_process(tiny_config(engine_checkpoint), engine_index=4)
    assert process.pid is not None
    try:
        client = AsyncMPClient([endpoint])
        client.set_engines_can_return(True)  # as a cluster link's client
        await client.add_request_async(request("paused", max_tokens=400))
        await asyncio.wait_for(client.get_output_async(), 10)
        os.kill(process.pid, signal.SIGSTOP)  # alive, but its heartbeats stop
        try:
            error = await _raises_dead(_drain_until_dead(client))
            assert error.engine_index == 4
        finally:
            os.kill(process.pid, signal.SIGCONT)
        # Its process lives on: HELLO again on the same socket (ZMQ has reconnected it). The
        # engine replaces the old connection and drops the request this client gave up on.
        facts = await asyncio.wait_for(client.reattach_engine_async(4), 15)
        assert facts.engine_index == 4 and not client.engine_set.is_dead(4)
        deadline = time.monotonic() + 5
        while (await client.call_utility_async("get_stats")).num_running_reqs:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        await client.add_request_async(request("resumed", max_tokens=3))
        outputs = await asyncio.wait_for(client.get_output_async(), 10)
        while not any(o.finished for o in outputs.outputs):
            outputs = await asyncio.wait_for(client.get_output_async(), 10)
        assert [o.request_id for o in outputs.outputs] == ["resumed"]
        client.shutdown()
    finally:
        stop_engine_process(process)


@pytest.mark.slow
async def test_a_launched_engine_is_attached_again_while_it_lives_and_ends_the_client_once_gone(
    launched: tuple[AsyncMPClient, int],
) -> None:
    client, pid = launched
    await _first_output(client, "paused", max_tokens=400)
    os.kill(pid, signal.SIGSTOP)  # its heartbeats stop: lost, but not for good
    try:
        error = await _raises_dead(_drain_until_dead(client))
        assert error.engine_index == 0 and not client.is_terminal(error)
        # A request waits for the engine to be attached again, rather than fail at once.
        waiting = asyncio.ensure_future(client.add_request_async(request("resumed", max_tokens=3)))
        await asyncio.sleep(0.3)
        assert not waiting.done()
    finally:
        os.kill(pid, signal.SIGCONT)
    await asyncio.wait_for(waiting, 15)  # the client says HELLO again by itself
    assert not client.engine_set.is_dead(0)
    finished: list[str] = []
    while "resumed" not in finished:  # the given-up request's last outputs may come first
        outputs = await asyncio.wait_for(client.get_output_async(), 10)
        finished += [o.request_id for o in outputs.outputs if o.finished]
    # Lost again, then its process exits: that death is final, and told as such.
    os.kill(pid, signal.SIGSTOP)
    error = await _raises_dead(_drain_until_dead(client))
    assert not client.is_terminal(error)
    os.kill(pid, signal.SIGKILL)
    error = await _raises_dead(_drain_until_dead(client))
    assert error.engine_index == 0 and client.is_terminal(error)
    assert client.resources.output_queue_task.done()


@pytest.mark.slow
def test_a_driver_paused_past_its_engines_patience_fails_what_it_lost_and_is_served_again(
    engine_checkpoint: str,
) -> None:
    # Its engine drops it while it is stopped, closing the connection to its output socket.
    # Resumed, the client asks the engine whether it is still attached, learns it is not (the
    # answer comes under a new attach serial): what it sent there fails, and it is attached again.
    # Before, every request it sent after it resumed was dropped without a word and hung.
    output = pause_and_resume(["--model", engine_checkpoint])
    assert ALL_OK in output, output
    assert "no longer counts this client attached (it attached this client afresh)" in output


@pytest.mark.slow
def test_a_blocking_llm_paused_past_its_engines_patience_is_served_again(
    engine_checkpoint: str,
) -> None:
    # The same through `LLM(multiprocess=True)`: the recheck runs in the caller's thread,
    # before its next send or while it waits for outputs.
    output = pause_and_resume(["--model", engine_checkpoint, "--sync"])
    assert ALL_OK in output, output
    assert "no longer counts this client attached (it attached this client afresh)" in output


def test_death_before_the_task_starts_waits_in_the_socket_and_surfaces_on_first_use(
    engine_checkpoint: str,
) -> None:
    served = ServedEngine(tiny_config(engine_checkpoint), engine_index=3)
    client = AsyncMPClient([served.endpoint])  # built outside a loop: no task yet
    try:
        served.stop()  # the engine pushes ENGINE_CORE_DEAD to attached clients
        time.sleep(0.3)
        # Nothing consumed the notice: no task exists, no engine is marked dead yet.
        assert client.resources.output_queue_task is None
        assert client.engine_set.dead() == []

        async def first_use() -> EngineDeadError:
            return await _raises_dead(client.get_output_async())

        assert asyncio.run(first_use()).engine_index == 3
    finally:
        client.shutdown()


async def test_fatal_engine_error_reaches_the_async_client(engine_checkpoint: str) -> None:
    served = ServedEngine(tiny_config(engine_checkpoint), engine_index=1)
    client = AsyncMPClient([served.endpoint])
    try:

        def broken_step() -> dict:
            raise RuntimeError("step exploded")

        served.proc.engine_core.step = broken_step  # type: ignore[method-assign]
        await client.add_request_async(request("doomed", max_tokens=4))
        error = await _raises_dead(client.get_output_async())
        assert error.engine_index == 1
        served.thread.join(timeout=5)
        assert "step exploded" in str(served.errors[0])
    finally:
        client.shutdown()
        served.stop()


_VICTIM_CLIENT = """
import sys, time
from shoal.client import SyncMPClient
from shoal.engine.protocol import EngineCoreRequest, EngineEndpoint, SamplingParams
endpoint = EngineEndpoint(0, bytes.fromhex(sys.argv[1]), sys.argv[2])
client = SyncMPClient([endpoint], client_index=7)
params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
for i in range(2):
    client.add_request(EngineCoreRequest(f"victim-{i}", [1, 2, 3], params))
client.get_output(timeout=60)
print("streaming", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_killed_client_has_its_requests_aborted_and_blocks_freed_within_five_seconds(
    tmp_path: Path,
) -> None:
    # A long context, so the victims cannot finish on their own within the test.
    path = make_tiny_checkpoint(tmp_path, "llama", max_position_embeddings=4096)
    config = tiny_config(path, max_model_len=4096, num_gpu_blocks_override=1024)
    with running_engine(config) as served:
        observer = SyncMPClient([served.endpoint], client_index=1)
        victim = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _VICTIM_CLIENT,
                served.endpoint.identity.hex(),
                served.endpoint.input_address,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert victim.stdout is not None
            assert victim.stdout.readline().strip() == "streaming"
            # The second request may join the batch a step after the first one's output.
            assert wait_until(lambda: observer.call_utility("get_stats").num_running_reqs == 2, 5.0)
            killed_at = time.monotonic()
            victim.kill()
            victim.wait()
            while True:
                stats = observer.call_utility("get_stats")
                if stats.num_running_reqs == 0 and stats.num_free_blocks == stats.num_total_blocks:
                    break
                assert time.monotonic() - killed_at < 5.0, "the dead client's requests still run"
                time.sleep(0.05)
            assert stats.num_generation_tokens_total < 2 * (4096 - 3)  # aborted, not finished
            observer.add_request(request("bystander", max_tokens=3))
            while not any(o.finished for o in observer.get_output(timeout=10).outputs):
                pass
        finally:
            if victim.poll() is None:
                victim.kill()
            observer.shutdown()


def test_a_lost_hello_answer_is_asked_for_again(caplog: pytest.LogCaptureFixture) -> None:
    """An engine whose first HELLO answer never arrives is asked again, then attaches.

    The peer here is a bare ROUTER speaking the wire protocol that drops the first HELLO, a
    fault a real engine cannot be made to produce on demand.
    """
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    identity = b"lossy-engine"
    hellos: list[int] = []

    def serve() -> None:
        decoder, encoder = MsgpackDecoder(EngineHello), MsgpackEncoder()
        push = ctx.socket(zmq.PUSH)
        while len(hellos) < 2 and router.poll(10_000):
            _, _, *payload = router.recv_multipart()
            hello = decoder.decode(payload)
            hellos.append(hello.call_id)
            if len(hellos) == 1:
                continue  # lost
            facts = EngineFacts(0, identity, "m", 128, 8, 16, 100)
            reply = EngineCoreOutputs(
                utility_output=UtilityOutput(
                    hello.call_id, result=UtilityResult(tag_structs(facts))
                )
            )
            push.connect(hello.output_address)
            push.send_multipart(encoder.encode(reply))
        push.close(linger=1000)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    endpoint = EngineEndpoint(0, identity, f"tcp://127.0.0.1:{port}")
    client = SyncMPClient([endpoint], hello_timeout_s=20)
    try:
        assert client.engine_set.facts(0).identity == identity
        assert len(hellos) == 2 and hellos[0] == hellos[1]  # the same HELLO, sent again
        assert "has not answered HELLO yet; asking again" in caplog.text
    finally:
        client.shutdown()
        thread.join(timeout=5)
        router.close(linger=0)
        ctx.term()


def test_a_second_event_loop_is_refused_at_once_and_shutdown_works_from_it(
    tmp_path: Path,
) -> None:
    """Two `asyncio.run()` calls on one AsyncLLM: the second would wait for ever without the
    check, as the output task died with the first loop. A utility call alone binds it."""
    llm = AsyncLLM(make_tiny_checkpoint(tmp_path, "llama"), num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def first() -> int:
        return (await llm.get_stats()).num_total_blocks

    async def second() -> None:
        with pytest.raises(RuntimeError, match="another event loop"):
            await asyncio.wait_for(llm.generate("second loop", params).__anext__(), 5)
        with pytest.raises(RuntimeError, match="another event loop"):
            await llm.get_stats()
        await llm.aclose()

    assert asyncio.run(first()) == 64
    asyncio.run(second())
    assert llm.engine_core.resources.is_closed
