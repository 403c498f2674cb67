"""`AdmissionPolicy`, step by step, and `AdmissionGate` on an event loop: fair shares by
weight, bounded queues (429, 503), priority within a tenant, caps, cancellations."""

from __future__ import annotations

import asyncio
from collections import Counter, deque

import pytest

from shoal.deploy.openai.admission import (
    AdmissionPolicy,
    Capacity,
    Entry,
    State,
    Work,
    work_of,
)
from shoal.deploy.openai.admission_gate import AdmissionGate, front_end_part
from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.tenants import Tenant

UNIT = Work(100, 1)


def _policy(
    *tenants: Tenant,
    capacity: Capacity = Capacity(1000, 100),
    max_queued: int = 100,
    max_queued_tokens: int = 1_000_000,
    reserve: float = 0.0,
) -> AdmissionPolicy:
    return AdmissionPolicy(
        tenants,
        max_queued_per_tenant=max_queued,
        max_queued_tokens=max_queued_tokens,
        capacity=capacity,
        reserve=reserve,
    )


def _offer(policy: AdmissionPolicy, tenant: str, n: int, priority: int = 0) -> list[Entry]:
    return [policy.offer(tenant, UNIT, priority)[0] for _ in range(n)]


def test_a_lone_tenant_fills_the_capacity_then_waits_for_a_release() -> None:
    policy = _policy(Tenant("a"))
    entries = _offer(policy, "a", 12)
    assert [e.state for e in entries] == [State.ADMITTED] * 10 + [State.QUEUED] * 2
    assert policy.release(entries[0]) == [entries[10]]
    assert entries[10].has_waited and entries[11].state is State.QUEUED


def test_a_tenant_under_its_share_is_admitted_past_a_flood() -> None:
    policy = _policy(Tenant("flood"), Tenant("quiet"))
    flood = _offer(policy, "flood", 30)
    assert sum(e.state is State.ADMITTED for e in flood) == 10  # the whole capacity
    quiet, changed = policy.offer("quiet", UNIT)
    assert quiet.state is State.ADMITTED and not changed and not quiet.has_waited
    # Half the capacity is its share: it gets five at once, then waits its turn.
    more = _offer(policy, "quiet", 5)
    assert [e.state for e in more] == [State.ADMITTED] * 4 + [State.QUEUED]
    # Freed capacity goes to whoever is owed most: here the flood, once it holds less.
    assert policy.release(flood[0]) == []  # still over capacity (14 in flight)
    for entry in flood[1:5]:
        assert policy.release(entry) == []
    assert policy.release(flood[5]) == [flood[10]]  # flood 4 in flight, quiet 5: 10 in all
    assert more[4].state is State.QUEUED
    assert policy.release(more[0]) == [more[4]]  # now quiet holds less


def test_the_reserve_is_left_to_tenants_within_their_share() -> None:
    policy = _policy(Tenant("flood"), Tenant("quiet"), reserve=0.2)
    flood = _offer(policy, "flood", 12)
    assert sum(e.state is State.ADMITTED for e in flood) == 8  # 2 of 10 kept free
    quiet = _offer(policy, "quiet", 3)
    assert all(e.state is State.ADMITTED for e in quiet)  # into the reserve, and past it
    assert policy.in_flight_requests == 11


def test_a_full_queue_refuses_that_tenant_only_with_429() -> None:
    policy = _policy(Tenant("flood", max_queued=3), Tenant("quiet"))
    flood = _offer(policy, "flood", 20)
    assert Counter(e.state for e in flood) == {
        State.ADMITTED: 10,
        State.QUEUED: 3,
        State.REJECTED: 7,
    }
    assert {e.reason for e in flood if e.state is State.REJECTED} == {"tenant_queue_full"}
    assert policy.tenant_view("flood").stats.num_rejected == {"tenant_queue_full": 7}
    assert policy.offer("quiet", UNIT)[0].state is State.ADMITTED


def test_priority_orders_a_tenants_queue_and_displaces_its_least_urgent() -> None:
    policy = _policy(Tenant("a", max_queued=3), capacity=Capacity(100, 10))
    running, *bulk = _offer(policy, "a", 4, priority=5)
    assert running.state is State.ADMITTED and all(e.state is State.QUEUED for e in bulk)
    urgent, displaced = policy.offer("a", UNIT, priority=-1)
    # The queue was full: its least urgent (the newest of priority 5) makes room.
    assert urgent.state is State.QUEUED and displaced == [bulk[2]]
    assert bulk[2].reason == "tenant_queue_full"
    assert policy.release(running) == [urgent]  # ahead of those queued before it
    assert policy.release(urgent) == [bulk[0]]


def test_shares_follow_the_weights_under_saturation() -> None:
    policy = _policy(
        Tenant("heavy", weight=3),
        Tenant("light", weight=1),
        capacity=Capacity(10_000, 1000),
        max_queued=1000,
    )
    admitted: deque[Entry] = deque()
    for tenant in ("heavy", "light"):
        admitted.extend(e for e in _offer(policy, tenant, 1000) if e.state is State.ADMITTED)
    served: Counter[str] = Counter()
    for i in range(1000):  # requests of equal size finish in the order they were admitted
        done = admitted.popleft()
        if i >= 200:  # past the start, when the heavy tenant alone held everything
            served[done.tenant] += 1
        admitted.extend(policy.release(done))
    assert served["heavy"] / served["light"] == pytest.approx(3, rel=0.1)


def test_max_concurrency_caps_a_tenant_without_holding_up_the_others() -> None:
    policy = _policy(Tenant("capped", max_concurrency=2), Tenant("other"))
    capped = _offer(policy, "capped", 4)
    assert [e.state for e in capped] == [State.ADMITTED] * 2 + [State.QUEUED] * 2
    assert all(e.state is State.ADMITTED for e in _offer(policy, "other", 3))
    assert policy.release(capped[0]) == [capped[2]]


def test_the_front_ends_waiting_room_sheds_the_tenant_furthest_over_its_part() -> None:
    policy = _policy(Tenant("flood"), Tenant("quiet"), max_queued_tokens=1000)
    flood = _offer(policy, "flood", 25)  # 10 admitted, 10 fill the room, 5 refused
    assert Counter(e.state for e in flood)[State.REJECTED] == 5
    assert {e.reason for e in flood if e.state is State.REJECTED} == {"front_end_full"}
    policy.set_capacity(Capacity(0, 0))  # nothing more is admitted: quiet must queue
    quiet = _offer(policy, "quiet", 6)
    assert all(e.state is State.QUEUED for e in quiet[:5])  # its part: half the room
    assert quiet[5].state is State.REJECTED and quiet[5].reason == "front_end_full"
    assert sum(e.state is State.QUEUED for e in flood) == 5  # the flood shed its own
    assert policy.queued_tokens <= 1000


def test_cancelling_a_wait_or_an_admission_frees_its_place() -> None:
    policy = _policy(Tenant("a"), capacity=Capacity(200, 10))
    first, _, third = _offer(policy, "a", 3)
    assert policy.cancel(third) == [] and third.state is State.RELEASED
    assert policy.tenant_view("a").num_queued == 0
    (fourth,) = _offer(policy, "a", 1)
    assert policy.cancel(first) == [fourth]
    assert policy.cancel(first) == []  # twice: nothing


def test_more_capacity_admits_those_waiting() -> None:
    policy = _policy(Tenant("a"), capacity=Capacity(100, 10))
    entries = _offer(policy, "a", 3)
    assert policy.set_capacity(Capacity(300, 10)) == entries[1:]


def test_seats_bound_as_tokens_do() -> None:
    policy = _policy(Tenant("a"), capacity=Capacity(10_000, 4))
    entries = [policy.offer("a", Work(10, 2))[0] for _ in range(3)]
    assert [e.state for e in entries] == [State.ADMITTED, State.ADMITTED, State.QUEUED]


def test_a_request_larger_than_the_cluster_runs_alone() -> None:
    policy = _policy(Tenant("a"), Tenant("b"), capacity=Capacity(100, 10))
    small = policy.offer("a", Work(60))[0]
    huge = policy.offer("b", Work(500))[0]
    assert small.state is State.ADMITTED and huge.state is State.QUEUED
    assert policy.release(small) == [huge]


def test_work_counts_each_prompt_once_and_every_sequence_output() -> None:
    assert work_of([10], 1, 16, 2048) == Work(26, 1)
    assert work_of([10, 20], 3, 5, 2048) == Work(10 + 15 + 20 + 15, 6)
    assert work_of([100], 1, None, 256) == Work(256, 1)  # no max_tokens: what the context leaves
    assert work_of([100], 1, 500, 256) == Work(256, 1)


# --- the gate ---------------------------------------------------------------------------------


async def test_the_gate_admits_queues_and_refuses_with_retry_after() -> None:
    capacity = Capacity(200, 10)
    gate = AdmissionGate(_policy(Tenant("a", max_queued=1)), lambda: capacity)
    first = await gate.admit("a", UNIT)
    second = await gate.admit("a", UNIT)
    waiting = asyncio.create_task(gate.admit("a", UNIT))
    while gate.policy.tenant_view("a").num_queued == 0:
        await asyncio.sleep(0)
    with pytest.raises(OpenAIError) as refused:
        await gate.admit("a", UNIT)
    assert refused.value.status == 429 and refused.value.code == "tenant_queue_full"
    assert refused.value.headers is not None and int(refused.value.headers["Retry-After"]) >= 1
    first.release()
    third = await waiting
    assert third.entry.has_waited
    for ticket in (second, third, second):  # a second release does nothing
        ticket.release()
    assert gate.policy.in_flight_requests == 0


async def test_a_caller_that_goes_away_leaves_the_queue() -> None:
    gate = AdmissionGate(_policy(Tenant("a")), lambda: Capacity(100, 10))
    ticket = await gate.admit("a", UNIT)
    waiting = asyncio.create_task(gate.admit("a", UNIT))
    while gate.policy.tenant_view("a").num_queued == 0:
        await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert gate.policy.tenant_view("a").num_queued == 0
    ticket.release()
    assert gate.policy.in_flight_requests == 0


async def test_the_gate_follows_the_capacity_while_requests_wait() -> None:
    capacity = [Capacity(100, 10)]
    gate = AdmissionGate(_policy(Tenant("a")), lambda: capacity[0])
    await gate.admit("a", UNIT)
    waiting = asyncio.create_task(gate.admit("a", UNIT))
    while gate.policy.tenant_view("a").num_queued == 0:
        await asyncio.sleep(0)
    capacity[0] = Capacity(200, 10)  # no release: the gate's tick reads it
    assert (await asyncio.wait_for(waiting, 10)).entry.state is State.ADMITTED


def test_a_front_end_fills_what_other_clients_leave_but_at_least_its_even_part() -> None:
    cluster = Capacity(8000, 100)
    assert front_end_part(cluster, 0, 1) == cluster
    assert front_end_part(cluster, 20, 2) == Capacity(6400, 80)  # what the other leaves
    assert front_end_part(cluster, 90, 2) == Capacity(4000, 50)  # its half, at once
    assert front_end_part(cluster, 150, 4) == Capacity(2000, 25)  # queued work: a quarter
