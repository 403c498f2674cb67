"""Starting ranks: `LaunchOptions` (how every rank of a cluster is started, kept in its
registry so a resize starts new ranks alike) and `add_ranks`, which plans each rank in the
registry (from then on `shoal status` shows it pending, with what it waits for), reserves its
placement group, admits its key at the coordinator, creates its engine actor (by the
cluster's owner) and waits until every one serves.

While it waits it logs what the ranks do, once a second at most and only what changed (a rank
waiting for a node with room, each rank's start steps and its weights' loading in percent, as
the ranks report them to the registry), and it watches for `shoal stop`: a stop asked for
while ranks start ends the wait with `LaunchStopped`.

Stopping ranks is `shoal.cluster.handle.remove_ranks`; the whole launch is
`shoal.cluster.launch`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import ray
from ray.actor import ActorClass
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shoal.actors.engine_actor import (
    ENGINE_ACTOR_CONCURRENCY_GROUPS,
    ENGINE_ACTOR_MAX_CONCURRENCY,
    EngineActorHandle,
    EngineCoreActor,
    engine_actor_name,
)
from shoal.actors.membership import registration_digest, registration_token
from shoal.cluster.handle import ClusterHandle
from shoal.cluster.placement import (
    PlacementStrategy,
    RankResources,
    create_rank_placement_group,
    placement_group_name,
    plan_nodes,
)
from shoal.engine.config import EngineConfig
from shoal.engine.core.curve import CurveKeyPair

logger = logging.getLogger(__name__)

ENGINE_MAX_RESTARTS = 4
READY_TIMEOUT_S = 600.0
# How long the owner (and, at launch, the registry and coordinator) may take to answer.
CONTROL_START_TIMEOUT_S = 60.0
# How often a wait on starting ranks asks the registry what they do (and whether to stop).
PROGRESS_POLL_S = 1.0
# How often a wait for nodes with room says so again.
_WAITING_NOTE_S = 15.0


class LaunchStopped(RuntimeError):
    """`shoal stop` asked the cluster to stop while its ranks were starting."""


class EngineStartError(RuntimeError):
    """An engine actor failed to start. The message names the rank and the engine's error; the
    Ray error, with the engine's traceback, is chained as `__cause__`."""

    def __init__(self, rank: int, error: ray.exceptions.RayActorError) -> None:
        super().__init__(f"rank {rank} failed to start: {_engine_error(error)}")
        self.rank = rank


def _engine_error(error: ray.exceptions.RayActorError) -> str:
    """The exception an engine's `__init__` raised, as "Type: message", when Ray says so."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not (error.actor_init_failed and lines):
        return str(error)
    # The message ends with the engine's exception: "package.module.Type: message".
    qualified_type, separator, message = lines[-1].partition(": ")
    if separator and qualified_type.replace(".", "").replace("_", "").isalnum():
        return f"{qualified_type.rpartition('.')[2]}: {message}"
    return lines[-1]


@dataclass(frozen=True)
class LaunchOptions:
    """How a cluster's ranks are started.

    Attributes:
        resources: what each rank reserves (`default_resources()` when a launch is given none).
        placement_strategy: "pack" ranks onto few nodes or "spread" them.
        host: the address engines and the coordinator bind to; None: each node's IP.
        detached: the cluster outlives the driver that launched it (until `shoal stop`).
        ready_timeout_s: how long placement and engine start-up may take. Not kept in the
            registry: each resize brings its own (`dataclasses.replace`).
    """

    resources: RankResources
    placement_strategy: PlacementStrategy = "pack"
    host: str | None = None
    detached: bool = False
    ready_timeout_s: float = READY_TIMEOUT_S

    def as_dict(self) -> dict[str, Any]:
        """What the registry keeps (`RegistryActor.set_launch_options`)."""
        return {
            "num_cpus": self.resources.num_cpus,
            "num_gpus": self.resources.num_gpus,
            "placement_strategy": self.placement_strategy,
            "host": self.host,
            "detached": self.detached,
        }

    @classmethod
    def of(cls, handle: ClusterHandle) -> LaunchOptions:
        """The options the cluster was launched with (defaults for one launched without)."""
        saved: dict[str, Any] = ray.get(handle.registry.launch_options.remote())
        if not saved:
            return cls(default_resources())
        return cls(
            RankResources(num_cpus=saved["num_cpus"], num_gpus=saved["num_gpus"]),
            saved["placement_strategy"],
            saved["host"],
            saved["detached"],
        )


def default_resources(tensor_parallel_size: int = 1) -> RankResources:
    """One GPU per worker of a rank (`tensor_parallel_size` of them) when the cluster has GPUs,
    else one CPU per worker."""
    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    if has_gpus:
        return RankResources(num_cpus=1, num_gpus=tensor_parallel_size)
    return RankResources(num_cpus=tensor_parallel_size)


def check_rank_resources(config: EngineConfig, resources: RankResources) -> None:
    """Refuses GPUs per rank that do not give each tensor-parallel worker its own GPU.

    A rank of N workers reserves N bundles, one GPU each (none: CPU workers), so a rank's GPU
    count must be N.

    Raises:
        ValueError: a rank with GPUs and more than one worker whose GPU count is not the TP size.
    """
    tp = config.parallel.tensor_parallel_size
    if tp > 1 and resources.num_gpus and resources.num_gpus != tp:
        raise ValueError(
            f"--num-gpus-per-rank {resources.num_gpus:g} conflicts with --tensor-parallel-size "
            f"{tp}: each of a rank's {tp} workers runs on a GPU of its own (leave "
            "--num-gpus-per-rank out: it follows)"
        )


def add_ranks(
    handle: ClusterHandle, config: EngineConfig, ranks: Iterable[int], options: LaunchOptions
) -> None:
    """Reserves placement groups and starts engine actors for `ranks`; returns when all serve.

    Raises:
        EngineStartError: if an engine fails to start.
        ray.exceptions.GetTimeoutError: if placement or start-up exceed
            `options.ready_timeout_s`.
        LaunchStopped: `shoal stop` asked the cluster to stop meanwhile.
    """
    ranks = list(ranks)
    start = time.monotonic()
    deadline = start + options.ready_timeout_s
    # Each rank's key pair, made here and kept in its constructor's arguments (a restarted
    # rank has the same one): the coordinator admits it before the engine first connects,
    # since a connection refused at its handshake is not tried again; and the registry takes
    # registrations only with the token derived from it.
    keys = {rank: CurveKeyPair.generate() for rank in ranks}
    for rank in ranks:
        ray.get(
            handle.registry.plan_rank.remote(
                rank,
                engine_actor_name(rank),
                placement_group_name(handle.namespace, rank),
                registration_digest(registration_token(keys[rank])),
            )
        )
    watch = _StartWatch(handle, ranks)
    groups = _place(handle, ranks, options, config.parallel.tensor_parallel_size, watch)
    for rank, group in groups.items():
        ray.get(handle.coordinator.admit_engine.remote(rank, keys[rank].public))
        handle.engines[rank] = _as_owner(
            handle,
            _create_engine_actor,
            handle.namespace,
            rank,
            group,
            config,
            options,
            keys[rank],
            keep_as=engine_actor_name(rank),
        )
    logger.info("ranks %s placed; their actors start (a Python process each)", ranks)
    _await_ready(handle, ranks, watch, deadline, options.ready_timeout_s)
    logger.info("ranks %s ready in %.1f s", ranks, time.monotonic() - start)


class _StartWatch:
    """What a wait on starting ranks shows: each start report of its ranks, logged once, and
    a stop asked for (`shoal stop`), which ends the wait with `LaunchStopped`."""

    def __init__(self, handle: ClusterHandle, ranks: list[int]) -> None:
        self._registry = handle.registry
        self._ranks = set(ranks)
        self._shown: dict[int, int] = {}  # the number of each rank's last report logged
        self.last_news = time.monotonic()  # when a report was last logged

    def poll(self, *, can_stop: bool = True) -> None:
        """Logs each report of the ranks not logged before, in the order they came.

        Raises:
            LaunchStopped: a stop was asked for (and `can_stop`).
        """
        try:
            stopping, reports = ray.get(self._registry.start_progress.remote(), timeout=10)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
            logger.debug("no start progress from the registry: %s", e)  # it restarts
            return
        if stopping and can_stop:
            raise LaunchStopped("`shoal stop` asked the cluster to stop while its ranks started")
        for rank, kept in reports.items():
            if kept and kept[-1][0] < self._shown.get(rank, 0):
                self._shown[rank] = 0  # a registry that restarted numbers its reports anew
        news = [
            (number, rank, detail)
            for rank in self._ranks & reports.keys()
            for number, detail in reports[rank]
            if number > self._shown.get(rank, 0)
        ]
        for number, rank, detail in sorted(news):
            self._shown[rank] = number
            self.last_news = time.monotonic()
            logger.info("rank %d: %s", rank, detail)


def _await_ready(
    handle: ClusterHandle,
    ranks: list[int],
    watch: _StartWatch,
    deadline: float,
    timeout_s: float,
) -> None:
    """Waits until every rank's `ready()` answers, showing their progress meanwhile.

    Raises:
        EngineStartError: a rank's actor failed to start.
        ray.exceptions.GetTimeoutError: a rank did not serve by `deadline`.
        LaunchStopped: a stop was asked for.
    """
    pending = {rank: handle.engines[rank].ready.remote() for rank in ranks}
    while pending:
        done, _ = ray.wait(
            list(pending.values()), num_returns=len(pending), timeout=PROGRESS_POLL_S
        )
        if done:  # what the ranks said before they served, then that they serve
            watch.poll(can_stop=False)
        for rank, ref in list(pending.items()):
            if ref in done:
                del pending[rank]
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    raise EngineStartError(rank, e) from e
                logger.info("rank %d serves", rank)
        if pending and time.monotonic() >= deadline:
            raise ray.exceptions.GetTimeoutError(
                f"rank {min(pending)} did not start serving within {timeout_s:.0f} s"
            )
        if pending:
            watch.poll()
            if time.monotonic() - watch.last_news >= _WAITING_NOTE_S:
                watch.last_news = time.monotonic()
                logger.info("ranks %s are still starting", sorted(pending))


def _place(
    handle: ClusterHandle,
    ranks: list[int],
    options: LaunchOptions,
    workers: int,
    watch: _StartWatch,
) -> dict[int, PlacementGroup]:
    """Reserves one placement group per rank (a bundle per worker) and waits until all are
    placed, saying every so often which ranks still wait for room.

    Raises:
        ray.exceptions.GetTimeoutError: a rank found no room within `options.ready_timeout_s`.
        LaunchStopped: a stop was asked for.
    """
    resources, timeout_s = options.resources, options.ready_timeout_s
    targets = plan_nodes(len(ranks), resources, options.placement_strategy)
    num_waiting = targets.count(None)
    if num_waiting:
        logger.warning(
            "the Ray cluster has room for %d of %d ranks (%s each) now; the rest wait for "
            "nodes (an autoscaler may add them) for up to %.0f s",
            len(ranks) - num_waiting,
            len(ranks),
            resources.bundle(),
            timeout_s,
        )
    groups: dict[int, PlacementGroup] = _as_owner(
        handle,
        _create_placement_groups,
        handle.namespace,
        dict(zip(ranks, targets, strict=True)),
        options,
        workers,
    )
    pending = {rank: group.ready() for rank, group in groups.items()}
    deadline = time.monotonic() + timeout_s
    noted = time.monotonic()
    while pending:
        done, _ = ray.wait(
            list(pending.values()), num_returns=len(pending), timeout=PROGRESS_POLL_S
        )
        pending = {rank: ref for rank, ref in pending.items() if ref not in done}
        if not pending:
            break
        if time.monotonic() >= deadline:
            raise ray.exceptions.GetTimeoutError(
                f"ranks {sorted(pending)} found no node with room for {resources.bundle()} "
                f"each within {timeout_s:.0f} s"
            )
        watch.poll()
        if time.monotonic() - noted >= _WAITING_NOTE_S:
            noted = time.monotonic()
            logger.info(
                "ranks %s still wait for a node with room for %s each (%.0f s left)",
                sorted(pending),
                resources.bundle(),
                deadline - time.monotonic(),
            )
    return groups


def _as_owner(
    handle: ClusterHandle, create: Callable[..., Any], *args: Any, keep_as: str | None = None
) -> Any:
    """Runs a create call in the cluster's owner (see `shoal.actors.owner`), so that what it
    creates lives as the cluster lives; `keep_as` names an actor handle the owner holds."""
    if handle.owner is None:
        return create(*args)
    call = handle.owner.run.remote(create, args, keep_as)
    return ray.get(call, timeout=CONTROL_START_TIMEOUT_S)


def _create_placement_groups(
    namespace: str, targets: dict[int, str | None], options: LaunchOptions, workers: int
) -> dict[int, PlacementGroup]:
    return {
        rank: create_rank_placement_group(
            namespace,
            rank,
            options.resources,
            target_node_id=target,
            detached=options.detached,
            workers=workers,
        )
        for rank, target in targets.items()
    }


def _create_engine_actor(
    namespace: str,
    rank: int,
    group: PlacementGroup,
    config: EngineConfig,
    options: LaunchOptions,
    rank_keys: CurveKeyPair,
) -> EngineActorHandle:
    return (
        _engine_actor_class()
        .options(
            name=engine_actor_name(rank),
            namespace=namespace,
            lifetime="detached" if options.detached else None,
            # Bundle 0: the driver worker's share (`shoal.actors.tp_worker` puts the others).
            num_cpus=group.bundle_specs[0].get("CPU", 0.0),
            num_gpus=group.bundle_specs[0].get("GPU", 0.0),
            max_restarts=ENGINE_MAX_RESTARTS,
            max_concurrency=ENGINE_ACTOR_MAX_CONCURRENCY,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=0
            ),
        )
        .remote(config, rank, namespace, options.host, rank_keys)
    )


def _engine_actor_class() -> ActorClass[EngineCoreActor]:
    """`EngineCoreActor` as a Ray actor class, with the concurrency group of its liveness
    watch (Ray's typed overloads of `ray.remote` leave out `concurrency_groups`)."""
    remote: Any = ray.remote
    actor_class: ActorClass[EngineCoreActor] = remote(
        concurrency_groups=ENGINE_ACTOR_CONCURRENCY_GROUPS
    )(EngineCoreActor)
    return actor_class
