"""`AdmissionPolicy`: which tenant's request a front end sends to the cluster next. Pure: no
I/O, no clock, no asyncio (`admission_gate` drives it).

Work is counted in tokens: a request's `Work` is the KV it may come to hold (its prompt plus
the output it is expected to generate, `work_of`) and its sequences. A request is *in flight*
from its admission until it is released (finished, failed or abandoned), *queued* before.

The algorithm (weighted fair queuing over in-flight work):

1. `capacity` is what this front end may fill of the cluster at once: KV tokens and seats
   (`max_num_seqs`) of the serving ranks, less what other clients hold there, but never
   less than its even part (`admission_gate.cluster_capacity`). A `reserve` of it (1/8) is
   kept free of work that does not need it (4).
2. A tenant is *active* while it has work in flight or queued. Its *share* is the capacity
   short of the reserve (tokens and seats) times its weight over the active tenants'
   weights.
3. Offered a request, the policy queues it in its tenant's queue, ordered by (priority, order
   offered): lower priority first, as vLLM orders them; then it dispatches (4).
4. Dispatch, repeated while it admits: among tenants with queued work and fewer requests in
   flight than their `max_concurrency`, the one owed most comes first: the least in-flight
   tokens per unit of weight (ties: the oldest head). The first of them is admitted if its
   head fits the capacity left short of the reserve (or nothing at all is in flight: a
   request larger than the cluster runs alone); any of them is admitted if its head keeps
   it within its share, into the reserve and past it if need be. So capacity freed goes to
   whoever is owed most; a tenant under its share never waits for another tenant's work to
   finish, and the reserve keeps seats and KV blocks free for it, so its first requests
   start at the engines' next step rather than when a flood's request ends; in flight stays
   within twice the capacity.
5. A tenant's queue holds at most `max_queued` requests: past it, its least urgent (the
   newest of the lowest priority, often the one just offered) is rejected with 429.
6. The front end's queues hold at most `max_queued_tokens` tokens in all: past it, queued
   requests are rejected with 503, each time the least urgent of the tenant furthest over
   its weighted part of that bound, until the total fits. A flood thus sheds its own work,
   not another tenant's.
7. A release or a cancelled wait takes the request's work off and dispatches again, as does
   a change of capacity.

Every call that can change other requests' fate returns the entries it admitted or rejected.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from http import HTTPStatus

from shoal.deploy.openai.tenants import Tenant


@dataclass(frozen=True)
class Work:
    """What one request may hold in the cluster: KV tokens and sequences."""

    num_tokens: int
    num_seqs: int = 1


@dataclass(frozen=True)
class Capacity:
    """What this front end may fill of the cluster at once."""

    num_tokens: int
    num_seqs: int


def work_of(
    prompt_lens: Iterable[int], n: int, max_tokens: int | None, max_model_len: int | None
) -> Work:
    """A request's work: each prompt once (its `n` sequences share its prefix blocks) plus
    `n` outputs of `max_tokens` each, or, without it, as many as the context leaves."""
    num_tokens = num_seqs = 0
    for prompt_len in prompt_lens:
        room = max(0, (max_model_len or prompt_len + 16) - prompt_len)
        output = room if max_tokens is None else min(max_tokens, room)
        num_tokens += prompt_len + n * max(1, output)
        num_seqs += n
    return Work(num_tokens, num_seqs)


class State(enum.Enum):
    QUEUED = "queued"
    ADMITTED = "admitted"
    REJECTED = "rejected"
    RELEASED = "released"


# The capacity's fraction kept for tenants within their share (step 4).
DEFAULT_RESERVE = 1 / 8

# Why a request was rejected: the metrics' `reason` label, and its HTTP status.
REJECT_REASONS = {
    "tenant_queue_full": HTTPStatus.TOO_MANY_REQUESTS,
    "front_end_full": HTTPStatus.SERVICE_UNAVAILABLE,
}


@dataclass(eq=False)
class Entry:
    """One offered request and what became of it."""

    tenant: str
    work: Work
    priority: int
    order: int
    state: State = State.QUEUED
    reason: str | None = None  # set when rejected: a key of REJECT_REASONS
    has_waited: bool = False  # it was queued before it was admitted (or rejected)

    def sort_key(self) -> tuple[int, int]:
        return self.priority, self.order


@dataclass
class TenantStats:
    """A tenant's running totals, for metrics."""

    num_admitted: int = 0
    num_queued: int = 0  # offered requests that had to wait
    num_rejected: dict[str, int] = field(default_factory=dict)
    num_tokens_admitted: int = 0


@dataclass(frozen=True)
class TenantView:
    """A tenant's totals and what it has queued and in flight now."""

    stats: TenantStats
    num_queued: int
    queued_tokens: int
    num_in_flight: int
    in_flight_tokens: int


@dataclass
class _Tenant:
    config: Tenant
    max_queued: int
    in_flight_tokens: int = 0
    in_flight_seqs: int = 0
    in_flight_requests: int = 0
    queue: list[tuple[int, int, Entry]] = field(default_factory=list)  # heap on sort_key
    queued_tokens: int = 0
    stats: TenantStats = field(default_factory=TenantStats)

    @property
    def is_active(self) -> bool:
        return bool(self.in_flight_requests or self.queue)

    @property
    def can_admit_more(self) -> bool:
        cap = self.config.max_concurrency
        return bool(self.queue) and (cap is None or self.in_flight_requests < cap)

    def head(self) -> Entry:
        return self.queue[0][2]

    def push(self, entry: Entry) -> None:
        heapq.heappush(self.queue, (*entry.sort_key(), entry))
        self.queued_tokens += entry.work.num_tokens

    def take(self, entry: Entry) -> None:
        if self.queue[0][2] is entry:
            heapq.heappop(self.queue)
        else:
            self.queue = [item for item in self.queue if item[2] is not entry]
            heapq.heapify(self.queue)
        self.queued_tokens -= entry.work.num_tokens

    def least_urgent(self) -> Entry:
        return max(self.queue, key=lambda item: item[:2])[2]


class AdmissionPolicy:
    """The algorithm of the module docstring over a fixed set of tenants (others are made on
    first use with the defaults: the tenant `default` of a front end without keys).

    Args:
        tenants: the known tenants and their limits.
        max_queued_per_tenant: a tenant's queue bound where its own `max_queued` is None.
        max_queued_tokens: the bound on every queued request's tokens together.
        capacity: the capacity until `set_capacity`.
        reserve: the fraction of the capacity that only tenants within their share fill.
    """

    def __init__(
        self,
        tenants: Iterable[Tenant],
        *,
        max_queued_per_tenant: int,
        max_queued_tokens: int,
        capacity: Capacity = Capacity(0, 0),
        reserve: float = DEFAULT_RESERVE,
    ) -> None:
        assert 0 <= reserve < 1, f"reserve {reserve} is not a fraction"
        self._fill = 1 - reserve
        self._max_queued_per_tenant = max_queued_per_tenant
        self.max_queued_tokens = max_queued_tokens
        self.capacity = capacity
        self._tenants: dict[str, _Tenant] = {}
        for tenant in tenants:
            self._tenant(tenant.name, tenant)
        self._order = itertools.count()
        self.in_flight_tokens = 0
        self.in_flight_seqs = 0
        self.in_flight_requests = 0
        self.queued_tokens = 0

    # --- the calls ---------------------------------------------------------------------------

    def offer(self, tenant: str, work: Work, priority: int = 0) -> tuple[Entry, list[Entry]]:
        """Takes a request in (steps 3, 5, 6).

        Returns:
            its entry (admitted, queued or rejected) and the other entries whose state this
            changed (rejected to make room).
        """
        state = self._tenant(tenant)
        entry = Entry(tenant, work, priority, next(self._order))
        self._push(state, entry)
        changed = self._dispatch()
        if entry.state is State.QUEUED:
            if len(state.queue) > state.max_queued:
                changed.append(self._reject(state.least_urgent(), "tenant_queue_full"))
            changed += self._shed()
        if entry.state is State.QUEUED:
            entry.has_waited = True
            state.stats.num_queued += 1
        return entry, [e for e in changed if e is not entry]

    def release(self, entry: Entry) -> list[Entry]:
        """Takes an admitted request's work off (step 7); returns the entries it admitted."""
        assert entry.state is State.ADMITTED, f"released a request that is {entry.state.value}"
        entry.state = State.RELEASED
        state = self._tenants[entry.tenant]
        state.in_flight_tokens -= entry.work.num_tokens
        state.in_flight_seqs -= entry.work.num_seqs
        state.in_flight_requests -= 1
        self.in_flight_tokens -= entry.work.num_tokens
        self.in_flight_seqs -= entry.work.num_seqs
        self.in_flight_requests -= 1
        return self._dispatch()

    def cancel(self, entry: Entry) -> list[Entry]:
        """Forgets a request whose caller went away: released if admitted, else taken off
        its queue. Returns the entries this admitted."""
        if entry.state is State.ADMITTED:
            return self.release(entry)
        if entry.state is not State.QUEUED:
            return []
        self._take(self._tenants[entry.tenant], entry)
        entry.state = State.RELEASED
        return self._dispatch()

    def set_capacity(self, capacity: Capacity) -> list[Entry]:
        """A new capacity (ranks came or went, other clients' load moved); returns the
        entries this admitted."""
        self.capacity = capacity
        return self._dispatch()

    # --- what metrics read -------------------------------------------------------------------

    def tenant_names(self) -> list[str]:
        return list(self._tenants)

    def tenant_view(self, name: str) -> TenantView:
        state = self._tenants[name]
        return TenantView(
            state.stats,
            len(state.queue),
            state.queued_tokens,
            state.in_flight_requests,
            state.in_flight_tokens,
        )

    def share_of(self, name: str) -> float:
        """The fraction of the capacity short of the reserve that is `name`'s share now
        (step 2; 0 while it is inactive)."""
        state = self._tenants[name]
        active = sum(t.config.weight for t in self._tenants.values() if t.is_active)
        if not state.is_active or not active:
            return 0.0
        return state.config.weight / active

    # --- the steps ---------------------------------------------------------------------------

    def _dispatch(self) -> list[Entry]:
        admitted: list[Entry] = []
        while (entry := self._next()) is not None:
            self._admit(entry)
            admitted.append(entry)
        return admitted

    def _next(self) -> Entry | None:
        """Step 4's choice, or None when nothing may be admitted now."""
        candidates = [t for t in self._tenants.values() if t.can_admit_more]
        candidates.sort(key=lambda t: (t.in_flight_tokens / t.config.weight, t.head().order))
        for i, state in enumerate(candidates):
            head = state.head()
            if i == 0 and (self._fits(head.work) or self.in_flight_requests == 0):
                return head
            if self._is_within_share(state, head.work):
                return head
        return None

    def _is_within_share(self, state: _Tenant, work: Work) -> bool:
        share = self.share_of(state.config.name) * self._fill
        return (
            state.in_flight_tokens + work.num_tokens <= share * self.capacity.num_tokens
            and state.in_flight_seqs + work.num_seqs <= share * self.capacity.num_seqs
        )

    def _fits(self, work: Work) -> bool:
        return (
            self.in_flight_tokens + work.num_tokens <= self._fill * self.capacity.num_tokens
            and self.in_flight_seqs + work.num_seqs <= self._fill * self.capacity.num_seqs
        )

    def _admit(self, entry: Entry) -> None:
        state = self._tenants[entry.tenant]
        self._take(state, entry)
        entry.state = State.ADMITTED
        state.in_flight_tokens += entry.work.num_tokens
        state.in_flight_seqs += entry.work.num_seqs
        state.in_flight_requests += 1
        self.in_flight_tokens += entry.work.num_tokens
        self.in_flight_seqs += entry.work.num_seqs
        self.in_flight_requests += 1
        state.stats.num_admitted += 1
        state.stats.num_tokens_admitted += entry.work.num_tokens

    def _shed(self) -> list[Entry]:
        """Step 6: rejects queued work until the total fits `max_queued_tokens`."""
        shed = []
        while self.queued_tokens > self.max_queued_tokens:
            queued = [t for t in self._tenants.values() if t.queue]
            weights = sum(t.config.weight for t in queued)
            worst = max(
                queued,
                key=lambda t: t.queued_tokens - self.max_queued_tokens * t.config.weight / weights,
            )
            shed.append(self._reject(worst.least_urgent(), "front_end_full"))
        return shed

    def _reject(self, entry: Entry, reason: str) -> Entry:
        state = self._tenants[entry.tenant]
        self._take(state, entry)
        entry.state, entry.reason = State.REJECTED, reason
        state.stats.num_rejected[reason] = state.stats.num_rejected.get(reason, 0) + 1
        return entry

    def _push(self, state: _Tenant, entry: Entry) -> None:
        state.push(entry)
        self.queued_tokens += entry.work.num_tokens

    def _take(self, state: _Tenant, entry: Entry) -> None:
        state.take(entry)
        self.queued_tokens -= entry.work.num_tokens

    def _tenant(self, name: str, config: Tenant | None = None) -> _Tenant:
        state = self._tenants.get(name)
        if state is None:
            config = config or Tenant(name)
            max_queued = config.max_queued
            if max_queued is None:
                max_queued = self._max_queued_per_tenant
            state = self._tenants[name] = _Tenant(config, max_queued)
        return state
