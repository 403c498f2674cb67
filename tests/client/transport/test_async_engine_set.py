"""AsyncMPClient over several engines: one dies alone, engines join and leave while serving."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.client import AsyncMPClient
from shoal.client.routing.lb_client import DPLBAsyncMPClient
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import DPStatsSnapshot, EngineFacts, EngineStatsReport, SchedulerStats
from tests.client.async_utils import TIMEOUT_S, collect
from tests.engine.core_proc_utils import RawPeer, ServedEngine, request, running_engine, tiny_config

REPO_ROOT = Path(__file__).resolve().parents[3]


async def test_one_dead_engine_fails_alone_and_the_task_ends_when_all_are_dead(
    engine_checkpoint: str,
) -> None:
    zero = ServedEngine(tiny_config(engine_checkpoint), engine_index=0)
    one = ServedEngine(tiny_config(engine_checkpoint), engine_index=1)
    client = AsyncMPClient([zero.endpoint, one.endpoint])
    try:
        assert set(client.engine_set.attached_facts()) == {0, 1}
        await client.add_request_async(request("on-one", max_tokens=2), one.endpoint.identity)
        assert (await collect(client, {"on-one"}))["on-one"][-1].finished
        one.stop()  # a clean exit still tells attached clients
        with pytest.raises(EngineDeadError) as info:
            await asyncio.wait_for(client.get_output_async(), TIMEOUT_S)
        assert info.value.engine_index == 1
        with pytest.raises(EngineDeadError):
            await client.add_request_async(request("to-dead", max_tokens=2), one.endpoint.identity)
        with pytest.raises(EngineDeadError):
            await client._call_utility_async("echo", 1, engine=one.endpoint.identity)
        task = client.resources.output_queue_task
        assert task is not None and not task.done()
        await client.add_request_async(request("on-zero", max_tokens=2), zero.endpoint.identity)
        assert (await collect(client, {"on-zero"}))["on-zero"][-1].finished
        assert await client.call_utility_async("echo", "alive") == "alive"
        zero.stop()
        with pytest.raises(EngineDeadError) as info:
            await asyncio.wait_for(client.get_output_async(), TIMEOUT_S)
        assert info.value.engine_index == 0
        await asyncio.wait_for(asyncio.shield(task), TIMEOUT_S)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(client.get_output_async(), TIMEOUT_S)
    finally:
        client.shutdown()
        zero.stop()
        one.stop()


async def test_engines_are_added_and_removed_while_serving(engine_checkpoint: str) -> None:
    with (
        running_engine(tiny_config(engine_checkpoint), engine_index=0) as zero,
        running_engine(tiny_config(engine_checkpoint), engine_index=1) as one,
    ):
        client = AsyncMPClient([zero.endpoint])
        try:
            with pytest.raises(RuntimeError, match="add_engine_async"):
                client.add_engine(one.endpoint)
            facts = await client.add_engine_async(one.endpoint)
            assert isinstance(facts, EngineFacts) and facts.engine_index == 1
            await client.add_request_async(request("added", max_tokens=2), one.endpoint.identity)
            assert (await collect(client, {"added"}))["added"][-1].finished
            with pytest.raises(ValueError, match="already attached"):
                await client.add_engine_async(one.endpoint)
            client.remove_engine(1)
            assert set(client.engine_set.indices()) == {0}
            with pytest.raises(EngineDeadError):
                await client._call_utility_async("echo", 1, engine=one.endpoint.identity)
            # GOODBYE freed this client's index on engine 1.
            peer = RawPeer(one.endpoint, client_index=0)
            try:
                assert peer.hello_until_accepted().failure_message is None
            finally:
                peer.close()
            assert await client.call_utility_async("echo", 0) == 0
        finally:
            client.shutdown()


async def test_removing_an_engine_tells_the_consumer_its_requests_are_lost(
    engine_checkpoint: str,
) -> None:
    with running_engine(tiny_config(engine_checkpoint), engine_index=0) as zero:
        client = AsyncMPClient([zero.endpoint])
        try:
            await client.add_request_async(request("long", max_tokens=200), zero.endpoint.identity)
            await asyncio.wait_for(client.get_output_async(), TIMEOUT_S)
            client.remove_engine(0)  # e.g. a cluster link saw the rank die before the monitor did
            while True:  # outputs already queued may come first
                try:
                    await asyncio.wait_for(client.get_output_async(), TIMEOUT_S)
                except EngineDeadError as dead:
                    assert dead.engine_index == 0
                    break
        finally:
            client.shutdown()


async def test_when_engines_can_return_losing_all_of_them_is_not_terminal(
    engine_checkpoint: str,
) -> None:
    first = ServedEngine(tiny_config(engine_checkpoint), engine_index=0)
    client = AsyncMPClient([first.endpoint])
    client.set_engines_can_return(True)
    try:
        client._ensure_output_queue_task()
        first.stop()
        with pytest.raises(EngineDeadError) as info:
            await asyncio.wait_for(client.get_output_async(), TIMEOUT_S)
        assert info.value.engine_index == 0
        task = client.resources.output_queue_task
        assert task is not None and not task.done()
        client.remove_engine(0)
        with running_engine(tiny_config(engine_checkpoint), engine_index=0) as second:
            await client.add_engine_async(second.endpoint)
            await client.add_request_async(request("again", max_tokens=2), second.endpoint.identity)
            assert (await collect(client, {"again"}))["again"][-1].finished
    finally:
        client.shutdown()
        first.stop()


async def test_a_stats_report_that_no_longer_lists_the_client_counts_as_losing_its_engine(
    engine_checkpoint: str,
) -> None:
    with running_engine(tiny_config(engine_checkpoint), engine_index=0) as served:
        client = DPLBAsyncMPClient([served.endpoint], client_index=7)
        try:
            client.set_engines_can_return(True)
            serial = client.engine_set.facts(0).attach_serial
            assert serial >= 1

            def report(attaches_seen: int, attached: list[int]) -> DPStatsSnapshot:
                stats = SchedulerStats(num_running_reqs=1)
                return DPStatsSnapshot(
                    seq=attaches_seen,
                    reports=[
                        EngineStatsReport(
                            0,
                            stats,
                            identity=served.endpoint.identity,
                            attached_clients=attached,
                            attaches_seen=attaches_seen,
                        )
                    ],
                )

            # Measured before this client attached, or listing it: nothing is wrong.
            client._on_stats_snapshot(report(serial - 1, []))
            client._on_stats_snapshot(report(serial, [7]))
            await asyncio.sleep(0.3)
            assert client.lb_engines == [0] and not client.engine_set.dead()
            # Measured after its attach and without it: the engine let it go.
            client._on_stats_snapshot(report(serial + 1, [3]))
            with pytest.raises(EngineDeadError) as info:
                await asyncio.wait_for(client.get_output_async(), TIMEOUT_S)
            assert info.value.engine_index == 0
            assert client.lb_engines == [] and client.engine_set.dead() == [0]

            # A request now waits for a rank to come back, rather than fail at once.
            waiting = asyncio.ensure_future(
                client.add_request_async(request("waiting", max_tokens=2))
            )
            await asyncio.sleep(0.3)
            assert not waiting.done()

            # Attaching again: a report from before the engine answers cannot undo it.
            client._on_stats_snapshot(report(serial + 1, [3]))  # while counted dead: ignored
            reattach = asyncio.ensure_future(client.reattach_engine_async(0))
            await asyncio.sleep(0)  # the HELLO is on its way
            client._on_stats_snapshot(report(serial + 1, [3]))
            facts = await asyncio.wait_for(reattach, TIMEOUT_S)
            await asyncio.sleep(0.3)
            assert client.lb_engines == [0] and not client.engine_set.dead()
            client._on_stats_snapshot(report(facts.attach_serial, [7]))
            assert client.lb_engines == [0]
            await asyncio.wait_for(waiting, TIMEOUT_S)
            assert (await collect(client, {"waiting"}))["waiting"][-1].finished
        finally:
            client.shutdown()


_REMOVE_AND_ADD_AGAIN = """
import asyncio, sys
from shoal.client import AsyncMPClient
from shoal.engine.protocol import EngineEndpoint
from tests.engine.core_proc_utils import request

async def main(identity, address):
    endpoint = EngineEndpoint(0, identity.encode(), address)
    client = AsyncMPClient([endpoint])
    for i in range(12):
        for k in range(50):  # sends still queued when the connection closes
            await client.add_request_async(request(f"r{i}-{k}", max_tokens=1))
        client.remove_engine(0)
        await client.add_engine_async(endpoint)
    client.shutdown()
    print("survived")

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.mark.slow
def test_an_engine_removed_and_added_again_at_once_does_not_abort_the_client(
    engine_checkpoint: str, tmp_path: Path
) -> None:
    # libzmq aborts the process when a connection takes a routing id a closing one still holds
    # (libzmq#1572): the client waits for the old connection to go first.
    script = tmp_path / "remove_and_add_again.py"
    script.write_text(_REMOVE_AND_ADD_AGAIN)
    with running_engine(tiny_config(engine_checkpoint), engine_index=0) as served:
        result = subprocess.run(
            [sys.executable, str(script), served.endpoint.identity.decode(),
             served.endpoint.input_address],
            capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )  # fmt: skip
    assert result.returncode == 0 and "survived" in result.stdout, result.stderr[-2000:]
