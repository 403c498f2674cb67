"""The load-balancing policies' algorithms, fed by hand."""

from __future__ import annotations

from collections import Counter

from shoal.client.lb_policy import LeastLoadedPolicy, QueueLengthPolicy, RoundRobinPolicy
from shoal.engine.protocol import SchedulerStats


def test_least_loaded_prefers_the_rank_with_fewer_pending_tokens() -> None:
    policy = LeastLoadedPolicy()
    policy.on_stats(0, SchedulerStats(num_pending_prefill_tokens=900, num_running_reqs=1), 0)
    policy.on_stats(1, SchedulerStats(num_running_reqs=3), 0)
    assert policy.choose([0, 1]) == 1


def test_own_sends_count_until_a_snapshot_includes_them() -> None:
    policy = LeastLoadedPolicy(decode_cost=16)
    policy.on_stats(0, SchedulerStats(step_counter=5), 0)
    policy.on_stats(1, SchedulerStats(step_counter=5), 0)
    policy.on_sent("a", 0, prompt_tokens=500)
    assert policy.score(0) == 516
    # A later step that has not taken the request in yet must not erase it.
    policy.on_stats(0, SchedulerStats(step_counter=6), 0)
    assert policy.score(0) == 516
    assert policy.choose([0, 1]) == 1
    # Stats that include it carry the engine's own count instead; nothing is counted twice.
    included = SchedulerStats(step_counter=7, num_pending_prefill_tokens=500, num_waiting_reqs=1)
    policy.on_stats(0, included, 1)
    assert policy.score(0) == 516
    # An older snapshot arriving late (say, through the coordinator) is ignored.
    policy.on_stats(0, SchedulerStats(step_counter=6), 0)
    assert policy.score(0) == 516


def test_first_output_and_finish_release_the_in_flight_share() -> None:
    policy = LeastLoadedPolicy()
    policy.on_sent("a", 0, prompt_tokens=100)
    policy.on_output("a", finished=False)
    assert policy.score(0) == 0
    assert policy.rank_of("a") == 0
    policy.on_output("a", finished=True)
    assert policy.in_flight == {}


def test_ties_rotate_across_ranks() -> None:
    policy = LeastLoadedPolicy()
    picks = Counter(policy.choose([0, 1, 2, 3]) for _ in range(40))
    assert picks == Counter({0: 10, 1: 10, 2: 10, 3: 10})


def test_forget_rank_returns_its_requests_and_restarts_its_count() -> None:
    policy = LeastLoadedPolicy()
    policy.on_sent("a", 0, 10)
    policy.on_sent("b", 1, 10)
    assert policy.forget_rank(0) == ["a"]
    assert list(policy.in_flight) == ["b"]
    policy.on_sent("c", 0, 10)  # first send to the restarted rank
    policy.on_stats(0, SchedulerStats(), 0)
    assert policy.score(0) == 10 + policy.decode_cost


def test_queue_length_policy_is_overwritten_by_snapshots() -> None:
    policy = QueueLengthPolicy()
    policy.on_stats(0, SchedulerStats(), 0)
    policy.on_stats(1, SchedulerStats(num_running_reqs=2), 0)
    policy.on_sent("a", 0, 10)
    assert policy.score(0) == 4
    policy.on_stats(0, SchedulerStats(), 0)  # stale: vLLM's scheme forgets the send
    assert policy.score(0) == 0


def test_round_robin_cycles() -> None:
    policy = RoundRobinPolicy()
    assert [policy.choose([0, 1, 2]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
