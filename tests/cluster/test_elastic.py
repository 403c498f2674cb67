"""Elastic resizes of real clusters on a local Ray while two drivers stream greedy requests:
expert-parallel (tiny Mixtral over gloo) and dense (tiny Llama), up and down and to uneven
splits (the drivers' prefix-cache indexes following), a new rank killed while it joins, a
rollback that undoes only what was created, two resizes at once, ten cycles in a row, and a
handle that follows a rank another driver replaced."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psutil
import pytest
import pytest_asyncio
import ray

from shoal.actors.membership import RankState
from shoal.client import AsyncLLM, SamplingParams
from shoal.cluster.elastic import ScaleError, ScaleInProgressError, ScaleReport, _Resize, scale
from shoal.cluster.launch import ClusterHandle, LaunchOptions, attach, launch
from shoal.cluster.placement import (
    RankResources,
    create_rank_placement_group,
    placement_group_name,
)
from shoal.engine.config import EngineConfig
from shoal.engine.parallel.elastic import RECONFIGURED
from tests.cluster.elastic_load import Load, Served, hold_on_ranks
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import unique_namespace
from tests.reference import GreedyTrace, assert_greedy_matches, hf_greedy

pytestmark = pytest.mark.slow
in_module_loop = pytest.mark.asyncio(loop_scope="module")

ENGINE_KWARGS: dict[str, Any] = {
    "num_gpu_blocks_override": 128,
    "max_model_len": 256,
    "max_num_batched_tokens": 64,
    "collective_timeout_s": 20.0,
}
PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 17], [42] * 9, [7, 300, 11, 12], [9, 8, 7, 6, 5, 4]]
MAX_TOKENS = 24
# A request held on a leaving rank across a scale-down: long enough to outlast the resize.
HELD_MAX_TOKENS = 160


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-moe"), "mixtral", num_experts=8, top_k=2, seed=5
    )


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=3)


def _references(
    checkpoint: str, max_tokens: int = MAX_TOKENS
) -> dict[tuple[int, ...], GreedyTrace]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    return {tuple(p): hf_greedy(model, p, max_tokens) for p in PROMPTS}


def _launch(checkpoint: str, *, expert_parallel: bool) -> ClusterHandle:
    config = EngineConfig.from_kwargs(
        checkpoint,
        data_parallel_size=2,
        enable_expert_parallel=expert_parallel,
        **ENGINE_KWARGS,
    )
    options = LaunchOptions(RankResources(num_cpus=1), host="127.0.0.1")
    return launch(config, options, namespace=unique_namespace("elastic"))


@pytest.fixture
def moe_cluster(ray_local: str, moe_checkpoint: str) -> Iterator[ClusterHandle]:
    handle = _launch(moe_checkpoint, expert_parallel=True)
    yield handle
    handle.shutdown()


@pytest.fixture
def dense_cluster(ray_local: str, dense_checkpoint: str) -> Iterator[ClusterHandle]:
    handle = _launch(dense_checkpoint, expert_parallel=False)
    yield handle
    handle.shutdown()


@pytest_asyncio.fixture(loop_scope="module")
async def drivers(request: pytest.FixtureRequest) -> AsyncIterator[list[AsyncLLM]]:
    cluster: ClusterHandle = request.getfixturevalue(request.param)
    llms = [
        await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name=f"driver {i}")
        for i in range(2)
    ]
    yield llms
    for llm in llms:
        await llm.aclose()


def _ranks_in_registry(cluster: ClusterHandle) -> list[int]:
    membership = cluster.membership()
    return sorted(r for r, info in membership.ranks.items() if info.is_routable)


def _named_engines(cluster: ClusterHandle) -> set[str]:
    return {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a.get("namespace") == cluster.namespace and a["name"].startswith("shoal-engine-")
    }


def _live_placement_groups(cluster: ClusterHandle) -> set[str]:
    table = ray.util.placement_group_table()
    return {
        pg["name"]
        for pg in table.values()
        if pg["name"].startswith(f"shoal-{cluster.namespace}-") and pg["state"] != "REMOVED"
    }


def _check_served(
    served: list[Served],
    references: dict[tuple[int, ...], GreedyTrace],
    max_tokens: int = MAX_TOKENS,
) -> None:
    assert served, "the drivers finished no request"
    for s in served:
        assert s.error is None, s
        assert s.finish_reason == "length", s
        assert len(s.token_ids) == max_tokens, s
        assert_greedy_matches(s.token_ids, references[tuple(s.prompt)], label=str(s.ranks))


async def _resize_under_load(
    cluster: ClusterHandle,
    drivers: list[AsyncLLM],
    checkpoint: str,
    sizes: list[int],
) -> list[Served]:
    """Resizes through `sizes` while both drivers stream; checks every guarantee. Before each
    scale-down a long request is held on a leaving rank, so each one hands a request over.
    Returns the drivers' requests, then the held ones."""
    references = _references(checkpoint)
    loads = [Load(llm, PROMPTS, MAX_TOKENS) for llm in drivers]
    tasks = [asyncio.create_task(load.run()) for load in loads]
    held: list[asyncio.Task[Served]] = []
    on_leaving: list[asyncio.Task[Served]] = []  # the held request of each scale-down
    await asyncio.sleep(1.0)
    epochs = []
    current = len(drivers[0].serving_ranks())
    for size in sizes:
        if size < current:
            leaving = set(range(size, current))
            held += await hold_on_ranks(drivers[1], PROMPTS, HELD_MAX_TOKENS, leaving)
            on_leaving.append(held[-1])
        current = size
        started = time.monotonic()
        report = await drivers[0].scale_elastic_ep(size)
        assert report["outcome"] == "committed" and report["to_size"] == size
        epochs.append(report["epoch"])
        # Both drivers route over exactly the registry's ranks, and their prefix-cache
        # indexes hold exactly those ranks: a new rank has its entry, a removed one none.
        for llm in drivers:
            index = llm.engine_core.kv_index  # type: ignore[attr-defined]
            deadline = time.monotonic() + 20
            while sorted(llm.serving_ranks()) != list(range(size)) or sorted(index.views) != list(
                range(size)
            ):
                assert time.monotonic() < deadline, (llm.serving_ranks(), sorted(index.views))
                await asyncio.sleep(0.05)
        assert _ranks_in_registry(cluster) == list(range(size))
        # Serve a while at this size: new ranks take requests.
        while time.monotonic() < started + report["total_s"] + 2.5:
            await asyncio.sleep(0.1)
        assert cluster.status()["scaling"] is None
    for load in loads:
        load.stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    served = [s for load in loads for s in load.served]
    _check_served(served, references)
    held_served = list(await asyncio.wait_for(asyncio.gather(*held), 120))
    _check_served(held_served, _references(checkpoint, HELD_MAX_TOKENS), HELD_MAX_TOKENS)
    for task in on_leaving:  # each moved off its leaving rank, finishing with HF's tokens
        assert len(task.result().ranks) > 1, task.result()
    # Both drivers heard every resize from every rank of its new set.
    for llm in drivers:
        notices = list(llm.engine_core.scale_notices)  # type: ignore[attr-defined]
        for epoch, size in zip(epochs, sizes, strict=True):
            heard = {rank for kind, e, rank in notices if kind == RECONFIGURED and e == epoch}
            assert heard == set(range(size)), (epoch, heard, notices)
    final = sizes[-1]
    assert _named_engines(cluster) == {f"shoal-engine-{r}" for r in range(final)}
    assert len(_live_placement_groups(cluster)) == final
    return served + held_served


@in_module_loop
@pytest.mark.parametrize("drivers", ["moe_cluster"], indirect=True)
async def test_expert_parallel_resizes_under_load_lose_nothing(
    moe_cluster: ClusterHandle, drivers: list[AsyncLLM], moe_checkpoint: str
) -> None:
    served = await _resize_under_load(moe_cluster, drivers, moe_checkpoint, [4, 2, 3, 2])
    assert any(3 in s.ranks for s in served), "no request was served by a new rank"
    # A request that was on a leaving rank moved: it was served by two ranks.
    assert any(len(s.ranks) > 1 for s in served), "no request was handed over"
    status = moe_cluster.status()
    assert status["data_parallel_size"] == 2
    assert status["expert_parallel"]["experts_per_rank"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@in_module_loop
@pytest.mark.parametrize("drivers", ["dense_cluster"], indirect=True)
async def test_dense_resizes_under_load_lose_nothing(
    dense_cluster: ClusterHandle, drivers: list[AsyncLLM], dense_checkpoint: str
) -> None:
    served = await _resize_under_load(dense_cluster, drivers, dense_checkpoint, [4, 2])
    assert any({2, 3} & set(s.ranks) for s in served), "no request was served by a new rank"
    assert any(len(s.ranks) > 1 for s in served), "no request was handed over"


@in_module_loop
@pytest.mark.parametrize("drivers", ["moe_cluster"], indirect=True)
async def test_a_new_rank_killed_while_joining_rolls_the_resize_back(
    moe_cluster: ClusterHandle, drivers: list[AsyncLLM]
) -> None:
    llm = drivers[0]
    done: dict[str, Any] = {}

    def kill_rank_2_when_it_appears() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ranks = moe_cluster.membership().ranks
            if 2 in ranks and ranks[2].state in (RankState.STARTING, RankState.JOINING):
                try:
                    ray.kill(ray.get_actor("shoal-engine-2", namespace=moe_cluster.namespace))
                    done["killed_in"] = ranks[2].state
                    return
                except ValueError:
                    pass  # the actor is not named yet
            time.sleep(0.02)

    killer = threading.Thread(target=kill_rank_2_when_it_appears)
    killer.start()
    with pytest.raises(ScaleError, match="rolled back"):
        await llm.scale_elastic_ep(3)
    killer.join()
    assert "killed_in" in done
    status = moe_cluster.status()
    assert status["scaling"] is None and status["data_parallel_size"] == 2
    assert [r["rank"] for r in status["ranks"]] == [0, 1]
    assert status["scale_history"][-1]["outcome"] == "rolled_back"
    assert _named_engines(moe_cluster) == {"shoal-engine-0", "shoal-engine-1"}
    assert len(_live_placement_groups(moe_cluster)) == 2
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for rank in (0, 1):  # the old set serves, and its groups work
        final = None
        async for out in llm.generate("after rollback", params, data_parallel_rank=rank):
            final = out
        assert final is not None and final.finished and final.error is None
    report = await llm.scale_elastic_ep(3)  # the next resize works
    assert report["outcome"] == "committed"
    assert sorted(llm.serving_ranks()) == [0, 1, 2]


def test_two_resizes_at_once_one_proceeds_and_the_other_is_refused(
    dense_cluster: ClusterHandle,
) -> None:
    results: list[Any] = []

    def resize() -> None:
        try:
            results.append(scale(dense_cluster, 3, owner=threading.current_thread().name))
        except ScaleInProgressError as e:
            results.append(e)

    threads = [threading.Thread(target=resize, name=f"caller {i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    refused = [r for r in results if isinstance(r, ScaleInProgressError)]
    done = [r for r in results if not isinstance(r, ScaleInProgressError)]
    assert len(refused) == 1 and len(done) == 1, results
    assert "in progress" in str(refused[0])
    assert done[0].outcome == "committed"
    assert dense_cluster.status()["data_parallel_size"] == 3
    assert scale(dense_cluster, 2).outcome == "committed"


def test_a_handle_follows_a_rank_another_driver_replaced(dense_cluster: ClusterHandle) -> None:
    """Another driver's resize down and up again replaces rank 2's actor; this handle, which
    saw the old one, reaches the new one and stops it at shutdown."""
    assert scale(dense_cluster, 3).outcome == "committed"
    old_pid = ray.get(dense_cluster.engine(2).health.remote())["pid"]
    other = attach(dense_cluster.namespace)
    assert scale(other, 2).outcome == "committed"
    assert scale(other, 3).outcome == "committed"
    new_pid = ray.get(other.engine(2).health.remote())["pid"]
    assert new_pid != old_pid

    assert ray.get(dense_cluster.engine(2).health.remote(), timeout=30)["pid"] == new_pid
    dense_cluster.shutdown()
    assert _named_engines(dense_cluster) == set()


def _engine_process_usage(cluster: ClusterHandle, ranks: list[int]) -> dict[int, tuple[int, int]]:
    """(resident bytes, open descriptors) of each rank's engine process."""
    usage = {}
    for rank in ranks:
        pid = ray.get(cluster.engine(rank).health.remote())["pid"]
        process = psutil.Process(pid)
        usage[rank] = (process.memory_info().rss, process.num_fds())
    return usage


def test_ten_resize_cycles_grow_neither_memory_nor_descriptors(
    moe_cluster: ClusterHandle,
) -> None:
    samples = []
    for _ in range(10):
        assert scale(moe_cluster, 3).outcome == "committed"
        assert scale(moe_cluster, 2).outcome == "committed"
        samples.append(_engine_process_usage(moe_cluster, [0, 1]))
    for rank in (0, 1):
        rss = [s[rank][0] for s in samples]
        fds = [s[rank][1] for s in samples]
        # After two warm-up cycles (allocator pools, lazily imported code), flat.
        assert max(fds[2:]) - fds[2] <= 4, fds
        assert max(rss[2:]) - rss[2] < 48 * 2**20, rss


def test_a_rollback_undoes_what_was_created_not_what_was_asked_for(
    dense_cluster: ClusterHandle, dense_checkpoint: str
) -> None:
    """A resize to 10,000 ranks that got as far as one new placement group rolls back that
    group alone: the undo follows what exists, not the size asked for."""
    config = EngineConfig.from_kwargs(dense_checkpoint, data_parallel_size=2, **ENGINE_KWARGS)
    report = ScaleReport(epoch=99, from_size=2, to_size=10_002, outcome="")
    resize = _Resize(dense_cluster, config, 99, 2, 10_002, 5.0, report)
    resize.new_ranks = list(range(2, 10_002))
    assert resize._created_ranks() == []
    group = create_rank_placement_group(dense_cluster.namespace, 2, RankResources(num_cpus=1))
    ray.get(group.ready(), timeout=30)
    assert resize._created_ranks() == [2]

    resize.roll_back(RuntimeError("a step failed"))

    assert _live_placement_groups(dense_cluster) == {
        placement_group_name(dense_cluster.namespace, rank) for rank in (0, 1)
    }
    assert _ranks_in_registry(dense_cluster) == [0, 1]
    assert _named_engines(dense_cluster) == {"shoal-engine-0", "shoal-engine-1"}
