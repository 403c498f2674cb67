"""`ElasticRank`: what an `EngineCoreProc` does in a resize (the states are in
`shoal.engine.parallel.elastic`).

Calls come from two sides. The cluster's control calls (`prepare`, `request_switch`,
`leave`, `cancel`, `wait`) arrive on Ray threads: they only record what was asked, under a
lock, and wake the busy loop. The busy loop (`ready_epoch`, `after_turn`, `poll`,
`release_new_request`) is the only thread that switches groups, commits experts or
releases requests, always between two steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection

from shoal.engine.core.rank_engine import RankEngine
from shoal.engine.core.request_ids import unscoped
from shoal.engine.parallel.distributed import ABORT_KEY
from shoal.engine.parallel.dp_wave import DPWave
from shoal.engine.parallel.elastic import (
    SHUTDOWN_COMPLETE,
    PendingScale,
    ScaleNotice,
    ScalePlan,
    SwitchOutcome,
)
from shoal.engine.parallel.expert_parallel import ExpertPlacement, StagedExperts
from shoal.engine.protocol import EngineCoreRequest

logger = logging.getLogger(__name__)

_EPOCHS_KEPT = 8
# notify(client_index, kind, notice): one elastic notification to one client.
Notify = Callable[[int, str, ScaleNotice], None]


class ScaleRefusedError(RuntimeError):
    """A resize this rank cannot take now (another one is in progress here)."""


class ElasticRank:
    """One rank's resizes.

    Args:
        core: the rank's engine core.
        wave: its DP waves (expert parallelism), else None (a dense rank).
        model_path: where the staged experts are read from.
        notify: sends one notification to one client.
        drop_outputs: drops a client's outputs of these scoped request ids from the next
            step (released requests must not finish on this rank).
        attached_clients: the clients attached now.
        wake: wakes the busy loop.
        joining: the resize this rank was started for (it joins the new set's groups when
            its busy loop starts: `join_new_set`).
    """

    def __init__(
        self,
        core: RankEngine,
        wave: DPWave | None,
        *,
        model_path: str,
        notify: Notify,
        drop_outputs: Callable[[int, set[str]], None],
        attached_clients: Callable[[], Collection[int]],
        wake: Callable[[], None],
        joining: ScalePlan | None = None,
    ) -> None:
        self.core = core
        self.wave = wave
        self.model_path = model_path
        self._notify = notify
        self._drop_outputs = drop_outputs
        self._attached_clients = attached_clients
        self._wake = wake
        self.rank = core.engine_index
        self._lock = threading.Lock()
        self._pending: PendingScale | None = None
        # Every resize this rank took part in lately, by epoch, for `wait`.
        self._by_epoch: dict[int, PendingScale] = {}
        self._marked_ready: int = 0
        self._leave_epoch: int | None = None  # a dense rank asked to leave
        self._rejoin_requested = False
        self.has_left = False
        self.left_epoch = 0
        # A joining rank's first join, tracked from the start so `wait` can be asked at once.
        self._joined = self._track(PendingScale(joining, lambda: None)) if joining else None

    # --- control calls (any thread) ----------------------------------------------------------

    def prepare(self, plan: ScalePlan) -> None:
        """SERVING → STAGING: starts staging this rank's experts for `plan`.

        Raises:
            ScaleRefusedError: another resize is in progress on this rank.
        """
        with self._lock:
            pending = self._pending
            if pending is not None and pending.outcome is None:
                if pending.plan.epoch == plan.epoch:
                    return
                raise ScaleRefusedError(
                    f"rank {self.rank} is in resize {pending.plan.epoch} already"
                )
            self._pending = self._track(
                PendingScale(plan, lambda: self._stage(plan), discard=self._discard_stage)
            )

    def request_switch(self, epoch: int) -> None:
        """STAGING → READY once staged: the rank may agree on the switch."""
        pending = self._pending_for(epoch)
        pending.request_switch()
        self._wake()

    def leave(self, epoch: int) -> None:
        """A dense rank leaves the set: at the busy loop's next turn its requests are
        released (SERVING → LEFT)."""
        with self._lock:
            self._leave_epoch = epoch
            self._track(PendingScale(ScalePlan(epoch, 0, ""), lambda: None))
        self._wake()

    def cancel(self, epoch: int) -> None:
        """The resize is rolled back: a rank that has not switched drops its stage; one that
        LEFT joins the old set again (at the busy loop's next turn)."""
        with self._lock:
            pending = self._pending
            if pending is not None and pending.plan.epoch == epoch:
                if pending.outcome is None:
                    pending.finish(SwitchOutcome.ROLLED_BACK, "cancelled")
                    self._pending = None
                elif pending.outcome == SwitchOutcome.LEFT:
                    self._rejoin_requested = True
        self._wake()

    def wait(self, epoch: int, timeout_s: float) -> tuple[str, str] | None:
        """This rank's outcome of resize `epoch` (SwitchOutcome value, detail), or None if the
        switch has not happened within `timeout_s`."""
        with self._lock:
            pending = self._by_epoch.get(epoch)
        if pending is None:
            raise ScaleRefusedError(f"rank {self.rank} has no part in resize {epoch}")
        result = pending.wait(timeout_s)
        return None if result is None else (result[0].value, result[1])

    def _track(self, pending: PendingScale) -> PendingScale:
        """Called with the lock held."""
        self._by_epoch[pending.plan.epoch] = pending
        for epoch in sorted(self._by_epoch)[:-_EPOCHS_KEPT]:
            del self._by_epoch[epoch]
        return pending

    def _pending_for(self, epoch: int) -> PendingScale:
        with self._lock:
            pending = self._pending
        if pending is None or pending.plan.epoch != epoch:
            raise ScaleRefusedError(f"rank {self.rank} has not prepared resize {epoch}")
        return pending

    def _stage(self, plan: ScalePlan) -> StagedExperts | None:
        wave = self.wave
        if wave is None or plan.is_leaving(self.rank) or plan.expert_to_rank is None:
            return None
        placement = ExpertPlacement(plan.expert_to_rank, plan.num_ranks)
        start = time.monotonic()
        staged = wave.experts.stage(placement, self.rank, self.model_path)
        logger.info(
            "rank %d staged experts %s for resize %d in %.2f s",
            self.rank,
            placement.experts_of(self.rank),
            plan.epoch,
            time.monotonic() - start,
        )
        return staged

    def _discard_stage(self, staged: object) -> None:
        """Drops a stage that will not be committed, in every worker that holds part of it."""
        if self.wave is not None and isinstance(staged, StagedExperts):
            self.wave.experts.discard(staged)

    # --- the busy loop -------------------------------------------------------------------------

    def join_new_set(self) -> None:
        """A joining rank's first join: the new set's groups, when the old ranks switch.

        Raises:
            GroupJoinError: the set did not form (the resize is rolled back; this rank is
                removed).
        """
        joined = self._joined
        assert self.wave is not None and joined is not None, "only a joining EP rank joins"
        try:
            self.wave.join(abort_key=ABORT_KEY)
        except BaseException as e:
            joined.finish(SwitchOutcome.ROLLED_BACK, str(e))
            raise
        joined.finish(SwitchOutcome.COMMITTED)

    def ready_epoch(self) -> int:
        """The resize this rank is READY to switch to (0: none); tells the peers once."""
        pending = self._pending
        if pending is None or pending.outcome is not None or not pending.is_ready:
            return 0
        epoch = pending.plan.epoch
        if self._marked_ready != epoch and self.wave is not None:
            self.wave.mark_ready(epoch)
            self._marked_ready = epoch
        return epoch

    def poll(self) -> None:
        """Once per busy-loop turn: a dense rank's leave, a rejoin after a rollback, a failed
        stage."""
        if self._leave_epoch is None and not self._rejoin_requested and self._pending is None:
            return  # the common turn: no resize here (a stale read is caught next turn)
        with self._lock:
            leave_epoch, self._leave_epoch = self._leave_epoch, None
            rejoin, self._rejoin_requested = self._rejoin_requested, False
            pending = self._pending
        if leave_epoch is not None and not self.has_left:
            self._release_all(leave_epoch)
        if rejoin and self.wave is not None and self.has_left:
            logger.info("rank %d: resize rolled back; joining the old set again", self.rank)
            self.wave.rejoin_after_leaving()
            self.has_left = False
            with self._lock:
                self._pending = None
        if pending is not None and pending.outcome is None and pending.has_failed_staging:
            pending.finish(SwitchOutcome.ROLLED_BACK, f"staging failed: {pending.stage_error}")
            with self._lock:
                self._pending = None

    def after_turn(self) -> None:
        """SWITCH, when the ranks agreed on one this turn."""
        wave = self.wave
        if wave is None or wave.agreed_switch is None:
            return
        pending = self._pending
        if pending is None or pending.plan.epoch != wave.agreed_switch:
            # Every rank agreed on a resize this one is READY for: it cannot be missing.
            raise RuntimeError(
                f"rank {self.rank}: the ranks agreed to switch to resize {wave.agreed_switch}, "
                "which this rank has not prepared"
            )
        plan, start = pending.plan, time.monotonic()
        staged = pending.staged
        experts = wave.experts

        def commit() -> None:
            if isinstance(staged, StagedExperts):
                experts.commit(staged)

        outcome, detail = wave.switch(plan, commit)
        if outcome == SwitchOutcome.LEFT:
            self._release_all(plan.epoch)
        logger.info(
            "rank %d: resize %d %s in %.2f s %s",
            self.rank,
            plan.epoch,
            outcome.value,
            time.monotonic() - start,
            detail,
        )
        pending.finish(outcome, detail)
        if outcome != SwitchOutcome.LEFT:
            with self._lock:
                self._pending = None

    def release_new_request(self, request: EngineCoreRequest) -> bool:
        """A request reaching a rank that LEFT is released at once (its client resubmits it
        elsewhere). Returns whether it was."""
        if not self.has_left:
            return False
        own_id = unscoped(request.client_index, request.request_id)
        notice = ScaleNotice(self.left_epoch, self.rank, request_ids=[own_id])
        self._notify(request.client_index, SHUTDOWN_COMPLETE, notice)
        return True

    def _release_all(self, epoch: int) -> None:
        """LEFT: every request here is aborted without an output and released to its client."""
        self.has_left, self.left_epoch = True, epoch
        num_released = 0
        for client_index in sorted(self._attached_clients()):
            scoped = self.core.request_ids_of_client(client_index)
            if scoped:
                self.core.abort_requests(scoped)
                self._drop_outputs(client_index, set(scoped))
            own_ids = [unscoped(client_index, r) for r in scoped]
            notice = ScaleNotice(epoch, self.rank, request_ids=own_ids)
            self._notify(client_index, SHUTDOWN_COMPLETE, notice)
            num_released += len(scoped)
        with self._lock:
            left = self._by_epoch.get(epoch)
        if left is not None and left.outcome is None:  # a dense rank's leave
            left.finish(SwitchOutcome.LEFT)
        logger.info(
            "rank %d left the set in resize %d; released %d requests",
            self.rank,
            epoch,
            num_released,
        )
