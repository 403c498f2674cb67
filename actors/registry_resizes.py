"""`Resizes`: the registry's part that keeps resizes: the scale lock with its lease and phase,
each resize's commit, the past resizes, what a starting rank is told about the set it joins,
the rendezvous store the expert-parallel ranks form their groups at, and the autoscaler's
record (`AutoscalerRecord`).

Owns `ResizeState`; its collaborator is the `MembershipTable`, whose epoch orders every change
(a commit also changes the cluster's size and turns the resize's JOINING ranks READY). The
registry's event loop runs every call, so nothing here needs a lock; `shoal.cluster.elastic`
drives the protocol through the registry's remote methods.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import msgspec
import ray

from shoal.actors.membership import RankState
from shoal.actors.membership_table import MembershipTable
from shoal.actors.rendezvous import RendezvousServer
from shoal.actors.scale_state import (
    SCALE_HISTORY,
    SCALE_LEASE_S,
    AutoscalerRecord,
    EngineStart,
    ResizeState,
    ScaleEvent,
    ScaleInProgressError,
    ScaleRecord,
)
from shoal.engine.parallel.distributed import ABORT_KEY
from shoal.engine.parallel.elastic import ScalePlan

logger = logging.getLogger(__name__)


class Resizes:
    """The scale lock and the resize holding it.

    Args:
        state: what this part keeps (fresh, or read back after a restart).
        table: the membership, whose epoch every change bumps and whose hook saves.
        namespace: the cluster's namespace (the default rendezvous prefix).
    """

    def __init__(self, state: ResizeState, table: MembershipTable, namespace: str) -> None:
        self._state = state
        self._table = table
        self._namespace = namespace
        self._rendezvous: RendezvousServer | None = None

    # --- the launch's options ----------------------------------------------------------------

    def set_launch_options(self, options: dict[str, Any]) -> None:
        self._state.launch_options = dict(options)
        self._table.save()

    def launch_options(self) -> dict[str, Any]:
        return dict(self._state.launch_options)

    # --- the lock and the phases -------------------------------------------------------------

    def begin(self, owner: str, to_size: int) -> tuple[int, int]:
        """Takes the lock (see `RegistryActor.begin_scale`). Returns (epoch, current size)."""
        s, now = self._state, time.time()
        held = s.scale
        if held is not None and now - held.renewed_at < SCALE_LEASE_S:
            raise ScaleInProgressError(
                f"a scale from {held.from_size} to {held.to_size} ranks (epoch {held.epoch}, "
                f"by {held.owner}) is in progress: phase {held.phase}"
            )
        if held is not None:
            logger.warning("scale %d's lease ran out; its lock is taken over", held.epoch)
        s.scale_epoch += 1
        from_size = self._table.config.parallel.data_parallel_size
        s.scale = ScaleRecord(s.scale_epoch, owner, from_size, to_size, "starting", now, now)
        self._table.bump()
        return s.scale_epoch, from_size

    def set_phase(
        self, epoch: int, phase: str, plan: ScalePlan | None, new_ranks: list[int] | None
    ) -> None:
        """Records the phase of the resize holding the lock (which renews its lease)."""
        record = self._record(epoch)
        record.phase, record.renewed_at = phase, time.time()
        if plan is not None:
            record.plan = plan
        if new_ranks is not None:
            record.new_ranks = list(new_ranks)
        self._table.bump()

    def renew(self, epoch: int) -> bool:
        """Renews the lease; False if resize `epoch` no longer holds the lock."""
        record = self._state.scale
        if record is None or record.epoch != epoch:
            return False
        record.renewed_at = time.time()
        return True

    def commit(self, epoch: int) -> int:
        """The new set's size, groups and placement become the cluster's; the resize's JOINING
        ranks serve. Returns the new epoch."""
        s = self._state
        record = self._record(epoch)
        plan = record.plan
        assert plan is not None, "a resize commits after its plan"
        self._table.set_size(plan.num_ranks)
        if plan.expert_to_rank is not None:
            s.ep_group_name = plan.group_name
            s.ep_placement = list(plan.expert_to_rank)
        for rank in record.new_ranks:
            if self._table.has_rank(rank):
                info = self._table.rank(rank)
                if info.state == RankState.JOINING:
                    self._table.set_rank(replace(info, state=RankState.READY))
        record.phase = "finishing"
        return self._table.bump()

    def end(self, epoch: int, outcome: str, detail: str) -> int:
        """Releases the lock and records how the resize ended. Returns the new epoch."""
        s = self._state
        record = s.scale
        if record is None or record.epoch != epoch:
            return self._table.epoch
        now = time.time()
        duration_s = now - record.started_at
        event = ScaleEvent(
            epoch, record.from_size, record.to_size, outcome, duration_s, detail, now
        )
        s.scale_history = [*s.scale_history, event][-SCALE_HISTORY:]
        s.scale = None
        return self._table.bump()

    def abort_groups(self, epoch: int) -> None:
        """Ends every join still waiting for resize `epoch`'s new set (it is rolled back)."""
        record = self._record(epoch)
        if record.plan is not None and self._rendezvous is not None:
            self._rendezvous.set(f"{record.plan.group_name}/{ABORT_KEY}", "1")

    def history(self) -> list[ScaleEvent]:
        return list(self._state.scale_history)

    def is_scaling(self) -> bool:
        """Whether a resize holds the scale lock (and its lease runs)."""
        held = self._state.scale
        return held is not None and time.time() - held.renewed_at < SCALE_LEASE_S

    # --- the autoscaler -----------------------------------------------------------------------

    def set_autoscaler(self, record: AutoscalerRecord) -> None:
        """Keeps what the autoscaler shows (saved: a restarted autoscaler reads it back)."""
        self._state.autoscaler = record
        self._table.save()

    def autoscaler(self) -> AutoscalerRecord | None:
        return self._state.autoscaler

    # --- what ranks are told -----------------------------------------------------------------

    def engine_start(self, rank: int) -> EngineStart:
        """The configuration and groups `rank` starts with (KeyError: never planned)."""
        if not self._table.has_rank(rank):
            raise KeyError(f"rank {rank} is not planned in namespace {self._namespace!r}")
        config, group_name = self._table.config, self._state.ep_group_name or self._namespace
        plan = self.joining_plan(rank)
        if plan is None:
            return EngineStart(config, group_name)
        parallel = replace(config.parallel, data_parallel_size=plan.num_ranks)
        config = replace(config, parallel=parallel)
        if plan.expert_to_rank is None:  # a dense rank has no groups to join
            return EngineStart(config, group_name)
        return EngineStart(config, plan.group_name, plan)

    def joins_on_commit(self, rank: int) -> bool:
        """Whether `rank` was started by an expert-parallel resize that has not committed: it
        registers JOINING and serves once the resize commits."""
        plan = self.joining_plan(rank)
        return plan is not None and plan.expert_to_rank is not None

    def joining_plan(self, rank: int) -> ScalePlan | None:
        """The resize that started `rank`, while it is not committed."""
        record = self._state.scale
        if record is None or rank not in record.new_ranks or record.phase == "finishing":
            return None
        return record.plan

    def rendezvous(self, host: str, rank: int, placement: list[int]) -> tuple[str, int]:
        """The rendezvous store's address (see `RegistryActor.ep_rendezvous`); started on the
        first ask, on loopback when `host` is a loopback address."""
        if self._rendezvous is None:
            bind = host if host.startswith("127.") else ray.util.get_node_ip_address()
            self._rendezvous = RendezvousServer(bind)
        if self.joining_plan(rank) is None and self._state.ep_placement != placement:
            self._state.ep_placement = list(placement)
            self._table.save()
        return self._rendezvous.address()

    # --- status ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The `expert_parallel`, `scaling`, `scale_history` and `autoscaler` entries of
        `shoal status`."""
        autoscaler = self._state.autoscaler
        return {
            "expert_parallel": _expert_parallel_status(self._state.ep_placement),
            "scaling": _scaling_status(self._state.scale),
            "scale_history": [msgspec.to_builtins(e) for e in self._state.scale_history],
            "autoscaler": None if autoscaler is None else msgspec.to_builtins(autoscaler),
        }

    def _record(self, epoch: int) -> ScaleRecord:
        record = self._state.scale
        if record is None or record.epoch != epoch:
            raise ScaleInProgressError(f"resize {epoch} does not hold the scale lock")
        return record


def _scaling_status(record: ScaleRecord | None) -> dict[str, Any] | None:
    if record is None:
        return None
    return {
        "epoch": record.epoch,
        "from_size": record.from_size,
        "target_size": record.to_size,
        "phase": record.phase,
        "owner": record.owner,
        "running_s": round(time.time() - record.started_at, 3),
    }


def _expert_parallel_status(placement: list[int] | None) -> dict[str, Any] | None:
    """EP size and each rank's experts, from the expert -> rank table (None: no EP)."""
    if placement is None:
        return None
    size = max(placement) + 1
    experts = [[e for e, r in enumerate(placement) if r == rank] for rank in range(size)]
    return {"size": size, "num_experts": len(placement), "experts_per_rank": experts}
