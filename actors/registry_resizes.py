"""The registry's resize methods: the scale lock, each resize's phase and commit, and what a
starting rank is told about the set it joins. Mixed into `RegistryActor`, whose event loop
runs them like its other methods (no locks needed); `shoal.cluster.elastic` calls them."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import ray

from shoal.actors.membership import RankInfo, RankState
from shoal.actors.registry_state import RegistryState
from shoal.actors.rendezvous import RendezvousServer
from shoal.actors.scale_state import (
    SCALE_HISTORY,
    SCALE_LEASE_S,
    EngineStart,
    ScaleEvent,
    ScaleInProgressError,
    ScaleRecord,
)
from shoal.engine.parallel.distributed import ABORT_KEY
from shoal.engine.parallel.elastic import ScalePlan

logger = logging.getLogger(__name__)


class ResizeMethods:
    """Resize methods of `RegistryActor` (which provides the state and `_bump`)."""

    namespace: str
    _state: RegistryState
    _rendezvous: RendezvousServer | None

    def _bump(self) -> int:
        raise NotImplementedError  # RegistryActor's

    def _save(self) -> None:
        raise NotImplementedError  # RegistryActor's

    def _set_rank(self, info: RankInfo) -> None:
        raise NotImplementedError  # RegistryActor's

    @ray.method
    async def set_launch_options(self, options: dict[str, Any]) -> None:
        """Records how the launch started its ranks (`shoal.cluster.launch.LaunchOptions`)."""
        self._state.launch_options = dict(options)
        self._save()

    @ray.method
    async def launch_options(self) -> dict[str, Any]:
        return dict(self._state.launch_options)

    @ray.method
    async def begin_scale(self, owner: str, to_size: int) -> tuple[int, int]:
        """Takes the scale lock for a resize to `to_size` ranks.

        Returns:
            The resize's epoch and the current size.

        Raises:
            ScaleInProgressError: another scale holds the lock (and its lease runs).
        """
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
        from_size = s.config.parallel.data_parallel_size
        s.scale = ScaleRecord(s.scale_epoch, owner, from_size, to_size, "starting", now, now)
        self._bump()
        return s.scale_epoch, from_size

    @ray.method
    async def set_scale_phase(
        self,
        epoch: int,
        phase: str,
        plan: ScalePlan | None,
        new_ranks: list[int] | None,
    ) -> None:
        """Records the phase of the scale holding the lock (which renews its lease)."""
        record = self._scale_record(epoch)
        record.phase, record.renewed_at = phase, time.time()
        if plan is not None:
            record.plan = plan
        if new_ranks is not None:
            record.new_ranks = list(new_ranks)
        self._bump()

    @ray.method
    async def renew_scale(self, epoch: int) -> bool:
        """Renews the lease of the scale holding the lock; False if it no longer holds it."""
        record = self._state.scale
        if record is None or record.epoch != epoch:
            return False
        record.renewed_at = time.time()
        return True

    @ray.method
    async def commit_scale(self, epoch: int) -> int:
        """The resize is done: the cluster's size and groups are the new set's, its new ranks
        serve. Returns the new epoch."""
        s = self._state
        record = self._scale_record(epoch)
        plan = record.plan
        assert plan is not None, "a resize commits after its plan"
        s.config = replace(
            s.config, parallel=replace(s.config.parallel, data_parallel_size=plan.num_ranks)
        )
        if plan.expert_to_rank is not None:
            s.ep_group_name = plan.group_name
            s.ep_placement = list(plan.expert_to_rank)
        for rank in record.new_ranks:
            info = s.ranks.get(rank)
            if info is not None and info.state == RankState.JOINING:
                self._set_rank(replace(info, state=RankState.READY))
        record.phase = "finishing"
        return self._bump()

    @ray.method
    async def end_scale(self, epoch: int, outcome: str, detail: str) -> int:
        """Releases the scale lock and records how the scale ended. Returns the new epoch."""
        s = self._state
        record = s.scale
        if record is None or record.epoch != epoch:
            return s.epoch
        now = time.time()
        event = ScaleEvent(
            epoch,
            record.from_size,
            record.to_size,
            outcome,
            now - record.started_at,
            detail,
            now,
        )
        s.scale_history = [*s.scale_history, event][-SCALE_HISTORY:]
        s.scale = None
        return self._bump()

    @ray.method
    async def abort_scale_groups(self, epoch: int) -> None:
        """Ends every join still waiting for resize `epoch`'s new set (it is rolled back)."""
        record = self._scale_record(epoch)
        if record.plan is not None and self._rendezvous is not None:
            self._rendezvous.set(f"{record.plan.group_name}/{ABORT_KEY}", "1")

    @ray.method
    async def set_rank_ready(self, rank: int) -> int:
        """A LEAVING rank serves again (its resize was rolled back). Returns the new epoch."""
        info = self._state.ranks[rank]
        if info.state == RankState.LEAVING:
            self._set_rank(replace(info, state=RankState.READY))
        return self._bump()

    @ray.method
    async def engine_start(self, rank: int) -> EngineStart:
        """The configuration and groups a starting rank serves with (see `EngineStart`).

        Raises:
            KeyError: if the rank was never planned (or has been removed).
        """
        s = self._state
        if rank not in s.ranks:
            raise KeyError(f"rank {rank} is not planned in namespace {self.namespace!r}")
        plan = self._joining_plan(rank)
        if plan is None:
            return EngineStart(s.config, s.ep_group_name or self.namespace)
        parallel = replace(s.config.parallel, data_parallel_size=plan.num_ranks)
        config = replace(s.config, parallel=parallel)
        if plan.expert_to_rank is None:  # a dense rank has no groups to join
            return EngineStart(config, s.ep_group_name or self.namespace)
        return EngineStart(config, plan.group_name, plan)

    @ray.method
    async def scale_history(self) -> list[ScaleEvent]:
        return list(self._state.scale_history)

    def _joining_plan(self, rank: int) -> ScalePlan | None:
        """The resize that started `rank`, while it is not committed."""
        record = self._state.scale
        if record is None or rank not in record.new_ranks or record.phase == "finishing":
            return None
        return record.plan

    def _scale_record(self, epoch: int) -> ScaleRecord:
        record = self._state.scale
        if record is None or record.epoch != epoch:
            raise ScaleInProgressError(f"resize {epoch} does not hold the scale lock")
        return record


def scaling_status(record: ScaleRecord | None) -> dict[str, Any] | None:
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
