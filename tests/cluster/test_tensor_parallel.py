"""Tensor parallelism with data parallelism on a real local Ray cluster: two ranks of two workers,
each rank in a placement group that reserves a CPU per worker. Both ranks serve the same greedy
tokens and `shoal status` shows every worker's device and node; a TP worker killed mid-stream
takes its rank down as one unit (its requests move or fail within 2 s, the other rank serves on,
Ray restarts the rank with both workers); resizes remove and add whole TP ranks under load."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import pytest
import pytest_asyncio
import ray
from ray.util.placement_group import placement_group_table

from shoal.actors.engine_actor import EngineActorHandle, engine_actor_name
from shoal.client import AsyncLLM, SamplingParams, SyncMPClient
from shoal.client.routing.migration import DEFAULT_MIGRATION_LIMIT, REASON_RANK_FAILED
from shoal.cluster.launch import ClusterHandle, LaunchOptions, launch
from shoal.cluster.placement import RankResources
from shoal.cluster.ranks import default_resources
from shoal.deploy.status import format_status
from shoal.engine.config import EngineConfig
from shoal.engine.core.curve import CurveKeyPair
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import EngineCoreRequest, EngineEndpoint, RequestOutputKind
from tests.cluster.elastic_load import Load
from tests.cluster.in_flight import decoding_on, dplb_client
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import unique_namespace
from tests.reference import GreedyTrace, assert_greedy_matches, hf_greedy

pytestmark = pytest.mark.slow
in_module_loop = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [[5, 6, 7, 8], [100, 200, 300, 400, 17], [42] * 9, [7, 300, 11, 12]]
MAX_TOKENS = 160
PARAMS = SamplingParams(
    temperature=0.0,
    max_tokens=MAX_TOKENS,
    ignore_eos=True,
    output_kind=RequestOutputKind.DELTA,
)
# The resize test's requests: shorter, so many finish on each side of a resize.
RESIZE_MAX_TOKENS = 24
# How long a rank's workers wait for each other in a collective before the rank ends.
COLLECTIVE_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="module")
def references(checkpoint: str) -> dict[tuple[int, ...], GreedyTrace]:
    """HF's greedy tokens of every prompt (the longest length asked for)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    return {tuple(p): hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS}


@pytest.fixture(scope="module")
def cluster(ray_local: str, checkpoint: str) -> Iterator[ClusterHandle]:
    config = EngineConfig.from_kwargs(
        checkpoint,
        data_parallel_size=2,
        tensor_parallel_size=2,
        num_gpu_blocks_override=64,
        max_model_len=256,
        max_num_batched_tokens=64,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    )
    assert default_resources(2) == RankResources(num_cpus=2)  # the local cluster has no GPU
    options = LaunchOptions(default_resources(2), host="127.0.0.1", ready_timeout_s=180)
    handle = launch(config, options, namespace=unique_namespace("tp"))
    yield handle
    handle.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def drivers(cluster: ClusterHandle) -> AsyncIterator[list[AsyncLLM]]:
    """A driver that migrates (the default limit) and one with the limit at 0, both
    round-robin so that their requests alternate between the ranks."""
    made = [
        await AsyncLLM.connect(
            cluster.namespace,
            host="127.0.0.1",
            name=f"tp driver {i}",
            policy="round-robin",
            migration_limit=limit,
        )
        for i, limit in enumerate([DEFAULT_MIGRATION_LIMIT, 0])
    ]
    yield made
    for driver in made:
        await driver.aclose()


def _serve(cluster: ClusterHandle, endpoint: EngineEndpoint) -> tuple[list[int], list[int]]:
    """(greedy tokens of one request, KV bytes per block of each of the rank's workers)."""
    keys = CurveKeyPair.generate()
    client_index = ray.get(cluster.registry.attach_client.remote("tp-test", keys.public))
    client = SyncMPClient([endpoint], client_index=client_index, curve_keys=keys)
    try:
        per_worker = client.call_utility("collective_rpc", "bytes_per_block", [])
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        client.add_request(EngineCoreRequest("r0", [5, 6, 7, 8], params))
        tokens: list[int] = []
        while True:
            for output in client.get_output(timeout=60).outputs:
                tokens += output.new_token_ids
                if output.finished:
                    return tokens, per_worker
    finally:
        client.shutdown()
        ray.get(cluster.registry.detach_client.remote(client_index))


def _check_workers(cluster: ClusterHandle, status: dict[str, Any], rank: int) -> list[int]:
    """Checks that `rank` serves with its two workers (the driver in the engine actor's process,
    TP rank 1 in a process of its own) on this node, as the status shows them. Returns their
    pids."""
    entry = status["ranks"][rank]
    workers = entry["workers"]
    assert [w["tp_rank"] for w in workers] == [0, 1], workers
    assert all(w["device"] == "cpu" and w["node_ip"] == "127.0.0.1" for w in workers), workers
    assert {w["node_id"] for w in workers} == {ray.get_runtime_context().get_node_id()}
    assert entry["placement_group"] == f"shoal-{cluster.namespace}-rank-{rank}"
    # Looked up by name: a resize made by another client replaces the actor of a rank.
    engine: EngineActorHandle = ray.get_actor(engine_actor_name(rank), namespace=cluster.namespace)
    # The registry may list a restarted rank a moment before Ray's handles see its actor
    # alive again ("the actor is restarting"): ask again until then.
    deadline = time.monotonic() + 30
    while True:
        try:
            engine_pid = ray.get(engine.health.remote(), timeout=30)["pid"]
            break
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < deadline, f"rank {rank}'s engine actor stayed unavailable"
            time.sleep(0.2)
    assert workers[0]["pid"] == engine_pid
    assert workers[1]["pid"] != engine_pid and psutil.pid_exists(workers[1]["pid"])
    return [w["pid"] for w in workers]


def test_two_ranks_of_two_workers_serve_in_two_placement_groups(cluster: ClusterHandle) -> None:
    served = [_serve(cluster, e) for e in cluster.membership().routable_endpoints()]
    assert len(served) == 2
    assert served[0][0] == served[1][0] and len(served[0][0]) == 6
    assert [len(per_worker) for _, per_worker in served] == [2, 2]  # four workers in all
    table = {e["name"]: e for e in placement_group_table().values() if e["state"] == "CREATED"}
    for rank in (0, 1):
        entry = table[f"shoal-{cluster.namespace}-rank-{rank}"]
        # One bundle per worker, packed on one node: the engine's actor holds bundle 0,
        # its other worker (a `TPWorkerActor`) bundle 1.
        assert entry["bundles"] == {0: {"CPU": 1.0}, 1: {"CPU": 1.0}}
        assert entry["strategy"] == "STRICT_PACK"
    status = cluster.status()
    assert status["tensor_parallel_size"] == 2
    pids = [_check_workers(cluster, status, rank) for rank in (0, 1)]
    assert len({pid for pair in pids for pid in pair}) == 4
    text = format_status(status)
    assert "TP 2 (4 workers)" in text
    for rank, pair in enumerate(pids):
        assert f"placement group shoal-{cluster.namespace}-rank-{rank}" in text
        for tp_rank, pid in enumerate(pair):
            assert f"TP {tp_rank}  pid {pid}" in text and "node 127.0.0.1" in text


@dataclass
class Stream:
    """What one caller saw of one streamed request."""

    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)  # every rank it streamed from
    output_times: list[float] = field(default_factory=list)
    num_finished: int = 0
    error: BaseException | None = None


async def _stream(driver: AsyncLLM, prompt: list[int], rank: int | None = None) -> Stream:
    seen = Stream(prompt)
    try:
        async for output in driver.generate(
            {"prompt_token_ids": prompt}, PARAMS, data_parallel_rank=rank
        ):
            if output.data_parallel_rank not in seen.ranks:
                seen.ranks.append(output.data_parallel_rank)
            seen.token_ids.extend(output.outputs[0].token_ids)
            seen.output_times.append(time.monotonic())
            seen.num_finished += output.finished
    except EngineDeadError as e:
        seen.error = e
    return seen


def _assert_served(run: Stream, references: dict[tuple[int, ...], GreedyTrace]) -> None:
    assert run.error is None and run.num_finished == 1, run
    assert len(run.token_ids) == MAX_TOKENS, run
    assert_greedy_matches(run.token_ids, references[tuple(run.prompt)], label=str(run.ranks))


@dataclass
class Moved:
    at: float  # time.monotonic() when the driver had moved them
    victim_routable: bool  # whether the failed rank served this driver again by then


async def _when_moved(driver: AsyncLLM, count: int, victim: int) -> Moved:
    """When `driver` has moved `count` requests off a failed rank `victim`."""
    client = dplb_client(driver)
    while client.router.stats.migrated.get(REASON_RANK_FAILED, 0) < count:
        await asyncio.sleep(0.005)
    return Moved(time.monotonic(), victim in client.lb_engines)


async def _routable(driver: AsyncLLM, rank: int, timeout_s: float = 60) -> None:
    """Once the registry shows `rank` ready again, each client attaches the new incarnation on
    its own: wait for `driver`'s before pinning a request to it."""
    client = dplb_client(driver)
    deadline = time.monotonic() + timeout_s
    while rank not in client.lb_engines:
        assert time.monotonic() < deadline, (rank, client.lb_engines)
        await asyncio.sleep(0.05)


def _is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def _rank_back(
    cluster: ClusterHandle, rank: int, incarnation: int, timeout_s: float = 120
) -> dict[str, Any]:
    """The status once `rank` serves again as a later incarnation than `incarnation`."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = await asyncio.to_thread(cluster.status)
        entry = status["ranks"][rank]
        if entry["state"] == "ready" and entry["incarnation"] > incarnation:
            return status
        if entry["state"] == "dead":  # no stale pids: the dead incarnation's workers are gone
            assert entry["workers"] == [], entry
        assert time.monotonic() < deadline, entry
        await asyncio.sleep(0.2)


@in_module_loop
async def test_a_killed_tp_worker_takes_its_rank_down_and_the_rank_comes_back_whole(
    cluster: ClusterHandle,
    drivers: list[AsyncLLM],
    references: dict[tuple[int, ...], GreedyTrace],
) -> None:
    victim, survivor = 0, 1
    before = await asyncio.to_thread(cluster.status)
    old_pids = _check_workers(cluster, before, victim)
    tasks = [asyncio.create_task(_stream(d, p)) for d in drivers for p in PROMPTS]
    deadline = time.monotonic() + 30
    while sum(len(dplb_client(d).router) for d in drivers) < len(tasks):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    # Round-robin: each driver has two requests on each rank.
    for driver in drivers:
        assert [len(dplb_client(driver).router.loads[r].in_flight) for r in (0, 1)] == [2, 2]
    await decoding_on(drivers, victim, 8)
    moved = asyncio.create_task(_when_moved(drivers[0], 2, victim))

    os.kill(old_pids[1], signal.SIGKILL)  # TP rank 1 of rank 0: a child of its engine
    killed_at = time.monotonic()
    # A request sent to the surviving rank while the victim is down.
    during = await _stream(drivers[1], PROMPTS[0], rank=survivor)
    runs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    move = await asyncio.wait_for(moved, 10)

    # The migrating driver moved both its requests off the failed rank while it was down
    # (not waiting for its restart), and they went on to their reference tokens on the
    # survivor.
    assert not move.victim_routable, move.at - killed_at
    migrating, failing = runs[: len(PROMPTS)], runs[len(PROMPTS) :]
    for run in migrating:
        _assert_served(run, references)
    assert sorted(run.ranks for run in migrating) == [[0, 1], [0, 1], [1], [1]]
    # The driver with the limit at 0 lost its two requests there, and no other.
    failed = [run for run in failing if run.error is not None]
    assert len(failed) == 2 and all(run.ranks == [victim] for run in failed), failing
    assert all(isinstance(run.error, EngineDeadError) for run in failed)
    # The surviving rank served throughout: its requests went on, one was sent while the
    # victim was down, and none of them moved.
    for run in [during] + [run for run in failing if run.error is None]:
        _assert_served(run, references)
        assert run.ranks == [survivor], run.ranks

    # Ray restarted the rank with both workers, as new processes; the old ones are gone.
    status = await _rank_back(cluster, victim, before["ranks"][victim]["incarnation"])
    new_pids = _check_workers(cluster, status, victim)
    assert not set(new_pids) & set(old_pids)
    assert not any(_is_running(pid) for pid in old_pids)
    assert status["ranks"][survivor]["incarnation"] == before["ranks"][survivor]["incarnation"]
    assert [f["rank"] for f in status["rank_failures"]] == [victim]
    await _routable(drivers[0], victim)
    _assert_served(await _stream(drivers[0], PROMPTS[1], rank=victim), references)


@in_module_loop
async def test_a_hung_tp_worker_ends_its_rank_at_the_collective_timeout(
    cluster: ClusterHandle,
    drivers: list[AsyncLLM],
    references: dict[tuple[int, ...], GreedyTrace],
) -> None:
    """A stopped worker (alive to the OS, deaf to its group): the rank's next collective waits
    `--collective-timeout-s`, then the rank ends as one unit and comes back whole; its requests
    move to the other rank."""
    victim = 1
    driver = drivers[0]
    before = await asyncio.to_thread(cluster.status)
    old_pids = _check_workers(cluster, before, victim)
    already = dplb_client(driver).router.stats.migrated.get(REASON_RANK_FAILED, 0)
    tasks = [asyncio.create_task(_stream(driver, p)) for p in PROMPTS]
    await decoding_on([driver], victim, 8)
    moved = asyncio.create_task(_when_moved(driver, already + 2, victim))
    os.kill(old_pids[1], signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        runs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        move = await asyncio.wait_for(moved, 10)
        # Not before the collective timeout (nothing else ends a hung rank), and before the
        # rank came back.
        assert move.at - stopped_at > COLLECTIVE_TIMEOUT_S - 1, move.at - stopped_at
        assert not move.victim_routable
        for run in runs:
            _assert_served(run, references)
        assert sorted(run.ranks for run in runs) == [[0], [0], [1, 0], [1, 0]]
        status = await _rank_back(cluster, victim, before["ranks"][victim]["incarnation"])
        assert not set(_check_workers(cluster, status, victim)) & set(old_pids)
        # The stopped worker was ended with its rank, not left behind.
        deadline = time.monotonic() + 10
        while any(_is_running(pid) for pid in old_pids):
            assert time.monotonic() < deadline, "the hung worker outlived its rank"
            await asyncio.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(old_pids[1], signal.SIGKILL)
    await _routable(driver, victim)
    _assert_served(await _stream(driver, PROMPTS[2], rank=victim), references)


@in_module_loop
async def test_resizes_remove_and_add_whole_tp_ranks_under_load(
    cluster: ClusterHandle,
    drivers: list[AsyncLLM],
    references: dict[tuple[int, ...], GreedyTrace],
) -> None:
    """2 -> 1 -> 2 ranks while the migrating driver streams: the 1 -> 2 resize is a TP=2
    cluster of one rank growing by a whole rank of two workers."""
    driver = drivers[0]
    load = Load(driver, PROMPTS, RESIZE_MAX_TOKENS, concurrency=4)
    running = asyncio.create_task(load.run())
    await asyncio.sleep(1.0)
    for size in (1, 2):
        started = time.monotonic()
        report = await driver.scale_elastic_ep(size)
        assert report["outcome"] == "committed" and report["to_size"] == size, report
        deadline = time.monotonic() + 20
        while sorted(driver.serving_ranks()) != list(range(size)):
            assert time.monotonic() < deadline, driver.serving_ranks()
            await asyncio.sleep(0.05)
        while time.monotonic() < started + report["total_s"] + 2.5:  # serve at this size
            await asyncio.sleep(0.1)
    load.stop.set()
    await asyncio.wait_for(running, 60)

    assert load.served, "the driver finished no request"
    for s in load.served:
        assert s.error is None and s.finish_reason == "length", s
        assert len(s.token_ids) == RESIZE_MAX_TOKENS, s
        reference = references[tuple(s.prompt)]
        prefix = GreedyTrace(
            reference.token_ids[:RESIZE_MAX_TOKENS], reference.margins[:RESIZE_MAX_TOKENS]
        )
        assert_greedy_matches(s.token_ids, prefix, label=str(s.ranks))
    assert any(len(s.ranks) > 1 for s in load.served), "no request was handed over"
    assert any(s.ranks == [1] and s.started_at > started for s in load.served), (
        "the new rank served no request"
    )
    status = await asyncio.to_thread(cluster.status)
    assert status["data_parallel_size"] == 2 and status["scaling"] is None
    assert [r["state"] for r in status["ranks"]] == ["ready", "ready"]
    pids = [_check_workers(cluster, status, rank) for rank in (0, 1)]
    assert len({pid for pair in pids for pid in pair}) == 4


def test_a_tp_size_the_model_cannot_split_is_refused_before_anything_starts(
    ray_local: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("three"), "llama")
    config = EngineConfig.from_kwargs(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        launch(config, LaunchOptions(RankResources(num_cpus=1)), namespace=unique_namespace("x"))
    with pytest.raises(ValueError, match="--num-gpus-per-rank 1 conflicts with"):
        two = EngineConfig.from_kwargs(path, tensor_parallel_size=2)
        launch(two, LaunchOptions(RankResources(num_cpus=1, num_gpus=1)), namespace="y")
