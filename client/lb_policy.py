"""Load-balancing policies: which engine rank gets the next request.

A policy scores ranks from their `RankLoad` (published stats plus this client's own sends,
kept by the client's `shoal.client.routing.RequestRouter`) and picks the lowest. It never
talks to sockets and does not know where requests are: the client routes aborts itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shoal.client.routing import RankLoad

_NO_LOAD = RankLoad()


@dataclass
class LoadBalancePolicy:
    """Base: `choose` returns the lowest-scored rank, breaking ties by rotating where the
    search starts, so equal ranks take turns. Subclasses implement `score`."""

    _rotation: itertools.count[int] = field(default_factory=itertools.count)

    def choose(self, ranks: Sequence[int], loads: Mapping[int, RankLoad]) -> int:
        """Picks a rank among `ranks` (non-empty, those currently routable)."""
        assert ranks, "no routable engine ranks"
        start = next(self._rotation) % len(ranks)
        rotated = [*ranks[start:], *ranks[:start]]
        # min keeps the first of equal scores
        return min(rotated, key=lambda rank: self.score(rank, loads.get(rank, _NO_LOAD)))

    def score(self, rank: int, load: RankLoad) -> float:
        raise NotImplementedError

    def on_sent(self, rank: int) -> None:
        """Hook: the client sent a request to `rank`."""

    def on_stats(self, rank: int) -> None:
        """Hook: newer stats of `rank` arrived."""


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

    def score(self, rank: int, load: RankLoad) -> float:
        published = 0.0
        if (s := load.stats) is not None:
            published = s.num_pending_prefill_tokens + self.decode_cost * (
                s.num_running_reqs + s.num_waiting_reqs
            )
        return published + sum(e.prompt_tokens + self.decode_cost for e in load.unseen())


@dataclass
class QueueLengthPolicy(LoadBalancePolicy):
    """vLLM's published DP score, for comparison: 4 * waiting + running, in requests.

    The client adds each request it sends to the chosen rank's waiting count and the next
    snapshot replaces the counts, as vLLM's client does.
    """

    _local_waiting: dict[int, int] = field(default_factory=dict)

    def score(self, rank: int, load: RankLoad) -> float:
        waiting = self._local_waiting.get(rank, 0)
        running = 0
        if load.stats is not None:
            waiting += load.stats.num_waiting_reqs
            running = load.stats.num_running_reqs
        return 4 * waiting + running

    def on_stats(self, rank: int) -> None:
        self._local_waiting[rank] = 0

    def on_sent(self, rank: int) -> None:
        self._local_waiting[rank] = self._local_waiting.get(rank, 0) + 1


@dataclass
class RoundRobinPolicy(LoadBalancePolicy):
    """Every rank in turn, ignoring load."""

    def score(self, rank: int, load: RankLoad) -> float:
        return 0.0


POLICIES: dict[str, type[LoadBalancePolicy]] = {
    "least_loaded": LeastLoadedPolicy,
    "queue_length": QueueLengthPolicy,
    "round_robin": RoundRobinPolicy,
}
