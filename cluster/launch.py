"""The whole actor topology of a shoal cluster on one screen: launch, attach, shut down.

    namespace "<ns>"
    ├── RegistryActor      "shoal-registry"      config, membership + epochs, clients, liveness
    ├── CoordinatorActor   "shoal-coordinator"   engines PUSH stats → XPUB to clients
    ├── ClusterOwnerActor  "shoal-owner"         creates (so owns) every rank's group and actor
    └── EngineCoreActor    "shoal-engine-<r>"    one per rank, in placement group
                                                 "shoal-<ns>-rank-<r>"

Readiness handshake: the registry, coordinator and owner start first; the coordinator's
addresses and the launch's options (what a rank reserves, how ranks are placed, the bind
address) go into the registry, so a later resize starts ranks alike; each rank's placement
group is reserved (by the owner, as its actor is created); each engine actor reads the
addresses from the registry, binds its ZMQ input, starts its busy loop and registers its
endpoint itself (the registry then watches it); `launch` returns once every rank's `ready()`
has answered. A rank restarted by Ray repeats the same steps under a new identity.
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
from ray.experimental import internal_kv
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shoal.actors.coordinator import CoordinatorActor, CoordinatorHandle
from shoal.actors.engine_actor import (
    ENGINE_ACTOR_MAX_CONCURRENCY,
    ENGINE_ACTOR_PREFIX,
    EngineActorHandle,
    EngineCoreActor,
    engine_actor_name,
)
from shoal.actors.membership import Membership, registration_digest, registration_token
from shoal.actors.names import COORDINATOR_NAME, OWNER_NAME, REGISTRY_NAME
from shoal.actors.owner import ClusterOwnerActor, OwnerHandle
from shoal.actors.registry import STATE_KEY, RegistryActor, RegistryHandle
from shoal.cluster.placement import (
    PlacementStrategy,
    RankResources,
    create_rank_placement_group,
    placement_group_name,
    plan_nodes,
    remove_cluster_placement_groups,
)
from shoal.engine.config import EngineConfig
from shoal.engine.core.curve import CurveKeyPair
from shoal.engine.errors import ModelLoadError
from shoal.engine.loader import load_model_arch
from shoal.engine.parallel.expert_parallel import check_expert_parallel

logger = logging.getLogger(__name__)

# How long a caller waits for a registry that stopped answering to come back (Ray restarts it).
REGISTRY_RESTART_WAIT_S = 30.0

DEFAULT_NAMESPACE = "shoal"
ENGINE_MAX_RESTARTS = 4
READY_TIMEOUT_S = 600.0
# How long the registry and the coordinator may take to start (a new Ray worker each).
CONTROL_START_TIMEOUT_S = 60.0
# How long a killed actor may take to disappear from Ray's name table.
_ACTOR_EXIT_TIMEOUT_S = 15.0


class ClusterExistsError(RuntimeError):
    """A shoal cluster already runs in this namespace."""


class ClusterNotFoundError(RuntimeError):
    """No shoal cluster runs in this namespace."""


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
        """The registry's summary, each rank with its latest `load` from the coordinator."""
        status: dict[str, Any] = ray.get(self.registry.status.remote())
        loads = ray.get(self.coordinator.latest_stats.remote())
        for rank in status["ranks"]:
            rank["load"] = loads.get(rank["rank"])
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
        """The engine actor of `rank`, looked up by name when this handle has not seen it."""
        if rank not in self.engines:
            self.engines[rank] = ray.get_actor(engine_actor_name(rank), namespace=self.namespace)
        return self.engines[rank]

    def shutdown(self) -> None:
        """Stops every engine, then removes all actors and placement groups of the cluster.

        Safe to call on a partly launched or partly dead cluster, and from any driver.
        """
        ranks = set(self.engines) | set(_named_engine_ranks(self.namespace))
        # When the registry is gone already, the named actors are still found.
        with contextlib.suppress(ray.exceptions.RayActorError):
            ranks |= set(self.membership().ranks)
        remove_ranks(self, sorted(ranks))
        _wait_quietly([self.coordinator.shutdown.remote()], timeout=10)
        owner = self.owner or _get_actor(OWNER_NAME, self.namespace)
        for actor in (self.coordinator, self.registry, owner):
            if actor is not None:
                _kill_quietly(actor)
        internal_kv._internal_kv_del(STATE_KEY, namespace=self.namespace)
        remove_cluster_placement_groups(self.namespace)
        _wait_for_names_gone(
            self.namespace,
            [REGISTRY_NAME, COORDINATOR_NAME, OWNER_NAME]
            + [engine_actor_name(r) for r in sorted(ranks)],
        )


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


def launch(
    config: EngineConfig,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    resources: RankResources | None = None,
    placement_strategy: PlacementStrategy = "pack",
    host: str | None = None,
    detached: bool = False,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> ClusterHandle:
    """Starts a named cluster of `config.parallel.data_parallel_size` engine ranks.

    Args:
        config: the engine configuration shared by all ranks.
        namespace: Ray namespace the cluster's named actors live in.
        resources: per-rank reservation; default one GPU per rank when the cluster has GPUs,
            else one CPU.
        placement_strategy: "pack" ranks onto few nodes or "spread" them.
        host: address engines and the coordinator bind to; default each node's IP.
        detached: keep the cluster after this driver exits (stop it with `shoal stop`).
        ready_timeout_s: how long placement and engine start-up may take.

    Returns:
        A handle on the running cluster; every rank is READY in the registry.

    Raises:
        ValueError: `--enable-expert-parallel` on a dense model or over more ranks than it
            has experts (checked before anything starts).
        ClusterExistsError: if the namespace already has a cluster.
        EngineStartError: if an engine fails to start (nothing is left behind).
        ray.exceptions.GetTimeoutError: if placement or start-up exceed `ready_timeout_s`.
    """
    check_launchable(config)
    _require_ray(namespace)
    if _get_actor(REGISTRY_NAME, namespace) is not None:
        raise ClusterExistsError(f"a shoal cluster already runs in namespace {namespace!r}")
    resources = resources or default_resources()
    lifetime = "detached" if detached else None
    # Both are restarted by Ray when they die: the registry reads its saved state back and the
    # coordinator binds its old addresses again (see their modules).
    control = {"namespace": namespace, "lifetime": lifetime, "num_cpus": 0, "max_restarts": -1}
    registry: RegistryHandle = (
        ray.remote(RegistryActor)
        .options(name=REGISTRY_NAME, **control)
        .remote(namespace, config, detached)
    )
    # The coordinator's key pair is made here and lives in its constructor's arguments, so a
    # coordinator that Ray restarts is the same CURVE server to every engine and client.
    coordinator_keys = CurveKeyPair.generate()
    coordinator: CoordinatorHandle = (
        ray.remote(CoordinatorActor)
        .options(name=COORDINATOR_NAME, **control)
        .remote(host or "", namespace, coordinator_keys)
    )
    owner: OwnerHandle = (
        ray.remote(ClusterOwnerActor)
        .options(name=OWNER_NAME, namespace=namespace, lifetime=lifetime, num_cpus=0)
        .remote()
    )
    handle = ClusterHandle(namespace, registry, coordinator, owner=owner)
    try:
        # The control actors' start is not the ranks' placement: it has its own bound.
        report_address, publish_address = ray.get(
            coordinator.addresses.remote(), timeout=CONTROL_START_TIMEOUT_S
        )
        ray.get(
            registry.set_coordinator.remote(
                report_address, publish_address, coordinator_keys.public
            )
        )
        options = LaunchOptions(resources, placement_strategy, host, detached)
        ray.get(registry.set_launch_options.remote(options.as_dict()))
        ranks = range(config.parallel.data_parallel_size)
        add_ranks(
            handle,
            config,
            ranks,
            resources,
            placement_strategy,
            host=host,
            detached=detached,
            ready_timeout_s=ready_timeout_s,
        )
    except BaseException as e:  # the caller gets `e`, with its traceback
        logger.error("launch of namespace %r failed (%s); tearing down", namespace, e)
        handle.shutdown()
        raise
    return handle


def check_launchable(config: EngineConfig) -> None:
    """Refuses, before anything starts, a configuration no rank could serve.

    Raises:
        ValueError: expert parallelism on a dense model, or over more ranks than experts.
    """
    parallel = config.parallel
    if not parallel.enable_expert_parallel:
        return
    try:
        arch = load_model_arch(config.model.model)
    except ModelLoadError:
        return  # not readable here (another node's path): the ranks check it as they start
    check_expert_parallel(arch, parallel.data_parallel_size)


def add_ranks(
    handle: ClusterHandle,
    config: EngineConfig,
    ranks: Iterable[int],
    resources: RankResources,
    placement_strategy: PlacementStrategy = "pack",
    *,
    host: str | None = None,
    detached: bool = False,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> None:
    """Reserves placement groups and starts engine actors for `ranks`; returns when all serve.

    Raises:
        EngineStartError: if an engine fails to start.
        ray.exceptions.GetTimeoutError: if placement or start-up exceed `ready_timeout_s`.
    """
    ranks = list(ranks)
    targets = plan_nodes(len(ranks), resources, placement_strategy)
    num_waiting = targets.count(None)
    if num_waiting:
        logger.warning(
            "the Ray cluster has room for %d of %d ranks (%s each) now; the rest wait for "
            "nodes (an autoscaler may add them) for up to %.0f s",
            len(ranks) - num_waiting,
            len(ranks),
            resources.bundle(),
            ready_timeout_s,
        )
    groups: dict[int, PlacementGroup] = _as_owner(
        handle,
        _create_placement_groups,
        handle.namespace,
        dict(zip(ranks, targets, strict=True)),
        resources,
        detached,
    )
    start = time.monotonic()
    placed = {rank: group.ready() for rank, group in groups.items()}
    _, unplaced = ray.wait(list(placed.values()), num_returns=len(placed), timeout=ready_timeout_s)
    if unplaced:
        waiting = sorted(rank for rank, ready in placed.items() if ready in unplaced)
        raise ray.exceptions.GetTimeoutError(
            f"ranks {waiting} found no node with room for {resources.bundle()} each within "
            f"{ready_timeout_s:.0f} s"
        )
    for rank, group in groups.items():
        # The rank's key pair, made here and kept in its constructor's arguments (a restarted
        # rank has the same one): the coordinator admits it before the engine first connects,
        # since a connection refused at its handshake is not tried again; and the registry
        # takes registrations only with the token derived from it.
        rank_keys = CurveKeyPair.generate()
        ray.get(
            handle.registry.plan_rank.remote(
                rank,
                engine_actor_name(rank),
                placement_group_name(handle.namespace, rank),
                registration_digest(registration_token(rank_keys)),
            )
        )
        ray.get(handle.coordinator.admit_engine.remote(rank, rank_keys.public))
        handle.engines[rank] = _as_owner(
            handle,
            _create_engine_actor,
            handle.namespace,
            rank,
            group,
            resources,
            detached,
            config,
            host,
            rank_keys,
            keep_as=engine_actor_name(rank),
        )
    deadline = start + ready_timeout_s
    readiness = {rank: handle.engines[rank].ready.remote() for rank in ranks}
    for rank, ready in readiness.items():
        try:
            ray.get(ready, timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.RayActorError as e:
            raise EngineStartError(rank, e) from e
        except ray.exceptions.GetTimeoutError as e:
            raise ray.exceptions.GetTimeoutError(
                f"rank {rank} did not start serving within {ready_timeout_s:.0f} s"
            ) from e
    logger.info("ranks %s ready in %.1f s", ranks, time.monotonic() - start)


@dataclass(frozen=True)
class LaunchOptions:
    """How a cluster's ranks are started, kept in its registry so that a resize, from any
    driver, starts new ranks as the launch did."""

    resources: RankResources
    placement_strategy: PlacementStrategy = "pack"
    host: str | None = None
    detached: bool = False

    def as_dict(self) -> dict[str, Any]:
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
        saved: dict[str, Any] | None = ray.get(handle.registry.launch_options.remote())
        if not saved:
            return cls(default_resources())
        return cls(
            RankResources(num_cpus=saved["num_cpus"], num_gpus=saved["num_gpus"]),
            saved["placement_strategy"],
            saved["host"],
            saved["detached"],
        )


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
    namespace: str,
    targets: dict[int, str | None],
    resources: RankResources,
    detached: bool,
) -> dict[int, PlacementGroup]:
    return {
        rank: create_rank_placement_group(
            namespace, rank, resources, target_node_id=target, detached=detached
        )
        for rank, target in targets.items()
    }


def _create_engine_actor(
    namespace: str,
    rank: int,
    group: PlacementGroup,
    resources: RankResources,
    detached: bool,
    config: EngineConfig,
    host: str | None,
    rank_keys: CurveKeyPair,
) -> EngineActorHandle:
    return (
        ray.remote(EngineCoreActor)
        .options(
            name=engine_actor_name(rank),
            namespace=namespace,
            lifetime="detached" if detached else None,
            num_cpus=resources.num_cpus,
            num_gpus=resources.num_gpus,
            max_restarts=ENGINE_MAX_RESTARTS,
            max_concurrency=ENGINE_ACTOR_MAX_CONCURRENCY,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group),
        )
        .remote(config, rank, namespace, host, rank_keys)
    )


def remove_ranks(handle: ClusterHandle, ranks: Iterable[int]) -> None:
    """Stops the engines of `ranks`, kills their actors, frees their placement groups, and
    forgets them in the registry and coordinator. Ranks already gone are skipped."""
    ranks = list(ranks)
    engines = {r: e for r in ranks if (e := _engine_or_none(handle, r)) is not None}
    # Clients stop routing to them first, and take their deaths below as expected.
    _wait_quietly([handle.registry.set_rank_leaving.remote(r) for r in engines], timeout=10)
    _wait_quietly([e.shutdown.remote() for e in engines.values()], timeout=30)
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


def attach(namespace: str = DEFAULT_NAMESPACE) -> ClusterHandle:
    """Finds a running cluster by namespace (connecting to Ray at "auto" if needed).

    Raises:
        ClusterNotFoundError: if there is none.
    """
    _require_ray(namespace)
    registry = _get_actor(REGISTRY_NAME, namespace)
    coordinator = _get_actor(COORDINATOR_NAME, namespace)
    if registry is None or coordinator is None:
        raise ClusterNotFoundError(f"no shoal cluster runs in namespace {namespace!r}")
    return ClusterHandle(namespace, registry, coordinator, owner=_get_actor(OWNER_NAME, namespace))


def is_stopped(namespace: str) -> bool:
    """Whether the cluster in `namespace` is gone for good: its registry's name is free.

    A registry that Ray is restarting keeps its name; one stopped with its cluster does not.
    """
    return _get_actor(REGISTRY_NAME, namespace) is None


def _require_ray(namespace: str) -> None:
    if not ray.is_initialized():
        ray.init(address="auto", namespace=namespace, log_to_driver=False)


def default_resources() -> RankResources:
    """One GPU per rank when the cluster has GPUs, else one CPU."""
    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    return RankResources(num_cpus=1, num_gpus=1 if has_gpus else 0)


def _get_actor(name: str, namespace: str) -> Any:
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
        pending = [n for n in pending if _get_actor(n, namespace) is not None]
        if pending:
            time.sleep(0.1)
    if pending:
        logger.warning("actors still registered after shutdown: %s", pending)
