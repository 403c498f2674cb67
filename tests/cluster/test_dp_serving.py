"""Drivers on a real two-rank cluster: routing, aborts, concurrent drivers, engines killed or hung."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import ray

from shoal.actors.membership import RankState
from shoal.client import AsyncLLM, SamplingParams
from shoal.client.cluster_link import ATTACH_TIMEOUT_S, ClusterLink
from shoal.client.dp_client import DPLBAsyncMPClient
from shoal.client.mp_client import ENGINE_RETURN_WAIT_S
from shoal.client.outputs import RequestOutput
from shoal.cluster.launch import ClusterHandle, ClusterNotFoundError, launch
from shoal.cluster.placement import RankResources
from shoal.engine.config import EngineConfig
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import DPStatsSnapshot, EngineCoreRequest
from tests.factories import make_tiny_checkpoint
from tests.pausable_driver import ALL_OK, pause_and_resume
from tests.ray_utils import ray_env, unique_namespace

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

ENGINE_KWARGS: dict[str, Any] = {
    "num_gpu_blocks_override": 128,
    "max_model_len": 512,
    "max_num_batched_tokens": 64,
}


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(ray_local: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
    config = EngineConfig.from_kwargs(checkpoint, data_parallel_size=2, **ENGINE_KWARGS)
    handle = launch(
        config,
        namespace=unique_namespace("dp"),
        resources=RankResources(num_cpus=1),
        host="127.0.0.1",
    )
    yield handle
    handle.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def llm(cluster: ClusterHandle) -> AsyncIterator[AsyncLLM]:
    engine = await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name="test driver")
    yield engine
    await engine.aclose()


def _client(llm: AsyncLLM) -> DPLBAsyncMPClient:
    assert isinstance(llm.engine_core, DPLBAsyncMPClient)
    return llm.engine_core


async def _final(llm: AsyncLLM, prompt: Any, params: SamplingParams, **kw: Any) -> RequestOutput:
    final = None
    async for output in llm.generate(prompt, params, **kw):
        final = output
    assert final is not None
    return final


async def test_new_requests_avoid_the_rank_busy_with_a_long_request(llm: AsyncLLM) -> None:
    long_prompt = {"prompt_token_ids": list(range(1, 401))}
    long_task = asyncio.create_task(_final(llm, long_prompt, _params(200)))
    await asyncio.sleep(0)  # let it be routed first
    busy = _client(llm).rank_of(_client(llm).router.request_ids()[0])
    shorts = await asyncio.gather(*(_final(llm, f"short {i}", _params(4)) for i in range(4)))
    assert {s.data_parallel_rank for s in shorts} == {1 - busy}  # type: ignore[operator]
    long_output = await long_task
    assert long_output.data_parallel_rank == busy
    assert len(_client(llm).router) == 0


async def test_many_short_requests_use_every_rank(llm: AsyncLLM) -> None:
    outputs = await asyncio.gather(*(_final(llm, f"q {i}", _params(6)) for i in range(40)))
    shares = Counter(o.data_parallel_rank for o in outputs)
    assert set(shares) == {0, 1} and min(shares.values()) >= 10, shares
    assert len(_client(llm).router) == 0


async def test_abort_reaches_the_owning_rank(llm: AsyncLLM) -> None:
    stream = llm.generate("abort me", _params(400), request_id="to-abort")
    first = await stream.__anext__()
    owner = first.data_parallel_rank
    await stream.aclose()
    deadline = time.monotonic() + 5
    while True:
        stats = await _client(llm).call_utility_all_async("get_stats")
        if stats[owner].num_running_reqs == 0:
            break
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.02)
    assert stats[owner].num_free_blocks == stats[owner].num_total_blocks
    assert len(_client(llm).router) == 0


async def test_pinned_rank_is_honoured(llm: AsyncLLM) -> None:
    for rank in (0, 1, 1, 0):
        output = await _final(llm, "pinned", _params(3), data_parallel_rank=rank)
        assert output.data_parallel_rank == rank


async def test_a_plain_shutdown_call_detaches_from_the_cluster(cluster: ClusterHandle) -> None:
    """vLLM's `llm.shutdown()`, not awaited, on a client attached by namespace."""
    other = await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name="plain shutdown")

    async def client_names() -> list[str]:
        status = await asyncio.to_thread(cluster.status)
        return [c["name"] for c in status["clients"]]

    assert "plain shutdown" in await client_names()
    assert (await _final(other, "before", _params(3))).outputs[0].token_ids
    assert other.shutdown() is None
    assert "plain shutdown" not in await client_names()
    with pytest.raises(EngineDeadError):
        await _final(other, "after", _params(3))


async def test_conversation_turns_follow_their_cache_and_front_ends_agree(
    llm: AsyncLLM, cluster: ClusterHandle
) -> None:
    """Each turn repeats the last: it goes where that is cached, and the engine finds it
    there; a second front end, which sent nothing, would send the next turn to the same rank."""
    other = await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name="second front end")
    try:
        prompt = [3 + (i * 7) % 90 for i in range(200)]
        ranks, hits = [], []
        for _ in range(3):
            output = await _final(llm, {"prompt_token_ids": prompt}, _params(4))
            ranks.append(output.data_parallel_rank)
            hits.append(output.num_cached_tokens)
            prompt = [*prompt, *output.outputs[0].token_ids, 5, 6, 7]
        assert len(set(ranks)) == 1 and min(hits[1:]) >= 192, (ranks, hits)
        probe = EngineCoreRequest("probe", prompt, _params(4))
        deadline = time.monotonic() + 10
        while True:
            mine, theirs = _client(llm).route(probe), _client(other).route(probe)
            if mine == theirs and mine.rank == ranks[0] and mine.predicted_hit_tokens >= 208:
                break
            assert time.monotonic() < deadline, (mine, theirs)
            await asyncio.sleep(0.1)
    finally:
        await other.aclose()


async def test_two_drivers_only_see_their_own_outputs(
    llm: AsyncLLM, cluster: ClusterHandle
) -> None:
    other = await ClusterLink.attach(cluster.namespace, host="127.0.0.1", name="raw driver")
    client = other.client
    assert client.client_index != _client(llm).client_index
    own_ids = {f"raw-{i}" for i in range(10)}
    for request_id in sorted(own_ids):
        await client.add_request_async(EngineCoreRequest(request_id, [7, 8, 9], _params(5)))
    mine = asyncio.gather(*(_final(llm, f"mine {i}", _params(5)) for i in range(10)))
    seen: Counter[str] = Counter()
    finished: set[str] = set()
    while finished != own_ids:
        outputs = await asyncio.wait_for(client.get_output_async(), timeout=30)
        for output in outputs.outputs:
            assert output.request_id in own_ids, output.request_id
            seen[output.request_id] += len(output.new_token_ids)
            if output.finished:
                finished.add(output.request_id)
    assert all(n == 5 for n in seen.values())
    assert all(len(o.outputs[0].token_ids) == 5 for o in await mine)
    await other.aclose()


async def test_drivers_may_use_the_same_request_ids_on_one_rank(
    llm: AsyncLLM, cluster: ClusterHandle
) -> None:
    other = await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name="same ids")
    try:
        prompts = {llm: [5, 6, 7], other: [8, 9, 10, 11]}

        async def run(driver: AsyncLLM, i: int) -> RequestOutput:
            prompt = {"prompt_token_ids": prompts[driver]}
            return await _final(
                driver, prompt, _params(6 + i), request_id=f"job-{i}", data_parallel_rank=0
            )

        mine, theirs = await asyncio.gather(
            asyncio.gather(*(run(llm, i) for i in range(4))),
            asyncio.gather(*(run(other, i) for i in range(4))),
        )
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert a.request_id == b.request_id == f"job-{i}"
            assert a.error is None and b.error is None
            assert len(a.outputs[0].token_ids) == len(b.outputs[0].token_ids) == 6 + i
            assert a.prompt_token_ids == prompts[llm] and b.prompt_token_ids == prompts[other]
        with pytest.raises(ValueError, match="'job-0' is already in use"):  # within one driver
            await asyncio.gather(run(other, 0), run(other, 0))
    finally:
        await other.aclose()


async def test_a_driver_that_shut_down_leaves_no_task_on_its_loop(cluster: ClusterHandle) -> None:
    """On a loop of its own, in a thread, so only this driver's tasks are looked at."""

    async def drive() -> set[asyncio.Task[Any]]:
        other = await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name="brief driver")
        await _final(other, "brief", _params(3))
        await asyncio.sleep(0.2)  # the membership watch is waiting by now
        await other.aclose()
        for _ in range(3):  # cancelled tasks finish on the loop's next turns
            await asyncio.sleep(0)
        return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}

    left = await asyncio.wait_for(asyncio.to_thread(lambda: asyncio.run(drive())), 60)
    assert not left, left


async def test_a_cluster_seen_by_its_drivers_from_launch_to_stop(
    ray_local: str, tmp_path: Path
) -> None:
    """The driver connects before `launch` has made the registry; a second one connects where
    the checkpoint is not (it takes the rank's tokenizer); after the stop, requests fail without
    waiting `ENGINE_RETURN_WAIT_S` for a rank, as none will come back."""
    namespace = unique_namespace("lifecycle")
    with pytest.raises(ClusterNotFoundError):  # no wait asked for: none
        await AsyncLLM.connect(namespace, host="127.0.0.1")
    checkpoint = make_tiny_checkpoint(tmp_path / "here", "llama")
    config = EngineConfig.from_kwargs(checkpoint, data_parallel_size=1, **ENGINE_KWARGS)
    launched = asyncio.create_task(
        asyncio.to_thread(
            launch,
            config,
            namespace=namespace,
            resources=RankResources(num_cpus=1),
            host="127.0.0.1",
        )
    )
    driver = await AsyncLLM.connect(
        namespace, host="127.0.0.1", name="early driver", ready_timeout_s=60
    )
    try:
        # Without the wait it would have found no cluster, or a rank not yet serving.
        assert _client(driver).lb_engines == [0]
        before = await _final(driver, "before", _params(3))
        assert len(before.outputs[0].token_ids) == 3
        handle = await launched
        (tmp_path / "here").rename(tmp_path / "gone")  # as on a node without the model files
        away = await AsyncLLM.connect(namespace, host="127.0.0.1", name="driver away")
        try:
            text = before.outputs[0].text
            assert (await _final(away, "before", _params(3))).outputs[0].text == text
        finally:
            await away.aclose()
        await asyncio.to_thread(handle.shutdown)
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            await _final(driver, "after the stop", _params(3))
        assert time.monotonic() - started < ENGINE_RETURN_WAIT_S / 2
    finally:
        await driver.aclose()
        (await launched).shutdown()


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
    client = _client(llm)
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
            output = await _final(late, "after the restart", _params(3))
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
    own_index = _client(llm).client_index
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
        assert _client(late).client_index > max(c.client_index for c in clients)
        outputs = await asyncio.gather(
            _final(late, "new driver", _params(3)), _final(llm, "old driver", _params(3))
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
        asyncio.create_task(_final(llm, f"long {i}", _params(400), data_parallel_rank=rank))
        for i in range(count)
    ]
    while len(_client(llm).router) < count:
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
            and all(rank in _client(d).lb_engines for d in drivers)
        ):
            return
        assert time.monotonic() < deadline, (info, [_client(d).lb_engines for d in drivers])
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
    alive = await asyncio.wait_for(_final(llm, "still here", _params(4)), 30)
    assert alive.data_parallel_rank == survivor

    # Ray restarts the victim; it re-registers and this driver attaches it again.
    await _new_incarnation_attached(cluster, victim, old_identity, [llm])
    back = await asyncio.wait_for(
        _final(llm, "welcome back", _params(4), data_parallel_rank=victim), 30
    )
    assert back.data_parallel_rank == victim
    assert len(back.outputs[0].token_ids) == 4

    # Routing sees the new incarnation's load, not the last report of the old one (whose step
    # counter is far ahead of the new engine's and would outrank every fresh report).
    deadline = time.monotonic() + 5
    while True:
        steps = (await _client(llm).call_utility_all_async("get_stats"))[victim].step_counter
        load = _client(llm).router.loads.get(victim)
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
            served = await asyncio.wait_for(_final(newcomer, "meanwhile", _params(4)), 30)
            assert served.data_parallel_rank == survivor

            # The registry probes the rank, finds it hung and has Ray start it again; both
            # drivers attach the new incarnation.
            await _new_incarnation_attached(cluster, victim, old_identity, [llm, newcomer])
            for driver in (llm, newcomer):
                back = await asyncio.wait_for(
                    _final(driver, "back", _params(4), data_parallel_rank=victim), 30
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
