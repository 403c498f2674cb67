"""DP waves: the ranks of an expert-parallel cluster step in lockstep while any of them has work.

Every MoE layer is a collective across the ranks, so every rank must run the same number of
forwards: while a wave runs, a rank with nothing scheduled runs a dummy forward (it joins each
layer's exchange with no tokens; its experts still serve the others). Dense models never use
this: their ranks step independently.

State machine of one rank (all ranks go through the same waves, numbered from 0):

    PAUSED(w) ──work arrives here──▶ decides `wave/<w>` = "run" in the group's store ─▶ RUNNING(w)
    PAUSED(w) ──`wave/<w>` is "run" (polled every PAUSED_POLL_S)──▶ RUNNING(w)
    PAUSED(w) ──every rank is READY for resize e (`switch_ready/<e>/<r>`)──▶ decides
                `wave/<w>` = "switch:e"; every rank that reads it switches (below)
    PAUSED(w) ──a newer generation opened (a peer restarted)──▶ groups rebuilt in this
                process; w := the highest wave of any rank ──▶ PAUSED(w)
    RUNNING(w) ──each turn──▶ one forward: the scheduled batch, else a dummy one
    RUNNING(w) ──every SYNC_INTERVAL forwards: all-reduce "any rank unfinished?" = no──▶
                PAUSED(w + 1), on every rank at the same forward
    RUNNING(w) ──the same all-reduce: every rank is READY for resize e──▶ every rank switches
                at that forward, and the wave ends
    SWITCH(e) ──▶ old groups destroyed; the new set's groups joined (`switch`): PAUSED(w + 1)
                in the new set, or, when the join fails, PAUSED(w + 1) in the old set again
    RUNNING(w) ──a collective fails or times out (a peer died or hangs)──▶ the step raises
                (`WaveError` from the wave's own collectives, gloo's or NCCL's error from a
                forward's): the engine fails, its clients are told, its host restarts it

The decision key is written once per wave (compare-and-set: the first writer wins, everyone
follows its value), so a paused rank can never start a wave that a peer is switching away
from, a request that races the end of a wave (it arrives on a rank that has just paused at
w + 1) simply starts wave w + 1, and a late decision for a finished wave is never acted on.
Resizes and their rank states are documented in `shoal.engine.parallel.elastic`. Clients stamp the wave they last saw
published on requests (`EngineCoreRequest.current_wave`); a request stamped with an older wave
than the rank's is one that raced the end of a wave, and is counted (`num_wave_races`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from shoal.engine.parallel.distributed import (
    ABORT_KEY,
    GroupJoinError,
    ProcessGroups,
    Rendezvous,
    current_generation,
)
from shoal.engine.parallel.elastic import ScalePlan, SwitchOutcome
from shoal.engine.parallel.expert_parallel import ExpertWorkers

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

# Forwards between two "any work left?" all-reduces: a wave ends at most this many dummy
# forwards after the last request finished.
SYNC_INTERVAL = 16
# How long a starting rank waits for its peers to form the groups (they load their models).
JOIN_TIMEOUT_S = 300.0
# How often a paused rank looks for a wake or a newer generation in the store.
PAUSED_POLL_S = 0.02


class WaveError(RuntimeError):
    """A collective of the wave failed (a peer died, hung, or the groups were replaced)."""


class DPWave:
    """One rank's side of the waves, and the owner of its process groups.

    The waves run on TP index 0's groups (the only ones in a rank of one worker); every
    worker of the rank joins, binds and leaves its exchange group with them (`experts`).

    Args:
        experts: the rank's sides of the MoE exchange, every worker's (their groups are
            formed and bound here).
        rendezvous: where the ranks meet.
        timeout_s: how long any collective may wait for a peer.
        join_timeout_s: how long forming the groups may wait for the peers.
    """

    def __init__(
        self,
        experts: ExpertWorkers,
        rendezvous: Rendezvous,
        *,
        timeout_s: float,
        join_timeout_s: float,
    ) -> None:
        self.experts = experts
        self.join_timeout_s = join_timeout_s
        self.rendezvous = rendezvous
        self.timeout_s = timeout_s
        self.groups: ProcessGroups | None = None
        self.current_wave = 0
        self.is_running = False
        self.num_dummy_steps = 0
        self.num_wave_races = 0
        self._num_forwards_in_wave = 0
        # The resize every rank agreed to switch to at the end of this turn, if any.
        self.agreed_switch: int | None = None
        self.has_left = False  # not in the set any more (an elastic scale-down)

    @property
    def rank(self) -> int:
        return self.experts.rank

    def join(self, generation: int | None = None, abort_key: str | None = None) -> None:
        """Builds the groups (a fresh generation, or `generation`) and agrees on the wave.

        Args:
            generation: join exactly this one.
            abort_key: a store key that ends the wait for peers once set (a resize rolled
                back while this rank waits to join the new set).

        Raises:
            GroupJoinError: a peer did not join in time, or the join was aborted.
        """
        groups = self.experts.join_groups(
            self.rendezvous,
            self.experts.world_size,
            timeout_s=self.timeout_s,
            join_timeout_s=self.join_timeout_s,
            generation=generation,
            abort_key=abort_key,
        )
        self._adopt(groups, self._agree_on_wave(groups))

    def _agree_on_wave(self, groups: ProcessGroups) -> int:
        """The highest wave of any rank (a restarted one starts at 0); also proves that every
        rank formed the groups."""
        (wave,) = groups.all_reduce_max([self.current_wave])
        return wave

    def _adopt(self, groups: ProcessGroups, wave: int) -> None:
        self.groups = groups
        self.experts.bind_joined()
        self.current_wave = wave
        self.is_running = False
        self.has_left = False

    def leave(self) -> None:
        """Destroys every worker's groups (idempotent); `join` may build new ones."""
        self.experts.leave_groups()
        self.groups = None

    def abandon(self) -> None:
        """At the engine's end: destroys the groups of this process at once, without waiting
        for the other workers (one may be blocked in a collective): peers blocked in a
        collective with this process fail now; the other workers' groups end with their
        processes."""
        if self.groups is not None:
            self.groups.destroy()
            self.groups = None

    def facts(self) -> tuple[int, bool, int]:
        """(current wave, whether it runs, dummy forwards so far), for the stats reports."""
        return self.current_wave, self.is_running, self.num_dummy_steps

    def note_request(self, request_wave: int) -> None:
        """A request arrived stamped with the wave its client last saw published."""
        if request_wave < self.current_wave and not self.is_running:
            self.num_wave_races += 1

    def maybe_start(self, has_local_work: bool, ready_epoch: int = 0) -> None:
        """PAUSED → RUNNING when this rank has work (waking the others) or was woken, or
        PAUSED → SWITCH when every rank is ready for the resize (`agreed_switch`); a
        superseded generation is rejoined first.

        Args:
            has_local_work: this rank has requests to run.
            ready_epoch: the resize this rank is ready to switch to (0: none).

        Raises:
            WaveError: the store is gone (the control plane restarted).
        """
        if self.is_running or self.agreed_switch is not None:
            return
        groups = self._groups()
        try:
            if groups.is_superseded():
                self._rejoin()
                groups = self._groups()
            store, key = groups.store, _decision_key(groups.generation, self.current_wave)
            if has_local_work:
                decision = store.compare_set(key, "", "run").decode()
            elif ready_epoch and self._all_ready(ready_epoch):
                decision = store.compare_set(key, "", f"switch:{ready_epoch}").decode()
            elif store.check([key]):
                decision = store.get(key).decode()
            else:
                return
            if decision == "run":
                self.is_running = True
            elif decision.startswith("switch:"):
                self.agreed_switch = int(decision.partition(":")[2])
        except GroupJoinError as e:
            raise WaveError(f"rank {self.rank}: could not rejoin the groups: {e}") from e
        except Exception as e:  # the store itself is unreachable
            raise WaveError(f"rank {self.rank}: the rendezvous store failed: {e}") from e
        if self.is_running:
            self._num_forwards_in_wave = 0
            logger.debug("rank %d: wave %d running", self.rank, self.current_wave)

    def run_dummy_forward(self) -> None:
        """Joins this turn's forward with no tokens (nothing was scheduled here)."""
        self._collective(self.experts.run_dummy_forward)
        self.num_dummy_steps += 1

    def mark_ready(self, epoch: int) -> None:
        """Tells the peers this rank is ready to switch to resize `epoch`."""
        groups = self._groups()
        groups.store.set(_ready_key(groups.generation, epoch, self.rank), "1")

    def end_turn(self, has_unfinished: bool, ready_epoch: int = 0) -> None:
        """Counts the turn's forward; every SYNC_INTERVAL forwards, pauses if no rank has work,
        and agrees on a switch when every rank is ready for the same resize.

        Raises:
            WaveError: the all-reduce failed or timed out.
        """
        self._num_forwards_in_wave += 1
        if self._num_forwards_in_wave % SYNC_INTERVAL:
            return
        groups = self._groups()
        # max(-ready) is -(the lowest epoch any rank is ready for): 0 unless all are.
        any_unfinished, least_ready = self._collective(
            lambda: groups.all_reduce_max([int(has_unfinished), -ready_epoch])
        )
        if least_ready < 0:
            self.agreed_switch = -least_ready
        if not any_unfinished or self.agreed_switch is not None:
            logger.debug("rank %d: wave %d complete", self.rank, self.current_wave)
            self.current_wave += 1
            self.is_running = False

    def switch(self, plan: ScalePlan, commit: Callable[[], None]) -> tuple[SwitchOutcome, str]:
        """SWITCH: leaves the old set's groups and joins the new set's (between two forwards,
        at the forward every rank agreed on).

        Args:
            plan: the resize.
            commit: called once the new groups have formed and before they are bound (swaps
                in the staged experts: the placement's size becomes the new set's).

        Returns:
            COMMITTED (serving in the new set), ROLLED_BACK (the new set did not form within
            `plan.switch_timeout_s`, or the resize was aborted: serving in the old set again)
            or LEFT (this rank is not in the new set), with a detail for the logs.

        Raises:
            GroupJoinError: rolling back failed too (the old set cannot form either).
        """
        self.agreed_switch = None
        self.leave()
        if plan.is_leaving(self.rank):
            self.has_left = True
            return SwitchOutcome.LEFT, ""
        new_rendezvous = replace(self.rendezvous, group_name=plan.group_name)
        try:
            groups = self.experts.join_groups(
                new_rendezvous,
                plan.num_ranks,
                timeout_s=self.timeout_s,
                join_timeout_s=plan.switch_timeout_s,
                abort_key=ABORT_KEY,
            )
            wave = self._agree_on_wave(groups)
        except (GroupJoinError, RuntimeError) as e:
            self.experts.leave_groups()  # what any worker did join of the new set
            logger.warning(
                "rank %d: resize %d did not form (%s); rolling back", self.rank, plan.epoch, e
            )
            self.join()  # the old set, in its next generation
            return SwitchOutcome.ROLLED_BACK, str(e)
        commit()
        self.rendezvous = new_rendezvous
        self._adopt(groups, wave)
        return SwitchOutcome.COMMITTED, ""

    def rejoin_after_leaving(self) -> None:
        """A rank that LEFT joins the old set again (its resize was rolled back)."""
        self.join()

    def _all_ready(self, epoch: int) -> bool:
        groups = self._groups()
        keys = [_ready_key(groups.generation, epoch, r) for r in range(groups.world_size)]
        return bool(groups.store.check(keys))

    def _collective(self, call: Callable[[], _T]) -> _T:
        try:
            return call()
        except WaveError:
            raise
        except RuntimeError as e:
            raise WaveError(
                f"rank {self.rank}: a collective of wave {self.current_wave} failed: {e}"
            ) from e

    def _rejoin(self) -> None:
        groups = self._groups()
        generation = current_generation(groups.store)
        logger.warning(
            "rank %d: generation %d replaced by %d (a peer restarted); rejoining",
            self.rank,
            groups.generation,
            generation,
        )
        self.leave()
        self.join(generation)

    def _groups(self) -> ProcessGroups:
        assert self.groups is not None, "join first"
        return self.groups


def _ready_key(generation: int, epoch: int, rank: int) -> str:
    """The store key a rank sets once it is ready to switch to resize `epoch`."""
    return f"gen/{generation}/switch_ready/{epoch}/{rank}"


def _decision_key(generation: int, wave: int) -> str:
    """The store key that holds the ranks' decision for `wave`."""
    return f"gen/{generation}/wave/{wave}"


def make_dp_wave(
    experts: ExpertWorkers | None,
    rendezvous: Rendezvous | None,
    *,
    timeout_s: float,
    join: bool,
) -> DPWave | None:
    """A rank's DP waves, its groups joined (if `join`), when it serves an MoE model
    expert-parallel; None for a dense model.

    Raises:
        ValueError: expert parallelism without a rendezvous.
        GroupJoinError: a peer did not join in time.
    """
    if experts is None:
        return None
    if rendezvous is None:
        raise ValueError(
            "expert parallelism needs the ranks' rendezvous: launch the cluster with "
            "shoal.cluster.launch (shoal serve)"
        )
    wave = DPWave(
        experts,
        rendezvous,
        timeout_s=timeout_s,
        join_timeout_s=JOIN_TIMEOUT_S,
    )
    if join:
        wave.join()
    return wave
