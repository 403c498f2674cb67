"""Routing policies: which engine rank gets the next request.

A policy sees the request (`RouteRequest`: its prompt length and how much of it each rank holds
cached) and one `RankView` per routable rank (load as this client's `RequestRouter` keeps it,
cached prefix length from its `KVCacheIndex`), and returns a `RoutingDecision`. Every view
costs O(1) to build, so a choice costs O(ranks + prompt blocks) whatever is in flight. A policy
never talks to sockets and does not know where requests are: the client routes aborts itself.

Ties never rotate: the rank holding the longer cached prefix wins, then the one with fewer
cached blocks (more room for a new prefix), then the lowest rank — the same answer in every
front end for the same view.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from shoal.client.routing.router import RankLoad

# Why a rank was chosen; the label of `shoal:routing_decisions_total{reason}` ("lora": it
# holds the request's LoRA adapter, which some other rank would have had to load).
REASONS = ("cache", "load", "session", "only-rank", "lora")


@dataclass(frozen=True)
class RankView:
    """One routable rank as a policy sees it.

    Attributes:
        rank: the rank's index.
        load: this client's view of its load (published stats + unseen sends).
        num_cached_tokens: prompt tokens of this request the rank holds in its prefix cache.
        num_cached_blocks: blocks the rank's prefix cache holds in all.
        has_lora: the rank holds the request's LoRA adapter (`RankLoad.holds_lora`); False
            for a request without one.
        is_lora_full: every LoRA slot of the rank is taken (`RankLoad.is_lora_full`).
    """

    rank: int
    load: RankLoad
    num_cached_tokens: int = 0
    num_cached_blocks: int = 0
    has_lora: bool = False
    is_lora_full: bool = False


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows of the request being routed.

    Attributes:
        num_prompt_tokens: prompt (and resumed output) tokens to prefill.
        session_id: the caller's session, for `SessionAffinityPolicy`; None: no affinity.
        lora_name: the LoRA adapter it runs with, or None.
    """

    num_prompt_tokens: int
    session_id: str | None = None
    lora_name: str | None = None


@dataclass(frozen=True)
class RoutingDecision:
    rank: int
    reason: str  # one of REASONS
    predicted_hit_tokens: int = 0  # the chosen rank's cached prefix of the prompt


def load_tokens(load: RankLoad, decode_cost: int) -> float:
    """A rank's pending work in tokens, from its stats plus this client's unseen sends:

        stats.pending_prefill_tokens + decode_cost * (stats.running + stats.waiting)
        + unseen_prompt_tokens + decode_cost * num_unseen

    The engine counts each client's ADDs and reports the count with its stats, so which sends
    a snapshot includes is known exactly (`RankLoad`): a stale snapshot never erases load the
    client just added, and nothing is counted twice. `decode_cost` converts each running or
    queued sequence into the tokens its decode steps take from every future step's budget.
    """
    total = load.unseen_prompt_tokens + decode_cost * load.num_unseen
    if (s := load.stats) is not None:
        total += s.num_pending_prefill_tokens + decode_cost * (
            s.num_running_reqs + s.num_waiting_reqs
        )
    return total


def _tie_key(view: RankView) -> tuple[int, int, int]:
    return (-view.num_cached_tokens, view.num_cached_blocks, view.rank)


@dataclass
class LoadBalancePolicy:
    """Base: `choose` returns the lowest-`score`d view, ties broken as the module says."""

    def choose(self, request: RouteRequest, views: Sequence[RankView]) -> RoutingDecision:
        """Picks one of `views` (non-empty: the routable ranks)."""
        assert views, "no routable engine ranks"
        best = min(views, key=lambda v: (self.score(request, v), *_tie_key(v)))
        if len(views) == 1:
            reason = "only-rank"
        else:
            reason = self.reason(request, best, views)
        return RoutingDecision(best.rank, reason, best.num_cached_tokens)

    def score(self, request: RouteRequest, view: RankView) -> float:
        raise NotImplementedError

    def reason(self, request: RouteRequest, best: RankView, views: Sequence[RankView]) -> str:
        return "load"

    def on_sent(self, rank: int) -> None:
        """Hook: the client sent a request to `rank`."""

    def on_stats(self, rank: int) -> None:
        """Hook: newer stats of `rank` arrived."""


@dataclass
class CacheAwarePolicy(LoadBalancePolicy):
    """Cheapest estimated work, counting the prefill a rank's prefix cache saves.

    For rank r holding the first `cached(r)` tokens of the prompt:

        cost(r) = (prompt_tokens - cached(r)) + load_weight * load_tokens(r)
                  + lora_load_cost, if the request's LoRA adapter is not held by r
                    (twice that if r's LoRA slots are full: the load evicts an adapter)

    with `load_tokens` as in `LeastLoadedPolicy`. The lowest cost wins: a rank with the
    prefix wins while its extra load is smaller than the prefill it saves, so a hot rank
    does not take every request that shares its prefix. `load_weight` sets the balance:
    higher spreads load more, lower follows the cache more; 0 is cache only. The default, 1
    (a token of pending load weighs as much as a token of prefill), kept the most hits with
    the best tail in `bench/prefix_routing.py` (2 and 4 moved documents sooner and lost hits;
    docs/performance.md). `lora_load_cost` (tokens) gathers an adapter's requests on the ranks
    that hold it, while their extra load stays below it; 0 ignores adapters.
    """

    decode_cost: int = 16
    load_weight: float = 1.0
    lora_load_cost: float = 512.0

    def score(self, request: RouteRequest, view: RankView) -> float:
        uncached = max(0, request.num_prompt_tokens - view.num_cached_tokens)
        lora = 0.0
        if request.lora_name and not view.has_lora:
            lora = self.lora_load_cost * (2 if view.is_lora_full else 1)
        return uncached + self.load_weight * load_tokens(view.load, self.decode_cost) + lora

    def reason(self, request: RouteRequest, best: RankView, views: Sequence[RankView]) -> str:
        if self.lora_load_cost and best.has_lora and not all(v.has_lora for v in views):
            return "lora"
        least_cached = min(v.num_cached_tokens for v in views)
        return "cache" if best.num_cached_tokens > least_cached else "load"


@dataclass
class LeastLoadedPolicy(LoadBalancePolicy):
    """Least pending work in tokens (`load_tokens`); the cache only breaks ties."""

    decode_cost: int = 16

    def score(self, request: RouteRequest, view: RankView) -> float:
        return load_tokens(view.load, self.decode_cost)


@dataclass
class QueueLengthPolicy(LoadBalancePolicy):
    """vLLM's published DP score, for comparison: 4 * waiting + running, in requests.

    The client adds each request it sends to the chosen rank's waiting count and the next
    snapshot replaces the counts, as vLLM's client does.
    """

    _local_waiting: dict[int, int] = field(default_factory=dict)

    def score(self, request: RouteRequest, view: RankView) -> float:
        waiting = self._local_waiting.get(view.rank, 0)
        running = 0
        if (stats := view.load.stats) is not None:
            waiting += stats.num_waiting_reqs
            running = stats.num_running_reqs
        return 4 * waiting + running

    def on_stats(self, rank: int) -> None:
        self._local_waiting[rank] = 0

    def on_sent(self, rank: int) -> None:
        self._local_waiting[rank] = self._local_waiting.get(rank, 0) + 1


@dataclass
class RoundRobinPolicy(LoadBalancePolicy):
    """Every routable rank in turn, ignoring load and cache (the only policy that rotates)."""

    _next: int = 0

    def choose(self, request: RouteRequest, views: Sequence[RankView]) -> RoutingDecision:
        assert views, "no routable engine ranks"
        view = views[self._next % len(views)]
        self._next += 1
        reason = "only-rank" if len(views) == 1 else "load"
        return RoutingDecision(view.rank, reason, view.num_cached_tokens)


# Sessions remembered by `SessionAffinityPolicy`; the least recently routed are forgotten.
MAX_SESSIONS = 65536


@dataclass
class SessionAffinityPolicy(LoadBalancePolicy):
    """Keeps each session on one rank while that rank's load stays within a bound.

    A request with a `session_id` goes to the rank its session last went to if that rank is
    routable and `load_tokens(rank) <= load_tokens(least loaded) + max_extra_load`; otherwise
    (and for a request without a session) `inner` decides, and the session moves to its
    choice. Sessions are kept LRU, at most `max_sessions`.
    """

    inner: LoadBalancePolicy = field(default_factory=CacheAwarePolicy)
    max_extra_load: float = 4096.0
    decode_cost: int = 16
    max_sessions: int = MAX_SESSIONS
    _rank_of: OrderedDict[str, int] = field(default_factory=OrderedDict)

    def choose(self, request: RouteRequest, views: Sequence[RankView]) -> RoutingDecision:
        session = request.session_id
        if session is None:
            return self.inner.choose(request, views)
        rank = self._rank_of.get(session)
        held = next((v for v in views if v.rank == rank), None)
        if held is not None and len(views) > 1:
            least = min(load_tokens(v.load, self.decode_cost) for v in views)
            if load_tokens(held.load, self.decode_cost) <= least + self.max_extra_load:
                self._rank_of.move_to_end(session)
                return RoutingDecision(held.rank, "session", held.num_cached_tokens)
        decision = self.inner.choose(request, views)
        self._rank_of[session] = decision.rank
        self._rank_of.move_to_end(session)
        while len(self._rank_of) > self.max_sessions:
            self._rank_of.popitem(last=False)
        return decision

    def on_sent(self, rank: int) -> None:
        self.inner.on_sent(rank)

    def on_stats(self, rank: int) -> None:
        self.inner.on_stats(rank)


POLICIES: dict[str, type[LoadBalancePolicy]] = {
    "cache_aware": CacheAwarePolicy,
    "least_loaded": LeastLoadedPolicy,
    "queue_length": QueueLengthPolicy,
    "round_robin": RoundRobinPolicy,
}


# The names `--routing-policy` offers (make_policy also takes "queue-length", for comparisons).
ROUTING_POLICIES = ("cache-aware", "least-loaded", "round-robin")


def make_policy(name: str, *, lora_load_cost: float | None = None) -> LoadBalancePolicy:
    """The policy named `name` ("cache-aware" and "cache_aware" alike), with session
    affinity for the requests that ask for it.

    Args:
        lora_load_cost: the cache-aware policy's `lora_load_cost`; None: its default. The
            other policies do not weigh adapters.

    Raises:
        ValueError: an unknown name, or a negative cost.
    """
    key = name.replace("-", "_")
    if key not in POLICIES:
        choices = sorted(n.replace("_", "-") for n in POLICIES)
        raise ValueError(f"unknown routing policy {name!r}; choose from {choices}")
    if lora_load_cost is not None and lora_load_cost < 0:
        raise ValueError(f"lora_load_cost must be at least 0, not {lora_load_cost}")
    inner = POLICIES[key]()
    if isinstance(inner, CacheAwarePolicy) and lora_load_cost is not None:
        inner.lora_load_cost = lora_load_cost
    return SessionAffinityPolicy(inner=inner)
