"""Load-balancing policies: which engine rank gets the next request.

A policy sees published per-rank stats (from the coordinator) and the client's own traffic
(sends, first outputs, finishes). It never talks to sockets; `DPLBAsyncMPClient` feeds it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from shoal.engine.protocol import SchedulerStats


@dataclass
class _InFlight:
    rank: int
    prompt_tokens: int
    seq: int  # this client's send count to `rank` before this request
    has_output: bool = False


@dataclass
class _Snapshot:
    stats: SchedulerStats
    requests_seen: int  # this client's requests to the rank that the stats include


@dataclass
class LoadBalancePolicy:
    """Base: the client's own in-flight map and latest view of each rank, shared by every policy.

    Subclasses implement `score`; `choose` returns the lowest-scored rank, breaking ties by
    rotating where the search starts, so equal ranks take turns.
    """

    in_flight: dict[str, _InFlight] = field(default_factory=dict)
    snapshots: dict[int, _Snapshot] = field(default_factory=dict)
    _num_sent: dict[int, int] = field(default_factory=dict)
    _rotation: itertools.count[int] = field(default_factory=itertools.count)

    def choose(self, ranks: Sequence[int]) -> int:
        """Picks a rank among `ranks` (non-empty, those currently routable)."""
        assert ranks, "no routable engine ranks"
        start = next(self._rotation) % len(ranks)
        rotated = [*ranks[start:], *ranks[:start]]
        return min(rotated, key=self.score)  # min keeps the first of equal scores

    def score(self, rank: int) -> float:
        raise NotImplementedError

    def on_stats(self, rank: int, stats: SchedulerStats, requests_seen: int) -> None:
        """A rank's stats, measured after it had taken in `requests_seen` of this client's sends.

        Snapshots can arrive out of order (straight from the engine and through the
        coordinator); an older one (fewer steps, or as many steps and fewer requests seen)
        never replaces a newer one.
        """
        previous = self.snapshots.get(rank)
        key = (stats.step_counter, requests_seen)
        if previous is None or key >= (previous.stats.step_counter, previous.requests_seen):
            self.snapshots[rank] = _Snapshot(stats, requests_seen)

    def on_sent(self, request_id: str, rank: int, prompt_tokens: int) -> None:
        seq = self._num_sent.get(rank, 0)
        self._num_sent[rank] = seq + 1
        self.in_flight[request_id] = _InFlight(rank, prompt_tokens, seq)

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
        """Drops a rank (dead or removed); returns the client's requests that were on it.

        A rank that comes back is a new engine: its count of this client's sends starts over.
        """
        self.snapshots.pop(rank, None)
        self._num_sent.pop(rank, None)
        lost = [rid for rid, e in self.in_flight.items() if e.rank == rank]
        for request_id in lost:
            del self.in_flight[request_id]
        return lost

    def rank_of(self, request_id: str) -> int | None:
        entry = self.in_flight.get(request_id)
        return entry.rank if entry is not None else None


@dataclass
class LeastLoadedPolicy(LoadBalancePolicy):
    """Least work in tokens, from a rank's stats plus this client's sends they do not include.

    For rank r with latest stats S, measured after r had taken in `seen` of this client's
    requests:

        published(r) = S.pending_prefill_tokens + decode_cost * (S.running + S.waiting)
        unseen(r)    = sum over this client's requests to r with send number >= seen that
                       have produced no output yet of (prompt_tokens + decode_cost)
        score(r)     = published(r) + unseen(r)

    The engine counts each client's ADDs and reports the count with its stats, so which sends
    a snapshot includes is known exactly: a stale snapshot can never erase load the client just
    added, and nothing is counted twice. Pending prefill tokens dominate time to first token;
    `decode_cost` converts each running or queued sequence into the tokens its decode steps take
    from every future step's budget.
    """

    decode_cost: int = 16

    def score(self, rank: int) -> float:
        snapshot = self.snapshots.get(rank)
        published, seen = 0.0, 0
        if snapshot is not None:
            s = snapshot.stats
            published = s.num_pending_prefill_tokens + self.decode_cost * (
                s.num_running_reqs + s.num_waiting_reqs
            )
            seen = snapshot.requests_seen
        unseen = sum(
            e.prompt_tokens + self.decode_cost
            for e in self.in_flight.values()
            if e.rank == rank and e.seq >= seen and not e.has_output
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

    def on_stats(self, rank: int, stats: SchedulerStats, requests_seen: int) -> None:
        super().on_stats(rank, stats, requests_seen)
        self._local_waiting[rank] = 0

    def on_sent(self, request_id: str, rank: int, prompt_tokens: int) -> None:
        super().on_sent(request_id, rank, prompt_tokens)
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
