"""Load-balancing policies: which engine rank gets the next request.

A policy sees published per-rank stats (from the coordinator) and the client's own traffic
(sends, first outputs, finishes). It never talks to sockets; `DPLBAsyncMPClient` feeds it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.protocol import SchedulerStats


@dataclass
class _InFlight:
    rank: int
    prompt_tokens: int
    sent_at: float  # wall clock, comparable with the engine's snapshot timestamps
    has_output: bool = False


@dataclass
class _Snapshot:
    stats: SchedulerStats
    timestamp: float  # when the engine measured it


@dataclass
class LoadBalancePolicy:
    """Base: the client's own in-flight map, shared by every policy.

    Subclasses implement `score`; `choose` returns the lowest-scored rank, breaking ties by
    rotating where the search starts, so equal ranks take turns.
    """

    in_flight: dict[str, _InFlight] = field(default_factory=dict)
    snapshots: dict[int, _Snapshot] = field(default_factory=dict)
    _rotation: itertools.count = field(default_factory=itertools.count)

    def choose(self, ranks: Sequence[int]) -> int:
        """Picks a rank among `ranks` (non-empty, those currently routable)."""
        assert ranks, "no routable engine ranks"
        start = next(self._rotation) % len(ranks)
        rotated = [*ranks[start:], *ranks[:start]]
        return min(rotated, key=self.score)  # min keeps the first of equal scores

    def score(self, rank: int) -> float:
        raise NotImplementedError

    def on_stats(self, rank: int, stats: SchedulerStats, timestamp: float) -> None:
        """A published snapshot of `rank`, measured by the engine at `timestamp`."""
        previous = self.snapshots.get(rank)
        if previous is None or timestamp >= previous.timestamp:
            self.snapshots[rank] = _Snapshot(stats, timestamp)

    def on_sent(self, request_id: str, rank: int, prompt_tokens: int, now: float) -> None:
        self.in_flight[request_id] = _InFlight(rank, prompt_tokens, now)

    def on_output(self, request_id: str, finished: bool) -> None:
        entry = self.in_flight.get(request_id)
        if entry is None:
            return
        if finished:
            del self.in_flight[request_id]
        else:
            entry.has_output = True

    def on_aborted(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.in_flight.pop(request_id, None)

    def forget_rank(self, rank: int) -> list[str]:
        """Drops a rank (dead or removed); returns the client's requests that were on it."""
        self.snapshots.pop(rank, None)
        lost = [rid for rid, e in self.in_flight.items() if e.rank == rank]
        for request_id in lost:
            del self.in_flight[request_id]
        return lost

    def rank_of(self, request_id: str) -> int | None:
        entry = self.in_flight.get(request_id)
        return entry.rank if entry is not None else None


@dataclass
class LeastLoadedPolicy(LoadBalancePolicy):
    """Least work in tokens, from published stats plus what they cannot have seen yet.

    For rank r with latest snapshot S (measured by the engine at time T):

        published(r) = S.pending_prefill_tokens + decode_cost * (S.running + S.waiting)
        unseen(r)    = sum over this client's requests to r that were sent after T and have
                       produced no output yet of (prompt_tokens + decode_cost)
        score(r)     = published(r) + unseen(r)

    A request counts in `unseen` only until a snapshot newer than its send time arrives (then
    the engine's own numbers include it) or its first output arrives, so a stale snapshot can
    never erase load the client just added, and nothing is counted twice for long. Pending
    prefill tokens dominate time to first token; `decode_cost` converts each running or queued
    sequence into the tokens its decode steps take from every future step's budget.
    """

    decode_cost: int = 16

    def score(self, rank: int) -> float:
        snapshot = self.snapshots.get(rank)
        published, seen_until = 0.0, float("-inf")
        if snapshot is not None:
            s = snapshot.stats
            published = s.num_pending_prefill_tokens + self.decode_cost * (
                s.num_running_reqs + s.num_waiting_reqs
            )
            seen_until = snapshot.timestamp
        unseen = sum(
            e.prompt_tokens + self.decode_cost
            for e in self.in_flight.values()
            if e.rank == rank and not e.has_output and e.sent_at > seen_until
        )
        return published + unseen


@dataclass
class QueueLengthPolicy(LoadBalancePolicy):
    """vLLM's published DP score, for comparison: 4 * waiting + running, in requests.

    The client adds each request it sends to the chosen rank's waiting count and the next
    snapshot replaces the counts, as vLLM's client does.
    """

    _local_waiting: dict[int, int] = field(default_factory=dict)

    def score(self, rank: int) -> float:
        snapshot = self.snapshots.get(rank)
        waiting = self._local_waiting.get(rank, 0)
        running = 0
        if snapshot is not None:
            waiting += snapshot.stats.num_waiting_reqs
            running = snapshot.stats.num_running_reqs
        return 4 * waiting + running

    def on_stats(self, rank: int, stats: SchedulerStats, timestamp: float) -> None:
        super().on_stats(rank, stats, timestamp)
        self._local_waiting[rank] = 0

    def on_sent(self, request_id: str, rank: int, prompt_tokens: int, now: float) -> None:
        super().on_sent(request_id, rank, prompt_tokens, now)
        self._local_waiting[rank] = self._local_waiting.get(rank, 0) + 1


@dataclass
class RoundRobinPolicy(LoadBalancePolicy):
    """Every rank in turn, ignoring load."""

    def score(self, rank: int) -> float:
        return 0.0


POLICIES: dict[str, type[LoadBalancePolicy]] = {
    "least_loaded": LeastLoadedPolicy,
    "queue_length": QueueLengthPolicy,
    "round_robin": RoundRobinPolicy,
}
