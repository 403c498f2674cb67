"""Graceful drain of one rank (`shoal drain`, a worker pod's `preStop`): it takes no new work,
finishes or hands over what it holds, and its process is restarted, by shoal now or by Ray
when the node it runs on goes away.

    LOCK        the registry's scale lock (no resize or other drain meanwhile)
    LEAVING     clients stop routing to the rank; its streams go on
    finishing   until the rank holds no request (its published load) or the deadline
    LEFT        what it still holds is released: each request moves, through its client, to
                another rank with its tokens so far (the scale-down's hand-over)
    DRAINED     the rank takes nothing; UNLOCK
    restart     (default) its actor is ended and Ray starts it again in its placement group:
                a new incarnation, which serves (READY) once it registers. Without restart
                (`--no-restart`, for a pod about to end) the rank stays DRAINED until its
                process ends with its node; Ray starts it again where its placement group is
                placed next, and it serves once it registers.

The cluster keeps its size and its rank numbers throughout; only a dense rank drains (an
expert-parallel rank's experts leave with it: resize instead).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from shoal.actors.engine_actor import engine_actor_name
from shoal.actors.membership import RankState
from shoal.cluster.elastic import LeaseRenewal
from shoal.cluster.handle import ClusterHandle
from shoal.cluster.ranks import READY_TIMEOUT_S
from shoal.engine.parallel.elastic import SwitchOutcome

logger = logging.getLogger(__name__)

# How long a draining rank may take to finish its requests before they are handed over.
DRAIN_DEADLINE_S = 30.0
_CONTROL_TIMEOUT_S = 30.0
_POLL_S = 0.1


class DrainError(RuntimeError):
    """A drain failed after the rank stopped taking work (its requests are handed over or
    finished; the rank may be left DRAINED: `shoal status` shows it)."""


@dataclass
class DrainReport:
    """What one drain did (seconds per step)."""

    rank: int
    finished: bool  # it emptied before the deadline (what arrived later was handed over)
    restarted: bool
    steps: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "finished": self.finished,
            "restarted": self.restarted,
            "steps": {k: round(v, 3) for k, v in self.steps.items()},
        }


def drain(
    handle: ClusterHandle,
    rank: int,
    *,
    deadline_s: float = DRAIN_DEADLINE_S,
    restart: bool = True,
    owner: str = "",
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> DrainReport:
    """Drains `rank` (the module docstring is the order); blocks until done.

    Args:
        handle: the cluster.
        rank: the rank to drain.
        deadline_s: how long its requests may take to finish before they are handed over.
        restart: restart its process now and wait until it serves again; False leaves it
            DRAINED until its process ends (its node goes away).
        owner: who asks (shown by `shoal status` while it runs).
        ready_timeout_s: how long the restarted rank may take to serve again.

    Raises:
        ValueError: no such rank, a rank that is not serving, the only serving rank, or an
            expert-parallel cluster.
        ScaleInProgressError: a resize or another drain holds the scale lock.
        DrainError: the rank did not leave, or did not serve again in time.
    """
    membership = handle.membership()
    info = membership.ranks.get(rank)
    if info is None or info.state != RankState.READY:
        state = "not in the cluster" if info is None else info.state.value
        raise ValueError(f"rank {rank} is {state}: only a serving rank drains")
    if membership.config.parallel.enable_expert_parallel:
        raise ValueError("an expert-parallel rank holds experts the others lack: resize instead")
    if not any(i.is_routable for r, i in membership.ranks.items() if r != rank):
        raise ValueError(
            f"rank {rank} is the only serving rank: its requests would have nowhere to go "
            "(scale up first)"
        )
    size = membership.config.parallel.data_parallel_size
    epoch, _ = ray.get(handle.registry.begin_scale.remote(owner or f"drain {rank}", size))
    report = DrainReport(rank, finished=False, restarted=restart)
    lease = LeaseRenewal(handle, epoch)
    try:
        _leave(handle, rank, epoch, deadline_s, report)
    except BaseException as e:
        _quietly(handle.registry.end_scale.remote(epoch, "rolled_back", f"drain {rank}: {e}"))
        raise
    finally:
        lease.stop()
    _quietly(handle.registry.end_scale.remote(epoch, "drained", f"rank {rank}"))
    if restart:
        _restart(handle, rank, info.incarnation, ready_timeout_s, report)
    logger.info("drained rank %d: %s", rank, report.as_dict())
    return report


def _leave(
    handle: ClusterHandle, rank: int, epoch: int, deadline_s: float, report: DrainReport
) -> None:
    """LEAVING → finishing → LEFT → DRAINED."""
    start = time.monotonic()
    ray.get(handle.registry.set_rank_leaving.remote(rank))
    report.finished = _until_idle(handle, rank, time.time(), start + deadline_s)
    report.steps["finishing"] = time.monotonic() - start
    start = time.monotonic()
    engine = handle.engine(rank)
    ray.get(engine.leave.remote(epoch), timeout=_CONTROL_TIMEOUT_S)
    result = ray.get(engine.wait_switched.remote(epoch, _CONTROL_TIMEOUT_S))
    if result is None or result[0] != SwitchOutcome.LEFT.value:
        raise DrainError(f"rank {rank} did not release its requests: {result}")
    ray.get(handle.registry.set_rank_drained.remote(rank))
    report.steps["handing_over"] = time.monotonic() - start


def _until_idle(handle: ClusterHandle, rank: int, since: float, deadline: float) -> bool:
    """Waits until a load the rank published after `since` (unix time: when it turned
    LEAVING; a rank reports at least every second) shows no request, or the deadline;
    returns whether it emptied. A request that a client sent before it saw LEAVING and that
    arrives after that report is released with the others by the leave."""
    while True:
        load = ray.get(handle.coordinator.latest_stats.remote()).get(rank)
        if (
            load is not None
            and load["timestamp"] >= since
            and load["num_running_reqs"] + load["num_waiting_reqs"] == 0
        ):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)


def _restart(
    handle: ClusterHandle, rank: int, incarnation: int, timeout_s: float, report: DrainReport
) -> None:
    """Ends the rank's actor so that Ray starts it again, and waits until the new
    incarnation serves.

    Raises:
        DrainError: it did not serve within `timeout_s`.
    """
    start = time.monotonic()
    # By name: Ray's kill takes the plain handle (the typed proxy is for calls).
    ray.kill(ray.get_actor(engine_actor_name(rank), namespace=handle.namespace), no_restart=False)
    while True:
        info = handle.membership().ranks.get(rank)
        if info is not None and info.state == RankState.READY and info.incarnation > incarnation:
            break
        if time.monotonic() - start > timeout_s:
            state = "gone" if info is None else info.state.value
            raise DrainError(f"rank {rank} did not serve again within {timeout_s:.0f} s ({state})")
        time.sleep(0.2)
    report.steps["restarting"] = time.monotonic() - start


def ranks_on_node(handle: ClusterHandle, node_ip: str) -> list[int]:
    """The serving ranks whose engine runs on the node at `node_ip` (a pod's own ranks)."""
    membership = handle.membership()
    return sorted(
        rank
        for rank, info in membership.ranks.items()
        if info.state == RankState.READY and info.node_ip == node_ip
    )


def _quietly(ref: ray.ObjectRef[Any]) -> None:
    try:
        ray.get(ref, timeout=_CONTROL_TIMEOUT_S)
    except Exception as e:  # the lease frees the lock anyway
        logger.warning("drain: a control call failed: %s", e)
