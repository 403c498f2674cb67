"""`AutoscalerActor`: the control actor that sizes a cluster (`shoal serve --autoscale`).

    namespace "<ns>"
    └── AutoscalerActor  "shoal-autoscaler"   every interval_s:
            registry.membership, registry.is_scaling   which ranks serve, the committed size
            coordinator.latest_stats                   their published load (no engine asked)
            autoscale_policy.decide                    the size the cluster should have
            elastic.scale(desired)                     applied through the one resize path

It only applies decisions: the algorithm is `shoal.cluster.autoscale_policy`'s. Each decision
is logged with its reason and kept in the registry (`AutoscalerRecord`), where `shoal status`
and every front end's metrics read it. A scale-up's new ranks are started as the launch
started its ranks, by the cluster's owner, and may wait for a node that Ray's autoscaler adds
(KubeRay: a GPU pod); while they wait they are pending, not capacity. A scale-down removes
the highest rank, whose requests move to the others with their tokens so far.

The actor is created by the cluster's owner (it lives as the cluster lives), restarted by Ray
if it dies (reading its counts back from the registry), and killed first when the cluster is
shut down (`ClusterHandle.shutdown`), so that no resize starts meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict
from typing import Any, TypeAlias

import ray
from ray.actor import ActorProxy
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shoal.actors.membership import Membership
from shoal.actors.names import AUTOSCALER_NAME, COORDINATOR_NAME, OWNER_NAME, REGISTRY_NAME
from shoal.actors.scale_state import AUTOSCALER_DECISIONS, AutoscalerDecision, AutoscalerRecord
from shoal.cluster.autoscale_policy import (
    AutoscalerConfig,
    ClusterLoad,
    Decision,
    PolicyState,
    RankLoad,
    decide,
)
from shoal.cluster.elastic import ScaleError, ScaleInProgressError, scale
from shoal.cluster.handle import ClusterHandle, get_named_actor
from shoal.cluster.ranks import READY_TIMEOUT_S

logger = logging.getLogger(__name__)

_CONTROL_TIMEOUT_S = 30.0
# The owner named in the registry's scale lock (`shoal status` shows who resizes).
SCALE_OWNER = "autoscaler"


class AutoscalerActor:
    """Reads the load, decides, resizes: on a thread of its own, until `stop`.

    Args:
        namespace: the cluster's namespace.
        config: the policy's bounds and targets.
        ready_timeout_s: how long a scale-up's new ranks may take to be placed and start
            (a node that Ray's autoscaler adds included); past it the resize is rolled back.
    """

    def __init__(
        self, namespace: str, config: AutoscalerConfig, ready_timeout_s: float = READY_TIMEOUT_S
    ) -> None:
        self._handle = ClusterHandle(
            namespace,
            ray.get_actor(REGISTRY_NAME, namespace=namespace),
            ray.get_actor(COORDINATOR_NAME, namespace=namespace),
            owner=get_named_actor(OWNER_NAME, namespace),
        )
        self._config = config
        self._ready_timeout_s = ready_timeout_s
        saved = ray.get(self._handle.registry.autoscaler.remote())
        self._record = AutoscalerRecord(config.min_size, config.max_size, config.min_size)
        if saved is not None:  # a restart: the counts go on
            self._record.decisions_total = dict(saved.decisions_total)
            self._record.decisions = list(saved.decisions)
            self._record.desired_size = saved.desired_size
        self._state = PolicyState()
        self._thread = threading.Thread(target=self._run, name="shoal-autoscaler", daemon=True)
        self._thread.start()

    @ray.method
    def ready(self) -> AutoscalerConfig:
        """The policy's configuration, once the actor runs."""
        return self._config

    def _run(self) -> None:
        self._publish()
        while True:
            time.sleep(self._config.interval_s)
            try:
                self._tick()
            except ray.exceptions.RayActorError:
                logger.info("autoscaler: the cluster's registry is gone; stopping")
                return
            except Exception:
                logger.exception("autoscaler: a tick failed; trying again next tick")

    def _tick(self) -> None:
        load = self._read_load()
        decision, self._state = decide(self._config, self._state, load)
        if decision.desired_size == load.size:
            return
        self._apply(decision, load.size)

    def _read_load(self) -> ClusterLoad:
        """The committed size, the serving ranks' latest stats and whether a resize runs."""
        registry = self._handle.registry
        membership_ref, scaling_ref = registry.membership.remote(), registry.is_scaling.remote()
        stats_ref = self._handle.coordinator.latest_stats.remote()
        membership: Membership = ray.get(membership_ref, timeout=_CONTROL_TIMEOUT_S)
        is_scaling = ray.get(scaling_ref, timeout=_CONTROL_TIMEOUT_S)
        stats = ray.get(stats_ref, timeout=_CONTROL_TIMEOUT_S)
        return ClusterLoad(
            time.monotonic(),
            membership.config.parallel.data_parallel_size,
            serving_loads(membership, stats),
            is_scaling,
        )

    def _apply(self, decision: Decision, from_size: int) -> None:
        """Resizes to the decision's size through `elastic.scale`, recording the decision
        before (so `shoal status` shows it while it runs) and its outcome after."""
        entry = AutoscalerDecision(
            time.time(),
            decision.direction,
            decision.reason,
            from_size,
            decision.desired_size,
            decision.detail,
        )
        logger.info(
            "autoscaler: %s %d → %d ranks (%s: %s)",
            decision.direction,
            from_size,
            decision.desired_size,
            decision.reason,
            decision.detail,
        )
        key = f"{decision.direction}/{decision.reason}"
        totals = self._record.decisions_total
        totals[key] = totals.get(key, 0) + 1
        self._record.desired_size = decision.desired_size
        self._record.decisions = [*self._record.decisions, entry][-AUTOSCALER_DECISIONS:]
        self._publish()
        entry.outcome = self._resize(decision.desired_size)
        if entry.outcome != "committed":
            self._record.desired_size = from_size
        self._state = self._state.after_resize(time.monotonic(), self._config.cooldown_s)
        self._publish()

    def _resize(self, size: int) -> str:
        """Runs one resize; returns its outcome."""
        try:
            report = scale(
                self._handle,
                size,
                owner=SCALE_OWNER,
                ready_timeout_s=self._ready_timeout_s,
                max_size=self._config.max_size,
            )
        except ScaleInProgressError as e:
            logger.info("autoscaler: another resize runs (%s); deciding again later", e)
            return "refused"
        except (ScaleError, ValueError) as e:
            logger.warning("autoscaler: the resize to %d ranks failed: %s", size, e)
            return "rolled_back"
        return report.outcome

    def _publish(self) -> None:
        """Hands the record to the registry (a registry restarting misses one update)."""
        try:
            ray.get(
                self._handle.registry.set_autoscaler.remote(self._record),
                timeout=_CONTROL_TIMEOUT_S,
            )
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            logger.debug("autoscaler: record not kept: %s", e)


def serving_loads(membership: Membership, stats: dict[int, dict[str, Any]]) -> tuple[RankLoad, ...]:
    """The latest load of every serving rank: READY, registered, with stats. A rank still
    starting (pending a node, loading), restarting or leaving is no capacity."""
    fields = RankLoad.__dataclass_fields__
    return tuple(
        RankLoad(**{name: stats[rank][name] for name in fields})
        for rank, info in sorted(membership.ranks.items())
        if info.is_routable and rank in stats
    )


# What callers hold: Ray's typed proxy, so mypy checks every `.remote` call.
AutoscalerHandle: TypeAlias = ActorProxy[AutoscalerActor]


def start_autoscaler(
    handle: ClusterHandle,
    config: AutoscalerConfig,
    *,
    detached: bool = False,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> AutoscalerHandle:
    """Starts the cluster's autoscaler, created by its owner so it lives as the cluster lives.

    Raises:
        ValueError: the cluster has one already.
    """
    if get_named_actor(AUTOSCALER_NAME, handle.namespace) is not None:
        raise ValueError(f"namespace {handle.namespace!r} has an autoscaler already")
    args = (handle.namespace, config, detached, ready_timeout_s)
    actor: AutoscalerHandle
    if handle.owner is None:
        actor = _create_autoscaler(*args)
    else:
        call = handle.owner.run.remote(_create_autoscaler, args, AUTOSCALER_NAME)
        actor = ray.get(call, timeout=_CONTROL_TIMEOUT_S)
    ray.get(actor.ready.remote(), timeout=_CONTROL_TIMEOUT_S)
    logger.info("autoscaler on: %s", asdict(config))
    return actor


def _create_autoscaler(
    namespace: str, config: AutoscalerConfig, detached: bool, ready_timeout_s: float
) -> AutoscalerHandle:
    return (
        ray.remote(AutoscalerActor)
        .options(
            name=AUTOSCALER_NAME,
            namespace=namespace,
            lifetime="detached" if detached else None,
            num_cpus=0,
            max_restarts=-1,
            # Beside the other control actors (the owner creates it on their node), softly: a
            # 0-CPU actor on a node that Ray's autoscaler added would be lost with it.
            scheduling_strategy=NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=True
            ),
        )
        .remote(namespace, config, ready_timeout_s)
    )
