"""DP waves: the ranks of an expert-parallel cluster step in lockstep while any of them has work.

Every MoE layer is a collective across the ranks, so every rank must run the same number of
forwards: while a wave runs, a rank with nothing scheduled runs a dummy forward (it joins each
layer's exchange with no tokens; its experts still serve the others). Dense models never use
this: their ranks step independently.

State machine of one rank (all ranks go through the same waves, numbered from 0):

    PAUSED(w) ──work arrives here──▶ sets `start_dp_wave/<w>` in the group's store ─▶ RUNNING(w)
    PAUSED(w) ──`start_dp_wave/<w>` is set (polled every PAUSED_POLL_S)──▶ RUNNING(w)
    PAUSED(w) ──a newer generation opened (a peer restarted)──▶ groups rebuilt in this
                process; w := the highest wave of any rank ──▶ PAUSED(w)
    RUNNING(w) ──each turn──▶ one forward: the scheduled batch, else a dummy one
    RUNNING(w) ──every SYNC_INTERVAL forwards: all-reduce "any rank unfinished?" = no──▶
                PAUSED(w + 1), on every rank at the same forward
    RUNNING(w) ──a collective fails or times out (a peer died or hangs)──▶ the step raises
                (`WaveError` from the wave's own collectives, gloo's or NCCL's error from a
                forward's): the engine fails, its clients are told, its host restarts it

The wake key is idempotent and per wave, so a request that races the end of a wave (it
arrives on a rank that has just paused at w + 1) simply starts wave w + 1, and a late or
repeated wake for a finished wave is never acted on. Clients stamp the wave they last saw
published on requests (`EngineCoreRequest.current_wave`); a request stamped with an older wave
than the rank's is one that raced the end of a wave, and is counted (`num_wave_races`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from shoal.engine.distributed import (
    GroupJoinError,
    ProcessGroups,
    Rendezvous,
    current_generation,
)
from shoal.engine.expert_parallel import ExpertParallel

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

    Args:
        expert_parallel: the rank's MoE exchange (its groups are bound here).
        rendezvous: where the ranks meet.
        device: the device of the MoE exchange.
        timeout_s: how long any collective may wait for a peer.
        join_timeout_s: how long forming the groups may wait for the peers.
    """

    def __init__(
        self,
        expert_parallel: ExpertParallel,
        rendezvous: Rendezvous,
        *,
        device: torch.device,
        timeout_s: float,
        join_timeout_s: float,
    ) -> None:
        self.expert_parallel = expert_parallel
        self.join_timeout_s = join_timeout_s
        self.rendezvous = rendezvous
        self.device = device
        self.timeout_s = timeout_s
        self.groups: ProcessGroups | None = None
        self.current_wave = 0
        self.is_running = False
        self.num_dummy_steps = 0
        self.num_wave_races = 0
        self._num_forwards_in_wave = 0

    @property
    def rank(self) -> int:
        return self.expert_parallel.rank

    def join(self, generation: int | None = None) -> None:
        """Builds the groups (a fresh generation, or `generation`) and agrees on the wave.

        Raises:
            GroupJoinError: a peer did not join in time.
        """
        self.groups = ProcessGroups.join(
            self.rendezvous,
            self.rank,
            self.expert_parallel.world_size,
            device=self.device,
            timeout_s=self.timeout_s,
            join_timeout_s=self.join_timeout_s,
            generation=generation,
        )
        self.expert_parallel.bind(self.groups)
        # A restarted rank starts at wave 0: everyone continues from the highest wave.
        (self.current_wave,) = self.groups.all_reduce_max([self.current_wave])
        self.is_running = False

    def leave(self) -> None:
        """Destroys the groups (idempotent); `join` may build new ones in this process."""
        self.expert_parallel.unbind()
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

    def maybe_start(self, has_local_work: bool) -> None:
        """PAUSED → RUNNING when this rank has work (waking the others) or was woken; a
        superseded generation is rejoined first.

        Raises:
            WaveError: the store is gone (the control plane restarted).
        """
        if self.is_running:
            return
        groups = self._groups()
        try:
            if groups.is_superseded():
                self._rejoin()
                groups = self._groups()
            key = self._wake_key(self.current_wave)
            if has_local_work:
                groups.store.set(key, "1")
                self.is_running = True
            elif groups.store.check([key]):
                self.is_running = True
        except GroupJoinError as e:
            raise WaveError(f"rank {self.rank}: could not rejoin the groups: {e}") from e
        except Exception as e:  # the store itself is unreachable
            raise WaveError(f"rank {self.rank}: the rendezvous store failed: {e}") from e
        if self.is_running:
            self._num_forwards_in_wave = 0
            logger.debug("rank %d: wave %d running", self.rank, self.current_wave)

    def run_dummy_forward(self) -> None:
        """Joins this turn's forward with no tokens (nothing was scheduled here)."""
        self._collective(self.expert_parallel.run_dummy_forward)
        self.num_dummy_steps += 1

    def end_turn(self, has_unfinished: bool) -> None:
        """Counts the turn's forward; every SYNC_INTERVAL forwards, pauses if no rank has work.

        Raises:
            WaveError: the all-reduce failed or timed out.
        """
        self._num_forwards_in_wave += 1
        if self._num_forwards_in_wave % SYNC_INTERVAL:
            return
        groups = self._groups()
        (any_unfinished,) = self._collective(lambda: groups.all_reduce_max([int(has_unfinished)]))
        if not any_unfinished:
            logger.debug("rank %d: wave %d complete", self.rank, self.current_wave)
            self.current_wave += 1
            self.is_running = False

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

    def _wake_key(self, wave: int) -> str:
        return f"gen/{self._groups().generation}/start_dp_wave/{wave}"
