"""Graceful drains of a real two-rank dense cluster on a local Ray while two drivers stream
greedy requests: a rolling restart of every rank (each holding a long request that is
handed over), and a pod's `preStop` drain (`shoal drain --no-restart`) followed by the end of
the rank's process. Nothing is lost: every stream completes, greedy-equal to HF."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
import ray

from shoal.actors.engine_actor import engine_actor_name
from shoal.client import AsyncLLM
from shoal.cluster.drain import DrainReport, drain, ranks_on_node
from shoal.cluster.launch import ClusterHandle, LaunchOptions, launch
from shoal.cluster.placement import RankResources
from shoal.deploy import drain as drain_command
from shoal.deploy.cli import build_parser
from shoal.engine.config import EngineConfig
from tests.cluster.elastic_load import Load, Served, hold_on_ranks
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import unique_namespace
from tests.reference import GreedyTrace, assert_greedy_matches, hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
in_module_loop = pytest.mark.asyncio(loop_scope="module")

ENGINE_KWARGS: dict[str, Any] = {
    "num_gpu_blocks_override": 512,
    "max_model_len": 2048,
    "max_num_batched_tokens": 64,
}
PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 17], [42] * 9, [7, 300, 11, 12], [9, 8, 7, 6, 5, 4]]
MAX_TOKENS = 24
# A request held on the draining rank, which drains with no deadline: it is handed over
# after its first tokens, with most of its tokens still to come.
HELD_MAX_TOKENS = 300
WAIT_S = 120.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-llama"), "llama", seed=3, max_position_embeddings=2048
    )


@pytest.fixture(scope="module")
def cluster(ray_local: str, checkpoint: str) -> Iterator[ClusterHandle]:
    config = EngineConfig.from_kwargs(checkpoint, data_parallel_size=2, **ENGINE_KWARGS)
    options = LaunchOptions(RankResources(num_cpus=1), host="127.0.0.1")
    handle = launch(config, options, namespace=unique_namespace("drain"))
    yield handle
    handle.shutdown()


@pytest_asyncio.fixture(loop_scope="module")
async def drivers(cluster: ClusterHandle) -> AsyncIterator[list[AsyncLLM]]:
    llms = [
        await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name=f"driver {i}")
        for i in range(2)
    ]
    yield llms
    for llm in llms:
        await llm.aclose()


def _references(
    checkpoint: str, prompts: set[tuple[int, ...]], max_tokens: int
) -> dict[tuple[int, ...], GreedyTrace]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    return {p: hf_greedy(model, list(p), max_tokens) for p in prompts}


def _check_served(served: list[Served], checkpoint: str, max_tokens: int) -> None:
    references = _references(checkpoint, {tuple(s.prompt) for s in served}, max_tokens)
    assert served
    for s in served:
        assert s.error is None and s.finish_reason == "length", s
        assert len(s.token_ids) == max_tokens, s
        assert_greedy_matches(s.token_ids, references[tuple(s.prompt)], label=str(s.ranks))


async def _routed_over(drivers: list[AsyncLLM], ranks: list[int]) -> None:
    deadline = time.monotonic() + WAIT_S
    while any(sorted(llm.serving_ranks()) != ranks for llm in drivers):
        assert time.monotonic() < deadline, [llm.serving_ranks() for llm in drivers]
        await asyncio.sleep(0.05)


def _state(cluster: ClusterHandle, rank: int) -> tuple[str, int]:
    info = cluster.membership().ranks[rank]
    return info.state.value, info.incarnation


@in_module_loop
async def test_a_rolling_restart_under_load_loses_nothing(
    cluster: ClusterHandle, drivers: list[AsyncLLM], checkpoint: str
) -> None:
    loads = [Load(llm, PROMPTS, MAX_TOKENS) for llm in drivers]
    tasks = [asyncio.create_task(load.run()) for load in loads]
    held: list[asyncio.Task[Served]] = []
    on_drained: list[asyncio.Task[Served]] = []  # the request held on each drained rank
    reports: list[DrainReport] = []
    for rank in (0, 1):
        before = _state(cluster, rank)
        # A long request on the rank: with no deadline to finish it is handed over.
        held += await hold_on_ranks(drivers[1], PROMPTS, HELD_MAX_TOKENS, {rank})
        on_drained.append(held[-1])
        reports.append(await asyncio.to_thread(drain, cluster, rank, deadline_s=0.0))
        assert _state(cluster, rank) == ("ready", before[1] + 1)  # a new incarnation serves
        await _routed_over(drivers, [0, 1])
    for load in loads:
        load.stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
    _check_served([s for load in loads for s in load.served], checkpoint, MAX_TOKENS)
    held_served = list(await asyncio.wait_for(asyncio.gather(*held), WAIT_S))
    _check_served(held_served, checkpoint, HELD_MAX_TOKENS)
    for rank, task in zip((0, 1), on_drained, strict=True):  # each moved, and finished
        assert task.result().ranks[0] == rank and len(task.result().ranks) > 1, task.result()
    assert [(r.rank, r.finished, r.restarted) for r in reports] == [
        (0, False, True),
        (1, False, True),
    ]
    history = cluster.status()["scale_history"]
    assert [e["outcome"] for e in history[-2:]] == ["drained", "drained"]
    assert cluster.status()["data_parallel_size"] == 2


@in_module_loop
async def test_a_pods_drain_leaves_the_rank_drained_until_its_process_ends(
    cluster: ClusterHandle,
    drivers: list[AsyncLLM],
    checkpoint: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`shoal drain --rank 1 --no-restart` (a pod's preStop): the rank's requests finish
    within the deadline (its report says so), it takes nothing more, and once its process ends (the pod's end:
    Ray restarts the actor in its placement group) its next incarnation serves."""
    assert ranks_on_node(cluster, "127.0.0.1") == [0, 1]
    await _routed_over(drivers, [0, 1])
    loads = [Load(llm, PROMPTS, MAX_TOKENS) for llm in drivers]
    tasks = [asyncio.create_task(load.run()) for load in loads]
    _, incarnation = _state(cluster, 1)
    args = build_parser().parse_args(
        ["drain", "--namespace", cluster.namespace, "--rank", "1", "--no-restart",
         "--deadline-s", "120", "--json"]
    )  # fmt: skip
    capsys.readouterr()
    assert await asyncio.to_thread(drain_command.run, cluster, args) == 0
    (report,) = json.loads(capsys.readouterr().out)
    # Its requests finished where they ran (the rank emptied well within the deadline).
    assert (report["rank"], report["finished"], report["restarted"]) == (1, True, False)
    assert _state(cluster, 1) == ("drained", incarnation)
    await _routed_over(drivers, [0])
    stats = ray.get(cluster.coordinator.latest_stats.remote())[1]
    assert stats["num_running_reqs"] + stats["num_waiting_reqs"] == 0
    ray.kill(ray.get_actor(engine_actor_name(1), namespace=cluster.namespace), no_restart=False)
    await _routed_over(drivers, [0, 1])
    assert _state(cluster, 1) == ("ready", incarnation + 1)
    for load in loads:
        load.stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
    _check_served([s for load in loads for s in load.served], checkpoint, MAX_TOKENS)


def test_the_only_serving_rank_and_an_unknown_rank_are_refused(cluster: ClusterHandle) -> None:
    with pytest.raises(ValueError, match="rank 7 is not in the cluster"):
        drain(cluster, 7)
    ray.get(cluster.registry.set_rank_leaving.remote(1))
    try:
        with pytest.raises(ValueError, match="only serving rank"):
            drain(cluster, 0)
    finally:
        ray.get(cluster.registry.set_rank_ready.remote(1))
