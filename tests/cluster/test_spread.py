"""Placement across two real Ray nodes on this machine: "spread" puts ranks on both."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import ray
from ray.util.placement_group import placement_group_table, remove_placement_group

from shoal.cluster.placement import RankResources, create_rank_placement_group, plan_nodes
from tests.ray_utils import RayHead, start_ray_worker, stop_process_group, unique_namespace

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes(ray_head: RayHead) -> Iterator[list[str]]:
    """The head (4 CPUs) plus a worker node (2 CPUs); yields both node ids."""
    worker_group = start_ray_worker(ray_head, num_cpus=2)
    try:
        ray.init(address=ray_head.gcs_address, namespace=unique_namespace("spread"))
        deadline = time.monotonic() + 60
        while len(alive := [n for n in ray.nodes() if n["Alive"]]) < 2:
            assert time.monotonic() < deadline, "the worker node never joined"
            time.sleep(0.5)
        yield [n["NodeID"] for n in alive]
    finally:
        ray.shutdown()
        stop_process_group(worker_group)


@pytest.mark.parametrize(("strategy", "num_nodes_used"), [("spread", 2), ("pack", 1)])
def test_strategy_decides_how_many_nodes_the_ranks_use(
    two_nodes: list[str], strategy: str, num_nodes_used: int
) -> None:
    _wait_until_all_cpus_free()
    namespace = unique_namespace(strategy)
    resources = RankResources(num_cpus=1)
    targets = plan_nodes(2, resources, strategy)  # type: ignore[arg-type]
    groups = [
        create_rank_placement_group(namespace, rank, resources, target_node_id=target)
        for rank, target in enumerate(targets)
    ]
    try:
        ray.get([g.ready() for g in groups], timeout=30)
        table = placement_group_table()
        nodes = [table[g.id.hex()]["bundles_to_node_id"][0] for g in groups]
        assert nodes == targets
        assert len(set(nodes)) == num_nodes_used
    finally:
        for group in groups:
            remove_placement_group(group)
        _wait_until_all_cpus_free()


def _wait_until_all_cpus_free() -> None:
    # Removal is asynchronous: the next case's soft targets need the CPUs back first.
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, "placement groups were not released"
        time.sleep(0.1)
