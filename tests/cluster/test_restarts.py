"""What a served two-rank cluster and its drivers live through: the coordinator and the registry
restarted (on the same addresses or new ones), a rank killed or hung (its requests fail, Ray
restarts it, drivers attach it again), a driver paused past the engines' patience.

The tests run in order on one cluster: the registry restarts before a rank is killed, so the
restarted registry must be watching the engines again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time

import pytest
import ray

from shoal.actors.membership import RankState
from shoal.client import AsyncLLM
from shoal.client.api.outputs import RequestOutput
from shoal.client.routing.cluster_link import ATTACH_TIMEOUT_S
from shoal.cluster.launch import ClusterHandle
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import DPStatsSnapshot
from tests.cluster.dp_cluster import cluster_fixtures, dp_client, final, greedy
from tests.pausable_driver import ALL_OK, pause_and_resume
from tests.ray_utils import ray_env

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


cluster, llm = cluster_fixtures("restarts")


async def test_a_restarted_coordinator_keeps_its_addresses_and_subscribers(
    llm: AsyncLLM, cluster: ClusterHandle
) -> None:
    before, after = await _restart_coordinator(llm, cluster, block_old_ports=False)
    assert after == before


async def test_a_coordinator_restarted_elsewhere_is_followed_by_engines_and_drivers(
    llm: AsyncLLM, cluster: ClusterHandle
) -> None:
    before, after = await _restart_coordinator(llm, cluster, block_old_ports=True)
    assert after[0] != before[0] and after[1] != before[1]


async def _restart_coordinator(
    llm: AsyncLLM, cluster: ClusterHandle, *, block_old_ports: bool
) -> tuple[tuple[str | None, str | None], tuple[str, str]]:
    """Kills the coordinator and waits until this driver gets snapshots of both ranks from
    the new incarnation; a late driver is then served. Returns (old, new) addresses.

    With `block_old_ports`, something else takes the old ports first, so the new incarnation
    binds new ones: engines must push to, and this driver subscribe at, the new addresses.
    """
    client = dp_client(llm)
    snapshots: list[DPStatsSnapshot] = []
    on_snapshot = client._on_stats_snapshot

    def record(snapshot: DPStatsSnapshot) -> None:
        snapshots.append(snapshot)
        on_snapshot(snapshot)

    client._on_stats_snapshot = record  # type: ignore[method-assign]
    try:
        deadline = time.monotonic() + 30
        while not snapshots:  # one from the running coordinator first
            await asyncio.sleep(0.05)
        before = await cluster.registry.membership.remote()
        old = (before.stats_report_address, before.stats_publish_address)
        ray.kill(cluster.coordinator, no_restart=False)
        with contextlib.ExitStack() as blockers:
            if block_old_ports:
                for address in old:
                    assert address is not None
                    blockers.enter_context(await _listen_when_free(address))

            def restarted() -> list[DPStatsSnapshot]:
                """Snapshots from the first whose seq went back (a new incarnation counts anew)."""
                for i in range(1, len(snapshots)):
                    if snapshots[i].seq < snapshots[i - 1].seq:
                        return snapshots[i:]
                return []

            while not any({r.engine_index for r in s.reports} == {0, 1} for s in restarted()):
                assert time.monotonic() < deadline, ("no snapshot from the new coordinator", old)
                await asyncio.sleep(0.1)
            addresses = await cluster.coordinator.addresses.remote()
            after = await cluster.registry.membership.remote()
            assert (after.stats_report_address, after.stats_publish_address) == addresses
        late = await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name="late driver")
        try:
            output = await final(late, "after the restart", greedy(3))
            assert len(output.outputs[0].token_ids) == 3
        finally:
            await late.aclose()
        return old, addresses
    finally:
        client._on_stats_snapshot = on_snapshot  # type: ignore[method-assign]


async def _listen_when_free(address: str) -> socket.socket:
    """A listening socket on `address`'s port, once its dead owner has let go of it."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    deadline = time.monotonic() + 10
    while True:
        blocker = socket.socket()
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            blocker.bind((host, int(port)))
            blocker.listen()
            return blocker
        except OSError:
            blocker.close()
            assert time.monotonic() < deadline, f"{address} stays taken"
            await asyncio.sleep(0.01)


async def test_a_restarted_registry_keeps_the_cluster_and_its_drivers(
    llm: AsyncLLM, cluster: ClusterHandle
) -> None:
    before = await cluster.registry.membership.remote()
    own_index = dp_client(llm).client_index
    # What `shoal serve` does while it serves: it must keep serving through the restart.
    done_serving = threading.Event()
    server = threading.Thread(
        target=cluster.wait_until_stop_requested, args=(0.5, done_serving.is_set), daemon=True
    )
    server.start()
    ray.kill(cluster.registry, no_restart=False)
    deadline = time.monotonic() + 30
    while True:
        await asyncio.sleep(0.2)
        try:
            after = await cluster.registry.membership.remote()
        except ray.exceptions.RayActorError:
            assert time.monotonic() < deadline, "the registry did not come back"
            continue
        if after.epoch > before.epoch:
            break
    assert {r: i.endpoint for r, i in after.ranks.items()} == {
        r: i.endpoint for r, i in before.ranks.items()
    }
    clients = await cluster.registry.clients.remote()
    assert own_index in [c.client_index for c in clients]
    late = await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name="after registry")
    try:
        assert dp_client(late).client_index > max(c.client_index for c in clients)
        outputs = await asyncio.gather(
            final(late, "new driver", greedy(3)), final(llm, "old driver", greedy(3))
        )
        assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3]
    finally:
        await late.aclose()
    assert server.is_alive()
    done_serving.set()
    server.join(timeout=5)
    # The next test kills a rank: the restarted registry must be watching the engines again.


async def _streams_on(llm: AsyncLLM, rank: int, count: int) -> list[asyncio.Task[RequestOutput]]:
    """`count` long requests pinned to `rank`, once all of them are in flight."""
    streams = [
        asyncio.create_task(final(llm, f"long {i}", greedy(400), data_parallel_rank=rank))
        for i in range(count)
    ]
    while len(dp_client(llm).router) < count:
        await asyncio.sleep(0.01)
    return streams


def _identity_of(cluster: ClusterHandle, rank: int) -> bytes:
    endpoint = cluster.membership().ranks[rank].endpoint
    assert endpoint is not None
    return endpoint.identity


async def _new_incarnation_attached(
    cluster: ClusterHandle, rank: int, old_identity: bytes, drivers: list[AsyncLLM]
) -> None:
    """Waits until `rank` is READY under a new identity and every driver routes to it."""
    deadline = time.monotonic() + 90
    while True:
        info = cluster.membership().ranks[rank]
        if (
            info.state == RankState.READY
            and info.endpoint is not None
            and info.endpoint.identity != old_identity
            and all(rank in dp_client(d).lb_engines for d in drivers)
        ):
            return
        assert time.monotonic() < deadline, (info, [dp_client(d).lb_engines for d in drivers])
        await asyncio.sleep(0.2)


async def test_killed_rank_fails_its_requests_and_comes_back(
    llm: AsyncLLM, cluster: ClusterHandle
) -> None:
    victim, survivor = 0, 1
    doomed = await _streams_on(llm, victim, 3)
    await asyncio.sleep(0.2)  # decoding on the victim
    old_identity = _identity_of(cluster, victim)
    ray.kill(cluster.engine(victim), no_restart=False)
    killed_at = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*doomed, return_exceptions=True), 10)
    assert time.monotonic() - killed_at < 2.0
    assert all(isinstance(r, EngineDeadError) for r in results), results

    # The other rank keeps serving meanwhile.
    alive = await asyncio.wait_for(final(llm, "still here", greedy(4)), 30)
    assert alive.data_parallel_rank == survivor

    # Ray restarts the victim; it re-registers and this driver attaches it again.
    await _new_incarnation_attached(cluster, victim, old_identity, [llm])
    back = await asyncio.wait_for(
        final(llm, "welcome back", greedy(4), data_parallel_rank=victim), 30
    )
    assert back.data_parallel_rank == victim
    assert len(back.outputs[0].token_ids) == 4

    # Routing sees the new incarnation's load, not the last report of the old one (whose step
    # counter is far ahead of the new engine's and would outrank every fresh report).
    deadline = time.monotonic() + 5
    while True:
        steps = (await dp_client(llm).call_utility_all_async("get_stats"))[victim].step_counter
        load = dp_client(llm).router.loads.get(victim)
        if load is not None and load.stats is not None and load.stats.step_counter <= steps:
            break
        assert time.monotonic() < deadline, (load, steps)
        await asyncio.sleep(0.1)


async def test_a_hung_rank_fails_its_requests_is_restarted_and_holds_up_no_new_driver(
    llm: AsyncLLM, cluster: ClusterHandle
) -> None:
    victim, survivor = 1, 0
    stuck = await _streams_on(llm, victim, 2)
    old_identity = _identity_of(cluster, victim)
    pid = ray.get(cluster.engine(victim).health.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)  # alive to Ray, deaf to everyone
    try:
        stopped_at = time.monotonic()
        # The driver's heartbeats to the rank go unanswered: its requests fail.
        results = await asyncio.wait_for(asyncio.gather(*stuck, return_exceptions=True), 20)
        assert time.monotonic() - stopped_at < 8.0
        assert all(isinstance(r, EngineDeadError) for r in results), results

        # A driver that attaches meanwhile is not held up by the deaf rank.
        started = time.monotonic()
        newcomer = await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name="newcomer")
        try:
            assert time.monotonic() - started < ATTACH_TIMEOUT_S + 5
            served = await asyncio.wait_for(final(newcomer, "meanwhile", greedy(4)), 30)
            assert served.data_parallel_rank == survivor

            # The registry probes the rank, finds it hung and has Ray start it again; both
            # drivers attach the new incarnation.
            await _new_incarnation_attached(cluster, victim, old_identity, [llm, newcomer])
            for driver in (llm, newcomer):
                back = await asyncio.wait_for(
                    final(driver, "back", greedy(4), data_parallel_rank=victim), 30
                )
                assert back.data_parallel_rank == victim
        finally:
            await newcomer.aclose()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def test_a_driver_paused_past_the_engines_patience_is_told_and_attaches_again(
    cluster: ClusterHandle,
) -> None:
    await asyncio.to_thread(_pause_and_resume_a_driver, cluster)


def _pause_and_resume_a_driver(cluster: ClusterHandle) -> None:
    gcs_address = ray.get_runtime_context().gcs_address
    # Paused longer than the engines wait for a silent client: they drop it. Resumed, it must
    # learn that, fail what it lost, and attach again.
    output = pause_and_resume(
        ["--namespace", cluster.namespace, "--address", gcs_address], ray_env()
    )
    assert ALL_OK in output, output
    assert "no longer counts this client attached" in output, output
