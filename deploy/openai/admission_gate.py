"""`AdmissionGate`: a front end's admission as its endpoints await it, over `AdmissionPolicy`.

A generation request is admitted once tokenized and before it is routed. `admit` returns a
`Ticket` at once, or after waiting in its tenant's queue, or raises the 429 (its tenant's
queue is full) or 503 (the front end's waiting room is full), each with `Retry-After`: the
seconds the queued work ahead takes to drain at the rate requests were released lately. A
caller that goes away while it waits leaves the queue. The ticket is released when the
response's last byte is sent, however the request ends (the front door holds every ticket
of a request and releases it).

The capacity is read from the cluster before each offer and every `TICK_S` while requests
wait (`cluster_capacity`): other clients' work changes it without any event here.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Literal

from shoal.deploy.openai.admission import (
    REJECT_REASONS,
    AdmissionPolicy,
    Capacity,
    Entry,
    State,
    Work,
)
from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.tenants import TenantTable

if TYPE_CHECKING:
    from shoal.client.api.async_llm import AsyncLLM

# How often the capacity is read again while requests wait.
TICK_S = 0.1
# Releases over this window give the drain rate behind `Retry-After`.
_RATE_WINDOW_S = 10.0
MAX_RETRY_AFTER_S = 60

AdmissionScope = Literal["cluster", "front-end"]
ADMISSION_SCOPES: tuple[AdmissionScope, ...] = ("cluster", "front-end")


def cluster_capacity(llm: AsyncLLM, scope: AdmissionScope = "cluster") -> Capacity | None:
    """What this front end may fill of the serving ranks at once; None while none serves.

    The ranks hold their KV tokens (blocks x block size, from each rank's HELLO facts) and
    seats (`max_num_seqs` each). Scope "front-end" takes all of it. Scope "cluster" takes
    what other clients (front ends, drivers) leave of it, from the stats every client
    receives: a rank's running and waiting requests not of this client (the engine counts
    this client's sends, so its own in the stats are known), each a seat and its part of the
    KV tokens; but never less than an even part among the clients the ranks list as
    attached, so a front end that starts sending while others fill the cluster gets its
    part at once (they drain to theirs as their requests end).
    """
    facts = llm.engine_core.engine_facts()
    ranks = [r for r in llm.serving_ranks() if r in facts]
    if not ranks:
        return None
    num_tokens = sum(facts[r].num_kv_blocks * facts[r].block_size for r in ranks)
    num_seqs = len(ranks) * llm.config.scheduler.max_num_seqs
    if scope == "front-end":
        return Capacity(num_tokens, num_seqs)
    others = _other_clients_seqs(llm, ranks)
    num_clients = getattr(llm.engine_core, "num_attached_clients", 1)
    return front_end_part(Capacity(num_tokens, num_seqs), others, num_clients)


def front_end_part(cluster: Capacity, others_seqs: int, num_clients: int) -> Capacity:
    """What a front end may fill of `cluster` when other clients run or queue `others_seqs`
    sequences there: what they leave, but at least `1 / num_clients` of it."""
    left = max(0, cluster.num_seqs - others_seqs) / max(1, cluster.num_seqs)
    part = max(left, 1 / max(1, num_clients))
    return Capacity(int(cluster.num_tokens * part), int(cluster.num_seqs * part))


def _other_clients_seqs(llm: AsyncLLM, ranks: list[int]) -> int:
    router = getattr(llm.engine_core, "router", None)
    if router is None:
        return 0  # one local engine: nobody else can reach it
    stats = llm.rank_stats()
    others = 0
    for rank in ranks:
        rank_stats, load = stats.get(rank), router.loads.get(rank)
        if rank_stats is None:
            continue
        own = 0 if load is None else load.num_counted_by_stats()
        others += max(0, rank_stats.num_running_reqs + rank_stats.num_waiting_reqs - own)
    return others


class Ticket:
    """An admitted request's hold on its tenant's share, until `release`."""

    def __init__(self, gate: AdmissionGate, entry: Entry) -> None:
        self._gate = gate
        self.entry = entry
        self.tenant = entry.tenant

    def add_usage(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """Counts tokens served to the tenant (one finished sequence)."""
        usage = self._gate.usage.setdefault(self.tenant, [0, 0])
        usage[0] += num_prompt_tokens
        usage[1] += num_generation_tokens

    def release(self) -> None:
        """Ends the hold (again: nothing)."""
        if self.entry.state is State.ADMITTED:
            self._gate.release(self.entry)


class AdmissionGate:
    """The async side of one front end's `AdmissionPolicy` (see the module docstring).

    Args:
        policy: the admission policy.
        capacity: the cluster's capacity now (None: unknown, keep the last).
        on_admitted: called with (tenant, seconds waited) for each request admitted after
            waiting (the queue-time histogram).
    """

    def __init__(
        self,
        policy: AdmissionPolicy,
        capacity: Callable[[], Capacity | None],
        on_admitted: Callable[[str, float], None] = lambda tenant, waited_s: None,
    ) -> None:
        self.policy = policy
        self._capacity = capacity
        self._on_admitted = on_admitted
        self._waiters: dict[Entry, tuple[asyncio.Future[None], float]] = {}
        self._releases: deque[tuple[float, int]] = deque()
        self._ticker: asyncio.Task[None] | None = None
        self.usage: dict[str, list[int]] = {}  # tenant -> [prompt, generation] tokens served

    async def admit(self, tenant: str, work: Work, priority: int = 0) -> Ticket:
        """Admits a request, now or once its turn comes.

        Raises:
            OpenAIError: 429 (the tenant's queue is full) or 503 (the front end's waiting room
                is full), with `Retry-After`.
        """
        self._refresh_capacity()
        entry, changed = self.policy.offer(tenant, work, priority)
        self._settle(changed)
        if entry.state is State.QUEUED:
            future = asyncio.get_running_loop().create_future()
            self._waiters[entry] = (future, time.monotonic())
            self._ensure_ticker()
            try:
                await future
            except asyncio.CancelledError:
                self._waiters.pop(entry, None)
                self._settle(self.policy.cancel(entry))
                raise
        if entry.state is State.REJECTED:
            raise self._rejection(entry)
        return Ticket(self, entry)

    def release(self, entry: Entry) -> None:
        self._releases.append((time.monotonic(), entry.work.num_tokens))
        self._settle(self.policy.release(entry))

    def retry_after_s(self, queued_tokens: int) -> int:
        """Seconds until `queued_tokens` of work would drain at the recent release rate."""
        now = time.monotonic()
        while self._releases and self._releases[0][0] < now - _RATE_WINDOW_S:
            self._releases.popleft()
        released = sum(tokens for _, tokens in self._releases)
        if not released:
            return 1
        rate = released / _RATE_WINDOW_S
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(queued_tokens / rate)))

    def _rejection(self, entry: Entry) -> OpenAIError:
        assert entry.reason is not None, "a rejected entry says why"
        status = REJECT_REASONS[entry.reason]
        if status == HTTPStatus.TOO_MANY_REQUESTS:
            ahead = self.policy.tenant_view(entry.tenant).queued_tokens
            message = f"tenant {entry.tenant!r} has as many requests waiting as it may; retry later"
        else:
            ahead = self.policy.queued_tokens
            message = "this front end has as much work waiting as it may hold; retry later"
        retry_after = self.retry_after_s(ahead)
        return OpenAIError(
            message, status, code=entry.reason, headers={"Retry-After": str(retry_after)}
        )

    def _settle(self, changed: list[Entry]) -> None:
        """Wakes the waiters whose entries were admitted or rejected."""
        now = time.monotonic()
        for entry in changed:
            waiter = self._waiters.pop(entry, None)
            if waiter is None:
                continue
            future, queued_at = waiter
            if entry.state is State.ADMITTED:
                self._on_admitted(entry.tenant, now - queued_at)
            if not future.done():
                future.set_result(None)

    def _refresh_capacity(self) -> None:
        capacity = self._capacity()
        if capacity is not None and capacity != self.policy.capacity:
            self._settle(self.policy.set_capacity(capacity))

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick(), name="shoal-admission-tick")

    async def _tick(self) -> None:
        while self._waiters:
            await asyncio.sleep(TICK_S)
            self._refresh_capacity()


# A tenant's queue holds this many requests unless its key says otherwise (`max_queued=`).
DEFAULT_MAX_QUEUED_REQUESTS_PER_TENANT = 256
# Tokens (prompt + expected output) every queue of a front end holds together.
DEFAULT_MAX_QUEUED_TOKENS = 1 << 20


@dataclass(frozen=True)
class AdmissionConfig:
    """The bounds of a front end's admission queues, and whose work its capacity counts."""

    max_queued_requests_per_tenant: int = DEFAULT_MAX_QUEUED_REQUESTS_PER_TENANT
    max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS
    scope: AdmissionScope = "cluster"

    def __post_init__(self) -> None:
        if self.max_queued_requests_per_tenant < 0 or self.max_queued_tokens < 0:
            raise ValueError(
                "--max-queued-requests-per-tenant and --max-queued-tokens must not be negative"
            )
        if self.scope not in ADMISSION_SCOPES:
            raise ValueError(f"unknown admission scope {self.scope!r}")

    def make_gate(
        self,
        tenants: TenantTable,
        llm: Callable[[], AsyncLLM | None],
        on_admitted: Callable[[str, float], None],
    ) -> AdmissionGate:
        """The gate of a front end whose client `llm()` returns (None while detached)."""
        policy = AdmissionPolicy(
            tenants.tenants,
            max_queued_per_tenant=self.max_queued_requests_per_tenant,
            max_queued_tokens=self.max_queued_tokens,
        )

        def capacity() -> Capacity | None:
            client = llm()
            return None if client is None else cluster_capacity(client, self.scope)

        return AdmissionGate(policy, capacity, on_admitted)


@dataclass
class Caller:
    """Who sent one HTTP request (its tenant), and the tickets it holds until its response's
    last byte (the front door releases them)."""

    tenant: str
    tickets: list[Ticket] = field(default_factory=list)

    def release(self) -> None:
        for ticket in self.tickets:
            ticket.release()


def add_admission_args(parser: argparse._ActionsContainer) -> None:
    """The flags of `AdmissionConfig`."""
    parser.add_argument(
        "--max-queued-requests-per-tenant",
        type=int,
        default=DEFAULT_MAX_QUEUED_REQUESTS_PER_TENANT,
        metavar="N",
        help="requests one tenant (API key) may have waiting for admission; past it, 429 with "
        "Retry-After (a key's `max_queued=` overrides it)",
    )
    parser.add_argument(
        "--max-queued-tokens",
        type=int,
        default=DEFAULT_MAX_QUEUED_TOKENS,
        metavar="N",
        help="tokens (prompt + expected output) all tenants' waiting requests may hold; past "
        "it, 503 with Retry-After for the tenant furthest over its part",
    )
    parser.add_argument(
        "--admission-scope",
        choices=ADMISSION_SCOPES,
        default="cluster",
        help="whose work the capacity this front end admits into counts: cluster (every "
        "client's, from the ranks' stats) or front-end (only its own)",
    )


def admission_config_from_args(args: argparse.Namespace) -> AdmissionConfig:
    return AdmissionConfig(
        max_queued_requests_per_tenant=args.max_queued_requests_per_tenant,
        max_queued_tokens=args.max_queued_tokens,
        scope=args.admission_scope,
    )
