"""Node loss on a simulated two-node Ray cluster (a head and a second raylet on this machine):
the node holding a rank and the control actors (registry, coordinator, owner) is SIGKILLed
mid-stream. Its requests migrate with nothing lost, the control actors come back with their
state, its rank is reported lost while no node has room for it, the cluster serves on at its
smaller size, and the rank is restarted once a node with room joins."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from ray.util.state import list_actors

from shoal.actors.names import COORDINATOR_NAME, OWNER_NAME, REGISTRY_NAME
from shoal.client import AsyncLLM, SamplingParams
from shoal.client.routing.lb_client import DPLBAsyncMPClient
from shoal.client.routing.migration import REASON_RANK_FAILED
from shoal.cluster.launch import ClusterHandle, LaunchOptions, attach, launch
from shoal.cluster.placement import RankResources
from shoal.deploy.status import format_status
from shoal.engine.config import EngineConfig
from shoal.engine.protocol import RequestOutputKind
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import (
    FAST_NODE_DEATH,
    RayHead,
    kill_process_group,
    start_ray_head,
    start_ray_worker,
    stop_process_group,
    stop_ray_head,
    unique_namespace,
    wait_for_node,
)
from tests.reference import GreedyTrace, assert_greedy_matches, hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MAX_TOKENS = 300
PARAMS = SamplingParams(
    temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=RequestOutputKind.DELTA
)
PROMPTS = [f"what node number {i} saw before it went away" for i in range(4)]
ENGINE_KWARGS: dict[str, Any] = {
    "num_gpu_blocks_override": 128,
    "max_model_len": 512,
    "max_num_batched_tokens": 64,
}
NODE_B, NODE_C = "shoal-test-node-b", "shoal-test-node-c"


@dataclass
class Nodes:
    """The simulated Ray cluster: the head (with the test's driver) and worker raylets."""

    head: RayHead
    namespace: str
    worker_groups: dict[str, int] = field(default_factory=dict)  # node resource → group

    def add(self, resource: str) -> str:
        """Starts a one-CPU node offering `resource`; returns its node id once it is up."""
        self.worker_groups[resource] = start_ray_worker(self.head, 1, {resource: 1})
        return wait_for_node(resource)

    def lose(self, resource: str) -> None:
        kill_process_group(self.worker_groups.pop(resource))


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    if ray.is_initialized():
        ray.shutdown()
    head = start_ray_head(num_cpus=1, system_env=FAST_NODE_DEATH)
    made = Nodes(head, unique_namespace("node-loss"))
    try:
        ray.init(address=head.gcs_address, namespace=made.namespace, log_to_driver=False)
        yield made
    finally:
        ray.shutdown()
        for group in made.worker_groups.values():
            stop_process_group(group)
        stop_ray_head(head)


@ray.remote(num_cpus=0)
def _launch_here(config: EngineConfig, namespace: str) -> None:
    """Launches a detached cluster from the node this task runs on, so that its control
    actors start there."""
    options = LaunchOptions(
        RankResources(num_cpus=1), placement_strategy="spread", host="127.0.0.1", detached=True
    )
    launch(config, options, namespace=namespace)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="module")
def cluster(nodes: Nodes, checkpoint: str) -> Iterator[ClusterHandle]:
    """Two ranks, one per node; the registry, coordinator and owner on node B."""
    node_b = nodes.add(NODE_B)
    config = EngineConfig.from_kwargs(checkpoint, data_parallel_size=2, **ENGINE_KWARGS)
    on_b = NodeAffinitySchedulingStrategy(node_b, soft=False)
    ray.get(_launch_here.options(scheduling_strategy=on_b).remote(config, nodes.namespace))
    handle = attach(nodes.namespace)
    _gather_control_actors(nodes, node_b)
    where = _actor_nodes(nodes)
    assert len({where[f"shoal-engine-{rank}"] for rank in (0, 1)}) == 2, where
    yield handle
    handle.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def driver(cluster: ClusterHandle) -> AsyncIterator[AsyncLLM]:
    llm = await AsyncLLM.connect(
        cluster.namespace, host="127.0.0.1", name="node-loss driver", policy="round-robin"
    )
    yield llm
    await llm.aclose()


def _actor_nodes(nodes: Nodes) -> dict[str, str]:
    """Each alive named actor of the cluster → the id of the node it runs on."""
    actors = list_actors(
        address=nodes.head.dashboard_url,
        filters=[("ray_namespace", "=", nodes.namespace), ("state", "=", "ALIVE")],
        detail=True,
    )
    return {a.name: a.node_id for a in actors if a.name}


def _gather_control_actors(nodes: Nodes, node_id: str) -> None:
    """Restarts each control actor that Ray put elsewhere until all run on `node_id`.

    Their soft affinity to the launching node is a preference Ray may pass over (it spills a
    start to another node now and then), and a restart keeps the same preference.
    """
    control = (REGISTRY_NAME, COORDINATOR_NAME, OWNER_NAME)
    deadline = time.monotonic() + 60
    while True:
        where = _actor_nodes(nodes)
        astray = [name for name in control if where.get(name) != node_id]
        if not astray:
            return
        assert time.monotonic() < deadline, f"{astray} do not start on node B: {where}"
        for name in astray:
            if name in where:  # alive elsewhere, not restarting now
                ray.kill(ray.get_actor(name, namespace=nodes.namespace), no_restart=False)
        time.sleep(1.0)


def _client(driver: AsyncLLM) -> DPLBAsyncMPClient:
    assert isinstance(driver.engine_core, DPLBAsyncMPClient)
    return driver.engine_core


@dataclass
class Stream:
    """What the driver saw of one streamed request."""

    prompt: str
    token_ids: list[int] = field(default_factory=list)
    ranks: list[tuple[int | None, int]] = field(default_factory=list)  # (rank, tokens before)
    num_finished: int = 0


async def _stream(driver: AsyncLLM, prompt: str) -> Stream:
    seen = Stream(prompt)
    async for output in driver.generate(prompt, PARAMS):
        rank = output.data_parallel_rank
        if not seen.ranks or seen.ranks[-1][0] != rank:
            seen.ranks.append((rank, len(seen.token_ids)))
        seen.token_ids.extend(output.outputs[0].token_ids)
        seen.num_finished += output.finished
    return seen


async def _decoding_on(driver: AsyncLLM, rank: int, min_tokens: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        entries = list(_client(driver).router.loads[rank].in_flight.values())
        if entries and all(len(e.token_ids) >= min_tokens for e in entries):
            return
        assert time.monotonic() < deadline, "the requests did not decode on the rank"
        await asyncio.sleep(0.02)


def _rank_states(handle: ClusterHandle) -> dict[int, str]:
    return {r["rank"]: r["state"] for r in handle.status()["ranks"]}


async def _until(what: str, check: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        await asyncio.sleep(0.5)


def _hf_references(checkpoint: str, driver: AsyncLLM) -> dict[str, GreedyTrace]:
    """HF's greedy tokens for each prompt, with its margins: a request that moved to another
    rank recomputes its prefix in another batch, so it may differ from an undisturbed run
    exactly where HF itself is at a near-tie, and nowhere else."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = driver.get_tokenizer()
    return {p: hf_greedy(model, tokenizer.encode(p), MAX_TOKENS) for p in PROMPTS}


def _assert_served(runs: list[Stream], references: dict[str, GreedyTrace]) -> None:
    for run in runs:
        assert run.num_finished == 1, run
        assert_greedy_matches(run.token_ids, references[run.prompt], label=str(run.ranks))


async def test_losing_the_node_of_the_control_actors_loses_no_request(
    nodes: Nodes, cluster: ClusterHandle, driver: AsyncLLM, checkpoint: str
) -> None:
    references = await asyncio.to_thread(_hf_references, checkpoint, driver)
    _assert_served(await asyncio.gather(*(_stream(driver, p) for p in PROMPTS)), references)
    clients_before = [c["name"] for c in cluster.status()["clients"]]
    coordinator_before = ray.get(cluster.coordinator.addresses.remote())

    # Two streams per rank, decoding, when node B goes.
    node_b = wait_for_node(NODE_B)
    where = _actor_nodes(nodes)
    victim = next(rank for rank in (0, 1) if where[f"shoal-engine-{rank}"] == node_b)
    tasks = [asyncio.create_task(_stream(driver, p)) for p in PROMPTS]
    while len(_client(driver).router) < len(tasks):
        await asyncio.sleep(0.01)
    await _decoding_on(driver, victim, 8)
    nodes.lose(NODE_B)

    runs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    _assert_served(runs, references)
    assert any(before > 0 for run in runs for _rank, before in run.ranks[1:])
    assert _client(driver).router.stats.migrated.get(REASON_RANK_FAILED, 0) >= 1

    # The registry came back with its state: the driver is still attached, and the coordinator
    # again publishes where it did.
    await _until("the registry answers", lambda: _answers(cluster.registry.ping), 120)
    # `status` asks the coordinator too, which restarts after the registry (it waits for it).
    await _until("the coordinator answers", lambda: _answers(cluster.coordinator.addresses), 120)
    assert [c["name"] for c in cluster.status()["clients"]] == clients_before
    assert ray.get(cluster.coordinator.addresses.remote(), timeout=60) == coordinator_before
    where = _actor_nodes(nodes)
    assert all(where[name] != node_b for name in (REGISTRY_NAME, COORDINATOR_NAME, OWNER_NAME))

    # No node has room for the lost rank: reported lost, and the other one serves alone.
    await _until("the rank is reported lost", lambda: _rank_states(cluster)[victim] == "lost")
    assert f"{victim:<5}lost" in format_status(cluster.status())
    runs = await asyncio.wait_for(asyncio.gather(*(_stream(driver, p) for p in PROMPTS)), 120)
    _assert_served(runs, references)
    assert {rank for run in runs for rank, _ in run.ranks} == {1 - victim}

    # A node with room joins: the rank is restarted there and serves again.
    node_c = nodes.add(NODE_C)
    await _until("the rank serves again", lambda: _rank_states(cluster)[victim] == "ready")
    assert _actor_nodes(nodes)[f"shoal-engine-{victim}"] == node_c
    await _until("the driver routes to it", lambda: victim in _client(driver).lb_engines)
    runs = await asyncio.wait_for(asyncio.gather(*(_stream(driver, p) for p in PROMPTS)), 120)
    _assert_served(runs, references)
    assert {rank for run in runs for rank, _ in run.ranks} == {0, 1}


def _answers(method: Any) -> bool:
    try:
        ray.get(method.remote(), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
    return True
