"""Placement planning on `ray.nodes()`-shaped records, and real placement groups per rank."""

from __future__ import annotations

import pytest
import ray
from ray.util.placement_group import placement_group_table

from shoal.cluster.placement import (
    RankResources,
    create_rank_placement_group,
    live_placement_group_names,
    plan_nodes,
    remove_cluster_placement_groups,
)
from tests.ray_utils import unique_namespace


def _node(node_id: str, cpus: float, gpus: float = 0.0, alive: bool = True) -> dict[str, object]:
    resources = {"CPU": cpus, "memory": 1e9}
    if gpus:
        resources["GPU"] = gpus
    return {"NodeID": node_id, "Alive": alive, "Resources": resources}


NODES = [_node("a", cpus=16, gpus=2), _node("b", cpus=16, gpus=4), _node("c", cpus=2)]
GPU_RANK = RankResources(num_cpus=2, num_gpus=1)


def test_bundle_is_sized_by_the_rank() -> None:
    assert RankResources(num_cpus=1).bundle() == {"CPU": 1}
    assert RankResources(num_cpus=4, num_gpus=2).bundle() == {"CPU": 4, "GPU": 2}
    assert RankResources(num_cpus=4, num_gpus=2).fits_on({"CPU": 16, "GPU": 5}) == 2
    assert RankResources(num_cpus=4, num_gpus=2).fits_on({"CPU": 16}) == 0
    with pytest.raises(ValueError):
        RankResources(num_cpus=0, num_gpus=0)


def test_pack_fills_each_node_before_the_next() -> None:
    assert plan_nodes(3, GPU_RANK, "pack", NODES) == ["a", "a", "b"]
    assert plan_nodes(6, GPU_RANK, "pack", NODES) == ["a", "a", "b", "b", "b", "b"]


def test_spread_deals_ranks_round_robin_over_nodes_that_fit() -> None:
    # Node c has no GPU: never chosen for a GPU rank.
    assert plan_nodes(4, GPU_RANK, "spread", NODES) == ["a", "b", "a", "b"]
    # a is full after two ranks; the rest go to b.
    assert plan_nodes(5, GPU_RANK, "spread", NODES) == ["a", "b", "a", "b", "b"]
    # CPU ranks may use every node.
    assert plan_nodes(3, RankResources(num_cpus=2), "spread", NODES) == ["a", "b", "c"]


def test_ranks_beyond_capacity_and_dead_nodes_get_no_target() -> None:
    nodes = [*NODES, _node("d", cpus=64, gpus=8, alive=False)]
    assert plan_nodes(8, GPU_RANK, "pack", nodes)[6:] == [None, None]
    assert plan_nodes(8, GPU_RANK, "spread", nodes)[6:] == [None, None]
    assert plan_nodes(2, GPU_RANK, "spread", []) == [None, None]
    with pytest.raises(ValueError, match="placement strategy"):
        plan_nodes(1, GPU_RANK, "scatter", NODES)  # type: ignore[arg-type]


def test_rank_placement_groups_are_created_and_removed_by_name(ray_local: str) -> None:
    namespace = unique_namespace("pg")
    other = unique_namespace("pg")
    resources = RankResources(num_cpus=1)
    (node_id,) = (n["NodeID"] for n in ray.nodes() if n["Alive"])
    groups = [
        create_rank_placement_group(namespace, rank, resources, target_node_id=node_id)
        for rank in (0, 1)
    ]
    bystander = create_rank_placement_group(other, 0, resources)
    ray.get([g.ready() for g in [*groups, bystander]], timeout=30)
    table = placement_group_table()
    for group in groups:
        entry = table[group.id.hex()]
        assert entry["strategy"] == "STRICT_PACK"
        assert entry["bundles"] == {0: {"CPU": 1.0}}
        assert entry["bundles_to_node_id"][0] == node_id
    assert live_placement_group_names(namespace) == [
        f"shoal-{namespace}-rank-0",
        f"shoal-{namespace}-rank-1",
    ]

    assert remove_cluster_placement_groups(namespace, ranks=[1]) == 1
    assert live_placement_group_names(namespace) == [f"shoal-{namespace}-rank-0"]
    assert remove_cluster_placement_groups(namespace) == 1
    assert live_placement_group_names(namespace) == []
    # Another cluster's placement group is untouched.
    assert live_placement_group_names(other) == [f"shoal-{other}-rank-0"]
    assert remove_cluster_placement_groups(other) == 1
