"""One rank's side of an elastic resize: the plan it is handed, its switch, and what it tells
its clients on `EEP_NOTIFICATION_CALL_ID`.

The cluster (`shoal.cluster.elastic`) drives a resize; every rank of the old set goes through
the same states, and the busy loop is the only thread that switches:

    SERVING ──prepare(plan)──▶ STAGING      (a background thread stages the experts the rank
                                             holds under the new placement; it keeps serving)
    STAGING ──staged + request_switch()──▶ READY   (the rank tells its peers: DP waves agree
                                             on one forward at which every rank switches)
    READY ──the agreed forward──▶ SWITCHING  (old groups destroyed, between two forwards)
    SWITCHING ──joined the new layout's groups, experts committed──▶ COMMITTED → SERVING
    SWITCHING ──the join failed, timed out or was aborted──▶ ROLLED_BACK: the staged experts
                                             are dropped; the rank rejoins the old layout
    SWITCHING ──the rank is not in the new set──▶ LEFT: its requests are released (below)
    STAGING | READY ──cancel()──▶ SERVING    (a scale rolled back before its switch)

A dense rank has no groups and no switch: a leaving one goes SERVING → LEFT when told to.

A rank that LEFT serves no more: every request it held, and every one that reaches it later,
is released to its client, which hands it to a surviving rank with the tokens generated so
far (`EngineCoreRequest.resumed_output_token_ids`). The release is a `ScaleNotice` of kind
SHUTDOWN_COMPLETE sent on the client's own output socket after every output of the rank, so
the client has seen every token before it resubmits. After a resize commits, every rank of
the new set sends RECONFIGURED with the epoch and the new set of ranks; a client that misses
it converges from the registry's membership anyway.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

logger = logging.getLogger(__name__)

# Notice kinds, the first element of each `(kind, notice)` notification.
RECONFIGURED = "reconfigured"
SHUTDOWN_COMPLETE = "shutdown_complete"


class ScaleNotice(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The payload of an elastic notification.

    Attributes:
        epoch: the resize's epoch (the registry's scale counter).
        rank: the rank that sends it.
        ranks: RECONFIGURED: the ranks of the new set.
        request_ids: SHUTDOWN_COMPLETE: this client's requests the rank released.
    """

    epoch: int
    rank: int
    ranks: list[int] = msgspec.field(default_factory=list)
    request_ids: list[str] = msgspec.field(default_factory=list)


class SwitchOutcome(enum.StrEnum):
    COMMITTED = "committed"  # serving in the new set
    ROLLED_BACK = "rolled_back"  # serving in the old set again
    LEFT = "left"  # not in the new set; its requests were released


@dataclass(frozen=True)
class ScalePlan:
    """A resize as each rank is handed it.

    Attributes:
        epoch: the resize's epoch.
        num_ranks: the size of the new set (ranks 0..num_ranks-1; a rank at or above it
            leaves).
        group_name: the rendezvous prefix of the new set's process groups.
        expert_to_rank: the new expert placement (expert parallelism), else None.
        switch_timeout_s: how long a rank waits for the new set to form at the switch.
    """

    epoch: int
    num_ranks: int
    group_name: str
    expert_to_rank: tuple[int, ...] | None = None
    switch_timeout_s: float = 60.0

    def is_leaving(self, rank: int) -> bool:
        return rank >= self.num_ranks


class PendingScale:
    """A rank's resize from `prepare` to its outcome; thread-safe.

    `stage` runs on a thread of its own and returns what the switch commits (the staged
    experts), or None when the rank has nothing to stage (it leaves, or holds no experts).
    A stage that is not committed (the outcome is not COMMITTED, or it was built after the
    outcome) is handed to `discard`, where the workers hold what a stage refers to.
    """

    def __init__(
        self,
        plan: ScalePlan,
        stage: Callable[[], object | None],
        discard: Callable[[object], None] | None = None,
    ) -> None:
        self.plan = plan
        self.staged: object | None = None
        self._discard = discard
        self._staged_lock = threading.Lock()
        self.stage_error: BaseException | None = None
        self._is_staged = threading.Event()
        self._is_switch_requested = threading.Event()
        self._done = threading.Event()
        self.outcome: SwitchOutcome | None = None
        self.detail = ""
        self._thread = threading.Thread(
            target=self._stage, args=(stage,), name=f"shoal-stage-{plan.epoch}", daemon=True
        )
        self._thread.start()

    def _stage(self, stage: Callable[[], object | None]) -> None:
        try:
            staged = stage()
            with self._staged_lock:
                is_late = self._done.is_set()
                if not is_late:
                    self.staged = staged
            if is_late and staged is not None:  # the resize ended while this was built
                self._drop(staged)
        except BaseException as e:  # reported as the outcome when the switch is asked for
            logger.exception("staging for resize %d failed", self.plan.epoch)
            self.stage_error = e
        finally:
            self._is_staged.set()

    def request_switch(self) -> None:
        self._is_switch_requested.set()

    @property
    def is_ready(self) -> bool:
        """Staged without error and asked to switch: the rank may agree on the switch."""
        return (
            self._is_staged.is_set()
            and self._is_switch_requested.is_set()
            and self.stage_error is None
        )

    @property
    def has_failed_staging(self) -> bool:
        return self._is_staged.is_set() and self.stage_error is not None

    def finish(self, outcome: SwitchOutcome, detail: str = "") -> None:
        with self._staged_lock:
            self.outcome, self.detail = outcome, detail
            staged, self.staged = self.staged, None  # a rolled-back stage's tensors go now
            self._done.set()
        if staged is not None and outcome != SwitchOutcome.COMMITTED:
            self._drop(staged)

    def _drop(self, staged: object) -> None:
        if self._discard is None:
            return
        try:
            self._discard(staged)
        except Exception:  # the rank is failing anyway; the outcome stands
            logger.exception("dropping the stage of resize %d failed", self.plan.epoch)

    def wait(self, timeout_s: float) -> tuple[SwitchOutcome, str] | None:
        """The outcome, once the switch is over; None at the timeout."""
        if not self._done.wait(timeout_s):
            return None
        assert self.outcome is not None
        return self.outcome, self.detail
