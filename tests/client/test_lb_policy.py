"""The load-balancing policies' algorithms over a `RequestRouter`'s rank loads, fed by hand."""

from __future__ import annotations

from collections import Counter

from shoal.client.lb_policy import LeastLoadedPolicy, QueueLengthPolicy, RoundRobinPolicy
from shoal.client.routing import RequestRouter
from shoal.engine.protocol import SchedulerStats


def _score(
    policy: LeastLoadedPolicy | QueueLengthPolicy, router: RequestRouter, rank: int
) -> float:
    return policy.score(rank, router.load(rank))


def test_least_loaded_prefers_the_rank_with_fewer_pending_tokens() -> None:
    policy, router = LeastLoadedPolicy(), RequestRouter()
    router.load(0).update_stats(
        SchedulerStats(num_pending_prefill_tokens=900, num_running_reqs=1), 0
    )
    router.load(1).update_stats(SchedulerStats(num_running_reqs=3), 0)
    assert policy.choose([0, 1], router.loads) == 1


def test_own_sends_count_until_a_snapshot_includes_them() -> None:
    policy, router = LeastLoadedPolicy(decode_cost=16), RequestRouter()
    router.load(0).update_stats(SchedulerStats(step_counter=5), 0)
    router.load(1).update_stats(SchedulerStats(step_counter=5), 0)
    router.on_sent("a", 0, prompt_tokens=500)
    assert _score(policy, router, 0) == 516
    # A later step that has not taken the request in yet must not erase it.
    router.load(0).update_stats(SchedulerStats(step_counter=6), 0)
    assert _score(policy, router, 0) == 516
    assert policy.choose([0, 1], router.loads) == 1
    # Stats that include it carry the engine's own count instead; nothing is counted twice.
    included = SchedulerStats(step_counter=7, num_pending_prefill_tokens=500, num_waiting_reqs=1)
    router.load(0).update_stats(included, 1)
    assert _score(policy, router, 0) == 516
    # An older snapshot arriving late (say, through the coordinator) is ignored.
    assert not router.load(0).update_stats(SchedulerStats(step_counter=6), 0)
    assert _score(policy, router, 0) == 516


def test_first_output_and_finish_release_the_in_flight_share() -> None:
    policy, router = LeastLoadedPolicy(), RequestRouter()
    router.on_sent("a", 0, prompt_tokens=100)
    router.on_output("a", finished=False)
    assert _score(policy, router, 0) == 0
    assert router.rank_of("a") == 0
    router.on_output("a", finished=True)
    assert len(router) == 0 and router.rank_of("a") is None


def test_aborts_are_routed_by_the_router_whatever_the_policy_chose() -> None:
    router = RequestRouter()
    router.on_sent("a", 0, 10)
    router.on_sent("b", 1, 10)
    router.on_sent("c", 1, 10)
    assert router.on_aborted(["a", "c", "unknown"]) == {0: ["a"], 1: ["c"]}
    assert router.request_ids() == ["b"]


def test_ties_rotate_across_ranks() -> None:
    policy = LeastLoadedPolicy()
    picks = Counter(policy.choose([0, 1, 2, 3], {}) for _ in range(40))
    assert picks == Counter({0: 10, 1: 10, 2: 10, 3: 10})


def test_forget_rank_returns_its_requests_and_restarts_its_count() -> None:
    policy, router = LeastLoadedPolicy(), RequestRouter()
    router.on_sent("a", 0, 10)
    router.on_sent("b", 1, 10)
    assert router.forget_rank(0) == ["a"]
    assert router.request_ids() == ["b"]
    router.on_sent("c", 0, 10)  # first send to the restarted rank
    router.load(0).update_stats(SchedulerStats(), 0)
    assert _score(policy, router, 0) == 10 + policy.decode_cost


def test_queue_length_policy_is_overwritten_by_snapshots() -> None:
    policy, router = QueueLengthPolicy(), RequestRouter()
    router.load(0).update_stats(SchedulerStats(), 0)
    router.load(1).update_stats(SchedulerStats(num_running_reqs=2), 0)
    router.on_sent("a", 0, 10)
    policy.on_sent(0)
    assert _score(policy, router, 0) == 4
    policy.on_stats(0)  # stale stats: vLLM's scheme forgets the send all the same
    assert _score(policy, router, 0) == 0


def test_round_robin_cycles() -> None:
    policy = RoundRobinPolicy()
    assert [policy.choose([0, 1, 2], {}) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
