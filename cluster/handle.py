"""`ClusterHandle`: a launched or attached cluster, by namespace: its control actors, the engine
actors this process has seen, and the ways to read, wait on, shrink and stop it.

Knows how ranks are stopped (`remove_ranks`) but not how they are started
(`shoal.cluster.ranks`), nor how a cluster is launched (`shoal.cluster.launch`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import ray

from shoal.actors.coordinator import CoordinatorHandle
from shoal.actors.engine_actor import ENGINE_ACTOR_PREFIX, EngineActorHandle, engine_actor_name
from shoal.actors.membership import Membership, RankState
from shoal.actors.names import AUTOSCALER_NAME, COORDINATOR_NAME, OWNER_NAME, REGISTRY_NAME
from shoal.actors.owner import OwnerHandle
from shoal.actors.registry import RegistryHandle
from shoal.actors.registry_state import StateStore
from shoal.cluster.placement import remove_cluster_placement_groups, unplaced_ranks

logger = logging.getLogger(__name__)

# How long a caller waits for a registry that stopped answering to come back (Ray restarts it).
# A registry lost with its node is restarted only once the GCS has declared the node dead
# (tens of seconds with Ray's default health checks) and a worker has started on another node; one
# stopped with its cluster is given up on at once (its name is free).
REGISTRY_RESTART_WAIT_S = 120.0
# `shoal status`'s state of a dead rank that no node has room for (see `ClusterHandle.status`).
RANK_LOST = "lost"
# How long a killed actor may take to disappear from Ray's name table.
_ACTOR_EXIT_TIMEOUT_S = 15.0


@dataclass
class ClusterHandle:
    """A launched or attached cluster: its namespace and the actors in it."""

    namespace: str
    registry: RegistryHandle
    coordinator: CoordinatorHandle
    engines: dict[int, EngineActorHandle] = field(default_factory=dict)
    # Creates the ranks' placement groups and actors (None: a cluster from before it existed;
    # then this process creates them).
    owner: OwnerHandle | None = None

    def membership(self) -> Membership:
        return ray.get(self.registry.membership.remote())

    def status(self) -> dict[str, Any]:
        """The registry's summary, each rank with its latest `load` from the coordinator.

        A dead rank whose placement group has no node (its node was lost and no other has
        room) is "lost": Ray restarts it once a node with room joins. A rank still starting
        carries `pending`: what it waits for (a node with room, its actor's start, or the step
        its actor last reported, such as its weights' loading in percent).
        """
        status: dict[str, Any] = ray.get(self.registry.status.remote())
        loads = ray.get(self.coordinator.latest_stats.remote())
        unplaced = unplaced_ranks(self.namespace)
        reservation = describe_reservation(ray.get(self.registry.launch_options.remote()))
        for rank in status["ranks"]:
            rank["load"] = loads.get(rank["rank"])
            if rank["state"] == RankState.DEAD and rank["rank"] in unplaced:
                rank["state"] = RANK_LOST
            if rank["state"] == RankState.STARTING:
                rank["pending"] = (
                    f"waiting for resources: a node with {reservation} free"
                    if rank["rank"] in unplaced
                    else rank.get("progress") or "starting: its placement group and actor"
                )
        expert_parallel = status.get("expert_parallel")
        if expert_parallel is not None:  # the DP wave, as the ranks last reported it
            expert_parallel["current_wave"] = max(
                (load["current_wave"] for load in loads.values()), default=0
            )
            expert_parallel["running"] = any(load["is_wave_running"] for load in loads.values())
        return status

    def wait_until_stop_requested(
        self, poll_s: float = 1.0, should_stop: Callable[[], bool] | None = None
    ) -> None:
        """Blocks until someone calls `request_stop` (e.g. `shoal stop`) or the registry is gone.

        A registry that Ray restarts is waited for (see `registry_answers_again`).

        Args:
            poll_s: long-poll timeout; also how often `should_stop` is consulted.
            should_stop: optional callable; returning True ends the wait (e.g. on a signal).
        """
        epoch = -1
        while should_stop is None or not should_stop():
            try:
                membership = ray.get(
                    self.registry.wait_for_change.remote(epoch, poll_s, None, None)
                )
            except ray.exceptions.RayActorError:
                if registry_answers_again(self.registry, give_up=should_stop):
                    continue  # Ray restarted it; it read its saved state back
                logger.warning("the registry of namespace %r is gone", self.namespace)
                return
            if membership.stopping:
                return
            epoch = membership.epoch

    def engine(self, rank: int) -> EngineActorHandle:
        """The engine actor of `rank` now, looked up by name on every call.

        A handle cannot tell by itself that another driver removed the rank and started a new
        one in its place (a resize down and up again), so the actor it saw before may be dead
        for good; the one named for the rank is the live one. The cached actor is returned
        only while the name is not yet (or no longer) in Ray's table.

        Raises:
            ValueError: no actor of `rank` is named or cached.
        """
        named = get_named_actor(engine_actor_name(rank), self.namespace)
        if named is not None:
            self.engines[rank] = named
            return named
        if rank in self.engines:
            return self.engines[rank]
        raise ValueError(f"no engine actor of rank {rank} in namespace {self.namespace!r}")

    def shutdown(self) -> None:
        """Stops every engine, then removes all actors and placement groups of the cluster.

        Safe to call on a partly launched or partly dead cluster, and from any driver. The
        autoscaler, if any, goes first: no resize starts while the ranks are removed.
        """
        autoscaler = get_named_actor(AUTOSCALER_NAME, self.namespace)
        if autoscaler is not None:
            _kill_quietly(autoscaler)
        ranks = set(self.engines) | set(_named_engine_ranks(self.namespace))
        # When the registry is gone already, the named actors are still found.
        with contextlib.suppress(ray.exceptions.RayActorError):
            ranks |= set(self.membership().ranks)
        remove_ranks(self, sorted(ranks))
        _wait_quietly([self.coordinator.shutdown.remote()], timeout=10)
        owner = self.owner or get_named_actor(OWNER_NAME, self.namespace)
        for actor in (self.coordinator, self.registry, owner):
            if actor is not None:
                _kill_quietly(actor)
        StateStore(self.namespace).delete()
        remove_cluster_placement_groups(self.namespace)
        _wait_for_names_gone(
            self.namespace,
            [REGISTRY_NAME, COORDINATOR_NAME, OWNER_NAME, AUTOSCALER_NAME]
            + [engine_actor_name(r) for r in sorted(ranks)],
        )


def describe_reservation(launch_options: dict[str, Any]) -> str:
    """What one rank reserves, in words ("1 CPU", "2 GPUs and 1 CPU"), from the options the
    registry keeps (`LaunchOptions.as_dict`; empty: the defaults)."""
    amounts = [
        (launch_options.get("num_gpus") or 0.0, "GPU"),
        (launch_options.get("num_cpus", 1.0) or 0.0, "CPU"),
    ]
    words = [f"{amount:g} {name}{'s' if amount != 1 else ''}" for amount, name in amounts if amount]
    return " and ".join(words) or "room"


def registry_answers_again(
    registry: RegistryHandle,
    wait_s: float = REGISTRY_RESTART_WAIT_S,
    give_up: Callable[[], bool] | None = None,
) -> bool:
    """Whether a registry whose call just failed answers again within `wait_s` (blocks).

    Ray restarts a registry that dies and it reads its saved state back; one killed on purpose
    (`ClusterHandle.shutdown`) stays dead, and this returns False after `wait_s`, or as soon
    as `give_up()` is true.
    """
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not (give_up is not None and give_up()):
        time.sleep(0.5)
        try:
            ray.get(registry.ping.remote(), timeout=max(0.1, deadline - time.monotonic()))
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            continue
    return False


def remove_ranks(handle: ClusterHandle, ranks: Iterable[int]) -> None:
    """Stops the engines of `ranks`, kills their actors, frees their placement groups, and
    forgets them in the registry and coordinator. Ranks already gone are skipped."""
    ranks = list(ranks)
    engines = {r: e for r in ranks if (e := _engine_or_none(handle, r)) is not None}
    unregistered = _unregistered_ranks(handle)
    # Clients stop routing to them first, and take their deaths below as expected.
    _wait_quietly([handle.registry.set_rank_leaving.remote(r) for r in engines], timeout=10)
    # An actor in its constructor (starting, or restarting after a death) would answer only
    # once it is built: it is killed without being asked.
    stops = [e.shutdown.remote() for r, e in engines.items() if r not in unregistered]
    _wait_quietly(stops, timeout=30)
    owner = handle.owner
    for rank, engine in engines.items():
        _kill_quietly(engine)
        handle.engines.pop(rank, None)
        if owner is not None:
            _wait_quietly([owner.release.remote(engine_actor_name(rank))], timeout=10)
    remove_cluster_placement_groups(handle.namespace, ranks)
    for rank in ranks:
        _wait_quietly([handle.registry.remove_rank.remote(rank)], timeout=10)
        _wait_quietly([handle.coordinator.forget_rank.remote(rank)], timeout=10)


def _unregistered_ranks(handle: ClusterHandle) -> set[int]:
    """The ranks whose actors have no registered incarnation now (STARTING, or DEAD)."""
    try:
        membership = ray.get(handle.registry.membership.remote(), timeout=10)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return set()  # a registry gone or restarting: every engine is asked to stop
    states = (RankState.STARTING, RankState.DEAD)
    return {r for r, info in membership.ranks.items() if info.state in states}


def get_named_actor(name: str, namespace: str) -> Any:
    """The actor named `name` in `namespace`, or None."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def _engine_or_none(handle: ClusterHandle, rank: int) -> EngineActorHandle | None:
    try:
        return handle.engine(rank)
    except ValueError:
        return None


def _named_engine_ranks(namespace: str) -> list[int]:
    pattern = re.compile(rf"{re.escape(ENGINE_ACTOR_PREFIX)}(\d+)")
    ranks = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if not isinstance(entry, dict) or entry.get("namespace") != namespace:
            continue
        match = pattern.fullmatch(entry.get("name", ""))
        if match is not None:
            ranks.append(int(match.group(1)))
    return ranks


def _kill_quietly(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as e:  # already gone
        logger.debug("kill: %s", e)


def _wait_quietly(refs: list[ray.ObjectRef], timeout: float) -> None:
    """Waits for every call to finish or fail (a dead engine cannot shut down; it is killed
    next anyway)."""
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout)


def _wait_for_names_gone(namespace: str, names: list[str]) -> None:
    deadline = time.monotonic() + _ACTOR_EXIT_TIMEOUT_S
    pending = list(names)
    while pending and time.monotonic() < deadline:
        pending = [n for n in pending if get_named_actor(n, namespace) is not None]
        if pending:
            time.sleep(0.1)
    if pending:
        logger.warning("actors still registered after shutdown: %s", pending)
