"""Elastic resizes of a running cluster: `scale` takes it from N to M ranks while it serves.

One function drives every door (`AsyncLLM.scale_elastic_ep`, `shoal scale`, the HTTP
`POST /scale_elastic_ep`), from the caller's process, on the control plane only:

    LOCK       the registry's scale lock and a new epoch (a second scale is refused)
    starting   up: placement groups and actors for ranks N..M-1 start (an expert-parallel
               cluster's new ranks load only the experts they will hold and register
               JOINING); meanwhile every old rank stages its experts for the new placement
               down: ranks M..N-1 turn LEAVING (clients stop routing to them at once)
    switching  expert parallelism: every old rank is asked to switch; at one forward that
               all of them agree on, they leave the old groups and the new set forms its
               own; a rank outside it releases its requests. Dense: the leaving ranks
               release their requests (no groups to change)
    finishing  the registry commits the new size; leaving ranks' actors and placement
               groups are removed; every rank of the new set tells its clients RECONFIGURED
    UNLOCK

Released requests move, through their clients, to a surviving rank with their tokens so far
(`shoal.engine.parallel.elastic`). Any failure before the commit rolls back: the new set's joins are
aborted, the old ranks go back to the old set, new actors and their placement groups are
removed, leaving ranks serve again, the lock is released, and `ScaleError` says why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from shoal.actors.scale_state import SCALE_LEASE_S, ScaleInProgressError
from shoal.cluster.handle import ClusterHandle, remove_ranks
from shoal.cluster.placement import (
    RankResources,
    live_placement_group_names,
    placement_group_name,
)
from shoal.cluster.ranks import READY_TIMEOUT_S, LaunchOptions, add_ranks
from shoal.engine.config import EngineConfig
from shoal.engine.errors import ModelLoadError
from shoal.engine.loader import load_model_arch
from shoal.engine.loader.hub import local_model_path
from shoal.engine.parallel.elastic import RECONFIGURED, ScaleNotice, ScalePlan, SwitchOutcome
from shoal.engine.parallel.expert_parallel import ExpertPlacement, check_expert_parallel

logger = logging.getLogger(__name__)

__all__ = ["ScaleError", "ScaleInProgressError", "ScaleReport", "scale"]

# How long the new set may take to form at the switch before the resize is rolled back.
SWITCH_TIMEOUT_S = 60.0
# How long the old ranks may take to stage their experts.
STAGE_TIMEOUT_S = 300.0
_CONTROL_TIMEOUT_S = 30.0


class ScaleError(RuntimeError):
    """A resize failed and was rolled back: the cluster serves at its old size."""


@dataclass
class ScaleReport:
    """What one resize did, with the time of each phase (seconds)."""

    epoch: int
    from_size: int
    to_size: int
    outcome: str
    phases: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "from_size": self.from_size,
            "to_size": self.to_size,
            "outcome": self.outcome,
            "phases": {k: round(v, 3) for k, v in self.phases.items()},
            "total_s": round(self.total_s, 3),
        }


def scale(
    handle: ClusterHandle,
    new_size: int,
    *,
    owner: str = "",
    ready_timeout_s: float = READY_TIMEOUT_S,
    switch_timeout_s: float = SWITCH_TIMEOUT_S,
    max_size: int | None = None,
) -> ScaleReport:
    """Resizes the cluster to `new_size` ranks while it serves (blocks until done).

    Args:
        handle: the cluster.
        new_size: the number of ranks after the resize.
        owner: who asks (shown by `shoal status` while it runs).
        ready_timeout_s: how long new ranks may take to be placed and start.
        switch_timeout_s: how long the new set may take to form at the switch.
        max_size: the most ranks allowed; up to it a resize may wait for nodes an autoscaler
            adds. Without it, a size is refused unless the live nodes can hold it.

    New ranks are started as the launch started its ranks (`LaunchOptions`: what each
    reserves, how they are placed, the bind address, detached or not), by the cluster's owner,
    so they live as long as the cluster, whoever asked for the resize.

    Returns:
        The resize's report (its outcome "committed", or "unchanged" at the same size).

    Raises:
        ValueError: a size the model cannot be served at, or more ranks than the Ray cluster
            can place (above `max_size`, when given): checked before anything starts.
        ScaleInProgressError: another resize holds the cluster's scale lock.
        ScaleError: the resize failed and was rolled back.
    """
    membership = handle.membership()
    config = membership.config
    _check_size(config, new_size)
    # New ranks start as the launch's did, within this resize's own start-up bound.
    options = replace(LaunchOptions.of(handle), ready_timeout_s=ready_timeout_s)
    if new_size > len(membership.ranks):
        _check_capacity(options.resources, new_size, max_size)
    start = time.monotonic()
    epoch, from_size = ray.get(handle.registry.begin_scale.remote(owner, new_size))
    report = ScaleReport(epoch, from_size, new_size, "unchanged")
    if new_size == from_size:
        ray.get(handle.registry.end_scale.remote(epoch, "unchanged", ""))
        return report
    resize = _Resize(handle, config, epoch, from_size, new_size, switch_timeout_s, report)
    logger.info("resize %d: %d → %d ranks (by %s)", epoch, from_size, new_size, owner or "?")
    _carry_out(handle, resize, options, report, start)
    report.outcome = "committed"
    report.total_s = time.monotonic() - start
    _end(handle, epoch, "committed")
    logger.info(
        "resize %d: %d → %d ranks committed in %.2f s; phases %s",
        epoch,
        from_size,
        new_size,
        report.total_s,
        report.as_dict()["phases"],
    )
    return report


def _carry_out(
    handle: ClusterHandle,
    resize: _Resize,
    options: LaunchOptions,
    report: ScaleReport,
    start: float,
) -> None:
    """Runs a resize while its lease is renewed; one that fails is rolled back and ended so.

    Raises:
        ScaleError: the resize failed and was rolled back.
    """
    lease = LeaseRenewal(handle, report.epoch)
    try:
        if report.to_size > report.from_size:
            resize.scale_up(options)
        else:
            resize.scale_down()
    except BaseException as e:
        resize.roll_back(e)
        report.outcome = "rolled_back"
        report.total_s = time.monotonic() - start
        _end(handle, report.epoch, "rolled_back", f"{type(e).__name__}: {e}")
        logger.error(
            "resize %d: %d → %d ranks rolled back after %.2f s (%s); phases %s",
            report.epoch,
            report.from_size,
            report.to_size,
            report.total_s,
            e,
            report.as_dict()["phases"],
        )
        if isinstance(e, ScaleError):
            raise
        raise ScaleError(
            f"the scale from {report.from_size} to {report.to_size} ranks failed and was "
            f"rolled back: {type(e).__name__}: {e}"
        ) from e
    finally:
        lease.stop()


def _check_capacity(resources: RankResources, new_size: int, max_size: int | None) -> None:
    """Refuses, before anything is created, a size above `max_size` or above what the Ray
    cluster's live nodes can hold (at what each rank reserves); with `max_size`, sizes up to
    it may wait for nodes an autoscaler adds."""
    if max_size is not None and new_size > max_size:
        raise ValueError(f"{new_size} ranks exceed the configured maximum of {max_size}")
    capacity = sum(resources.fits_on(n["Resources"]) for n in ray.nodes() if n.get("Alive"))
    if new_size > capacity and (max_size is None or new_size > max_size):
        raise ValueError(
            f"the Ray cluster's nodes hold {capacity} ranks of {resources.bundle()} each, "
            f"not {new_size}"
        )


def _check_size(config: EngineConfig, new_size: int) -> None:
    if new_size < 1:
        raise ValueError(f"a cluster needs at least one rank, not {new_size}")
    if not config.parallel.enable_expert_parallel:
        return
    if new_size < 2:
        raise ValueError(
            "an expert-parallel cluster resizes between 2 and its number of experts ranks"
        )
    try:
        arch = load_model_arch(local_model_path(config.model))
    except ModelLoadError:
        return  # another node's path: the new ranks check it as they start
    check_expert_parallel(arch, new_size)


class LeaseRenewal(threading.Thread):
    """Renews the scale lock's lease while the resize runs (a wait for nodes may outlast it);
    a caller that dies stops renewing, and the lock frees itself."""

    def __init__(self, handle: ClusterHandle, epoch: int) -> None:
        super().__init__(name=f"ScaleLease{epoch}", daemon=True)
        self._registry = handle.registry
        self._epoch = epoch
        self._stopped = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._stopped.wait(SCALE_LEASE_S / 4):
            try:
                if not ray.get(self._registry.renew_scale.remote(self._epoch), timeout=30):
                    return
            except Exception as e:  # the registry restarts: renewed on the next turn
                logger.debug("resize %d: lease not renewed: %s", self._epoch, e)

    def stop(self) -> None:
        self._stopped.set()


def _end(handle: ClusterHandle, epoch: int, outcome: str, detail: str = "") -> None:
    try:
        ray.get(handle.registry.end_scale.remote(epoch, outcome, detail), timeout=30)
    except Exception as e:  # the lease frees the lock anyway
        logger.warning("resize %d: could not release the scale lock: %s", epoch, e)


class _Resize:
    """The steps of one resize (the module docstring is the order)."""

    def __init__(
        self,
        handle: ClusterHandle,
        config: EngineConfig,
        epoch: int,
        from_size: int,
        to_size: int,
        switch_timeout_s: float,
        report: ScaleReport,
    ) -> None:
        self.handle = handle
        self.registry = handle.registry
        self.config = config
        self.epoch = epoch
        self.from_size = from_size
        self.to_size = to_size
        self.is_expert_parallel = config.parallel.enable_expert_parallel
        self.report = report
        self.new_ranks: list[int] = []
        self.leaving: list[int] = []
        self.prepared: list[int] = []
        self._phase_start = time.monotonic()
        self._phase = "starting"
        table = None
        if self.is_expert_parallel:
            arch = load_model_arch(local_model_path(config.model))
            table = ExpertPlacement.contiguous(arch.num_local_experts, to_size).expert_to_rank
        self.plan = ScalePlan(
            epoch,
            to_size,
            group_name=f"{handle.namespace}/resize-{epoch}",
            expert_to_rank=table,
            switch_timeout_s=switch_timeout_s,
        )

    def _enter(
        self,
        phase: str,
        what: str,
        plan: ScalePlan | None = None,
        new_ranks: list[int] | None = None,
    ) -> None:
        """Starts `phase` (logged with `what` it does; the phase before it is timed)."""
        now = time.monotonic()
        if self._phase != phase:  # the first phase is entered once the lock is held
            self.report.phases[self._phase] = now - self._phase_start
        logger.info("resize %d: %s: %s", self.epoch, phase, what)
        self._phase, self._phase_start = phase, now
        ray.get(self.registry.set_scale_phase.remote(self.epoch, phase, plan, new_ranks))

    def _close_phase(self) -> None:
        self.report.phases[self._phase] = time.monotonic() - self._phase_start

    # --- up ---------------------------------------------------------------------------------

    def scale_up(self, options: LaunchOptions) -> None:
        old = list(range(self.from_size))
        self.new_ranks = list(range(self.from_size, self.to_size))
        self._enter(
            "starting",
            f"ranks {self.new_ranks} start: placement groups, actors, weights",
            plan=self.plan,
            new_ranks=self.new_ranks,
        )
        if self.is_expert_parallel:  # the old ranks stage while the new ones start
            self._prepare(old)
        config = replace(
            self.config,
            parallel=replace(self.config.parallel, data_parallel_size=self.to_size),
        )
        add_ranks(self.handle, config, self.new_ranks, options)
        if self.is_expert_parallel:
            self._enter("switching", f"ranks {old + self.new_ranks} form the new groups")
            self._switch(old, self.new_ranks)
        self._enter("finishing", "the new size is committed; clients are told")
        ray.get(self.registry.commit_scale.remote(self.epoch))
        self._notify(list(range(self.to_size)))
        self._close_phase()

    # --- down -------------------------------------------------------------------------------

    def scale_down(self) -> None:
        survivors = list(range(self.to_size))
        self.leaving = list(range(self.to_size, self.from_size))
        self._enter("starting", f"ranks {self.leaving} leave: no new requests", plan=self.plan)
        # Clients stop routing to them now; their requests keep running until the switch.
        ray.get([self.registry.set_rank_leaving.remote(r) for r in self.leaving])
        self._enter("switching", f"ranks {self.leaving} hand their requests to the others")
        if self.is_expert_parallel:
            self._prepare(survivors + self.leaving)
            self._switch(survivors + self.leaving, [])
        else:
            calls = {r: self.handle.engine(r).leave.remote(self.epoch) for r in self.leaving}
            ray.get(list(calls.values()), timeout=_CONTROL_TIMEOUT_S)
            self._await_outcomes(self.leaving, [])
        self._enter("finishing", f"ranks {self.leaving} are removed; clients are told")
        ray.get(self.registry.commit_scale.remote(self.epoch))
        remove_ranks(self.handle, self.leaving)
        self._notify(survivors)
        self._close_phase()

    # --- the switch -------------------------------------------------------------------------

    def _prepare(self, ranks: list[int]) -> None:
        calls = [self.handle.engine(r).prepare_scale.remote(self.plan) for r in ranks]
        ray.get(calls, timeout=_CONTROL_TIMEOUT_S)
        self.prepared = list(ranks)

    def _switch(self, old: list[int], new: list[int]) -> None:
        """Asks the old ranks to switch and waits for every rank's outcome."""
        calls = [self.handle.engine(r).request_switch.remote(self.epoch) for r in old]
        ray.get(calls, timeout=_CONTROL_TIMEOUT_S)
        self._await_outcomes(old, new)

    def _await_outcomes(self, old: list[int], new: list[int]) -> None:
        """Every rank's outcome: COMMITTED for the new set, LEFT for leaving ranks.

        Raises:
            ScaleError: a rank rolled back, died, or did not switch in time.
        """
        timeout_s = STAGE_TIMEOUT_S + self.plan.switch_timeout_s
        waits = {
            rank: self.handle.engine(rank).wait_switched.remote(self.epoch, timeout_s)
            for rank in [*old, *new]
        }
        deadline = time.monotonic() + timeout_s + _CONTROL_TIMEOUT_S
        pending = dict(waits)
        while pending:
            ready, _ = ray.wait(
                list(pending.values()), timeout=max(0.0, deadline - time.monotonic())
            )
            if not ready:
                raise ScaleError(f"ranks {sorted(pending)} did not switch in time")
            for rank, ref in list(pending.items()):
                if ref not in ready:
                    continue
                del pending[rank]
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    raise ScaleError(f"rank {rank} died during the switch") from e
                expected = (
                    SwitchOutcome.LEFT if self.plan.is_leaving(rank) else SwitchOutcome.COMMITTED
                )
                if result is None:
                    raise ScaleError(f"rank {rank} did not switch in time")
                outcome, detail = result
                if outcome != expected.value:
                    raise ScaleError(f"rank {rank} {outcome}: {detail}")

    def _notify(self, ranks: Iterable[int]) -> None:
        ranks = list(ranks)
        for rank in ranks:
            notice = ScaleNotice(self.epoch, rank, ranks=ranks)
            _quietly(self.handle.engine(rank).notify_clients, RECONFIGURED, notice)

    # --- rollback ---------------------------------------------------------------------------

    def roll_back(self, error: BaseException) -> None:
        """Back to the old set, whatever step failed (each undo is best effort)."""
        try:
            ray.get(self.registry.set_scale_phase.remote(self.epoch, "rolling_back", None, None))
        except Exception as e:
            logger.warning("resize %d: %s", self.epoch, e)
        _quietly(self.registry.abort_scale_groups, self.epoch)
        for rank in self.prepared:
            _quietly(self.handle.engine(rank).cancel_scale, self.epoch)
        if self.new_ranks:
            remove_ranks(self.handle, self._created_ranks())
        for rank in self.leaving:
            _quietly(self.registry.set_rank_ready, rank)
        del error  # the caller reports it

    def _created_ranks(self) -> list[int]:
        """The new ranks that got a placement group, a registry entry or an actor: what a
        rollback undoes, so its work follows what was made, not what was asked for."""
        try:
            groups = set(live_placement_group_names(self.handle.namespace))
            known = set(self.handle.membership().ranks) | set(self.handle.engines)
        except Exception as e:  # the registry restarts: undo every rank asked for
            logger.warning("resize %d: %s", self.epoch, e)
            return self.new_ranks
        return [
            rank
            for rank in self.new_ranks
            if rank in known or placement_group_name(self.handle.namespace, rank) in groups
        ]


def _quietly(method: Any, *args: Any) -> None:
    """Makes one control call (`method.remote(*args)`) and waits for it, logging (not
    raising) a failure."""
    try:
        ray.get(method.remote(*args), timeout=_CONTROL_TIMEOUT_S)
    except Exception as e:
        logger.warning("a resize control call failed: %s", e)
