"""Placement groups, one per engine rank: GPU bundles on GPU nodes, CPU bundles in tests.

A rank holds one bundle per worker process (one; or its tensor-parallel workers, one device
each: `shoal.actors.tp_worker`), STRICT_PACK: a rank never spans nodes. Across ranks, "pack" fills
one node before the next and "spread" deals ranks round-robin over the nodes that fit them;
both are soft targets given to Ray, which still places a rank wherever it fits if the target
cannot be honoured. Knows nothing of actors or the registry.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray._raylet import PlacementGroupID
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

PlacementStrategy = Literal["pack", "spread"]


@dataclass(frozen=True)
class RankResources:
    """What one rank reserves on one node: its CPUs and GPUs, split evenly over its workers'
    bundles."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0

    def __post_init__(self) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0 or self.num_cpus + self.num_gpus <= 0:
            raise ValueError(f"a rank must reserve some CPUs or GPUs, got {self}")

    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.num_cpus}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus
        return bundle

    def worker_bundles(self, workers: int) -> list[dict[str, float]]:
        """One bundle per worker, each an equal share of the rank's resources."""
        return [{name: amount / workers for name, amount in self.bundle().items()}] * workers

    def fits_on(self, node_resources: Mapping[str, float]) -> int:
        """How many ranks a node with these total resources holds."""
        counts = [
            int(node_resources.get(name, 0.0) // amount)
            for name, amount in self.bundle().items()
            if amount > 0
        ]
        return min(counts)


def placement_group_name(namespace: str, rank: int) -> str:
    return f"shoal-{namespace}-rank-{rank}"


def plan_nodes(
    num_ranks: int,
    resources: RankResources,
    strategy: PlacementStrategy,
    nodes: Sequence[Mapping[str, Any]] | None = None,
) -> list[str | None]:
    """A preferred node id per rank (None: no preference).

    Args:
        num_ranks: how many ranks to place.
        resources: what each rank reserves.
        strategy: "pack" fills each node to capacity in order; "spread" deals ranks
            round-robin over the nodes, skipping nodes that are full.
        nodes: `ray.nodes()`-shaped records (NodeID, Alive, Resources); default: `ray.nodes()`.

    Returns:
        One entry per rank. Ranks beyond the nodes' total capacity get None.
    """
    records = ray.nodes() if nodes is None else nodes
    capacity = {
        str(n["NodeID"]): resources.fits_on(n["Resources"])
        for n in sorted(records, key=lambda n: str(n["NodeID"]))
        if n.get("Alive", False)
    }
    capacity = {node: count for node, count in capacity.items() if count > 0}
    plan: list[str | None] = []
    if strategy == "pack":
        for node, count in capacity.items():
            plan.extend([node] * count)
    elif strategy == "spread":
        remaining = dict(capacity)
        while remaining and len(plan) < num_ranks:
            for node in list(remaining):
                plan.append(node)
                remaining[node] -= 1
                if remaining[node] == 0:
                    del remaining[node]
    else:
        raise ValueError(f"placement strategy must be 'pack' or 'spread', got {strategy!r}")
    plan = plan[:num_ranks]
    return plan + [None] * (num_ranks - len(plan))


def create_rank_placement_group(
    namespace: str,
    rank: int,
    resources: RankResources,
    *,
    target_node_id: str | None = None,
    detached: bool = False,
    workers: int = 1,
) -> PlacementGroup:
    """Creates (without waiting for it) the placement group of one rank of `workers`
    processes: its engine's actor takes bundle 0, its other TP workers one bundle each."""
    return placement_group(
        resources.worker_bundles(workers),
        strategy="STRICT_PACK",
        name=placement_group_name(namespace, rank),
        lifetime="detached" if detached else None,
        _soft_target_node_id=target_node_id,
    )


def remove_cluster_placement_groups(namespace: str, ranks: Sequence[int] | None = None) -> int:
    """Removes the live placement groups of a cluster's ranks (all ranks by default).

    Found by name in the whole Ray cluster, so it works from any driver and any namespace.

    Returns:
        How many placement groups were removed.
    """
    pattern = re.compile(rf"shoal-{re.escape(namespace)}-rank-(\d+)")
    num_removed = 0
    for group_id, entry in placement_group_table().items():
        match = pattern.fullmatch(entry.get("name", ""))
        if match is None or entry.get("state") == "REMOVED":
            continue
        if ranks is not None and int(match.group(1)) not in ranks:
            continue
        remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(group_id))))
        num_removed += 1
    return num_removed


def live_placement_group_names(namespace: str) -> list[str]:
    """Names of the cluster's placement groups that are not removed."""
    pattern = re.compile(rf"shoal-{re.escape(namespace)}-rank-\d+")
    return sorted(
        entry["name"]
        for entry in placement_group_table().values()
        if pattern.fullmatch(entry.get("name", "")) and entry.get("state") != "REMOVED"
    )


def unplaced_ranks(namespace: str) -> set[int]:
    """The cluster's ranks whose placement group has no node now: never placed yet (PENDING),
    or lost with its node and waiting for room elsewhere (RESCHEDULING)."""
    pattern = re.compile(rf"shoal-{re.escape(namespace)}-rank-(\d+)")
    return {
        int(match.group(1))
        for entry in placement_group_table().values()
        if (match := pattern.fullmatch(entry.get("name", "")))
        and entry.get("state") in ("PENDING", "RESCHEDULING")
    }
