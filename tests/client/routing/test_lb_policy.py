"""The routing policies' algorithms over hand-fed rank views (load and cached prefix)."""

from __future__ import annotations

import random
from collections import Counter

from shoal.client.routing.lb_policy import (
    CacheAwarePolicy,
    LeastLoadedPolicy,
    LoadBalancePolicy,
    QueueLengthPolicy,
    RankView,
    RoundRobinPolicy,
    RouteRequest,
    SessionAffinityPolicy,
    load_tokens,
    make_policy,
)
from shoal.client.routing.router import RankLoad, RequestRouter
from shoal.engine.protocol import SchedulerStats


def _views(
    router: RequestRouter, ranks: list[int], cached: dict[int, int] | None = None
) -> list[RankView]:
    cached = cached or {}
    return [RankView(r, router.load(r), cached.get(r, 0), cached.get(r, 0) // 16) for r in ranks]


def _pick(
    policy: LoadBalancePolicy,
    router: RequestRouter,
    ranks: list[int],
    cached: dict[int, int] | None = None,
) -> int:
    return policy.choose(RouteRequest(100), _views(router, ranks, cached)).rank


def test_least_loaded_prefers_the_rank_with_fewer_pending_tokens() -> None:
    policy, router = LeastLoadedPolicy(), RequestRouter()
    router.load(0).update_stats(
        SchedulerStats(num_pending_prefill_tokens=900, num_running_reqs=1), 0
    )
    router.load(1).update_stats(SchedulerStats(num_running_reqs=3), 0)
    assert _pick(policy, router, [0, 1]) == 1


def test_own_sends_count_until_a_snapshot_includes_them() -> None:
    router = RequestRouter()
    router.load(0).update_stats(SchedulerStats(step_counter=5), 0)
    router.load(1).update_stats(SchedulerStats(step_counter=5), 0)
    router.on_sent("a", 0, prompt_tokens=500)
    assert load_tokens(router.load(0), 16) == 516
    # A later step that has not taken the request in yet must not erase it.
    router.load(0).update_stats(SchedulerStats(step_counter=6), 0)
    assert load_tokens(router.load(0), 16) == 516
    assert _pick(LeastLoadedPolicy(), router, [0, 1]) == 1
    # Stats that include it carry the engine's own count instead; nothing is counted twice.
    included = SchedulerStats(step_counter=7, num_pending_prefill_tokens=500, num_waiting_reqs=1)
    router.load(0).update_stats(included, 1)
    assert load_tokens(router.load(0), 16) == 516
    assert router.load(0).num_unseen == 0
    # An older snapshot arriving late (say, through the coordinator) is ignored.
    assert not router.load(0).update_stats(SchedulerStats(step_counter=6), 0)
    assert load_tokens(router.load(0), 16) == 516


def test_first_output_finish_abort_and_hand_over_release_the_in_flight_share() -> None:
    router = RequestRouter()
    router.on_sent("a", 0, prompt_tokens=100)
    router.on_output("a", finished=False)
    assert load_tokens(router.load(0), 16) == 0
    assert router.rank_of("a") == 0
    router.on_output("a", finished=True)
    assert len(router) == 0 and router.rank_of("a") is None
    router.on_sent("b", 0, prompt_tokens=7)
    router.on_sent("c", 0, prompt_tokens=9)
    router.on_aborted(["b"])
    assert router.load(0).unseen_prompt_tokens == 9
    assert router.take("c", 0) is not None
    assert load_tokens(router.load(0), 16) == 0
    # The stats catching up later subtract nothing twice.
    router.load(0).update_stats(SchedulerStats(step_counter=1), 4)
    assert (router.load(0).num_unseen, router.load(0).unseen_prompt_tokens) == (0, 0)


def test_aborts_are_routed_by_the_router_whatever_the_policy_chose() -> None:
    router = RequestRouter()
    router.on_sent("a", 0, 10)
    router.on_sent("b", 1, 10)
    router.on_sent("c", 1, 10)
    assert router.on_aborted(["a", "c", "unknown"]) == {0: ["a"], 1: ["c"]}
    assert router.request_ids() == ["b"]


def test_ties_are_stable_never_rotated() -> None:
    router = RequestRouter()
    for policy in (LeastLoadedPolicy(), CacheAwarePolicy(), QueueLengthPolicy()):
        picks = Counter(_pick(policy, router, [0, 1, 2, 3]) for _ in range(40))
        assert picks == Counter({0: 40})


def test_ties_go_to_the_longer_cached_prefix_then_to_the_emptier_cache() -> None:
    router = RequestRouter()
    policy = LeastLoadedPolicy()
    assert _pick(policy, router, [0, 1, 2], cached={1: 32, 2: 64}) == 2
    views = [RankView(0, router.load(0), 0, 500), RankView(1, router.load(1), 0, 20)]
    assert policy.choose(RouteRequest(100), views).rank == 1


def test_forget_rank_returns_its_requests_and_restarts_its_count() -> None:
    router = RequestRouter()
    router.on_sent("a", 0, 10)
    router.on_sent("b", 1, 10)
    assert router.forget_rank(0) == ["a"]
    assert router.request_ids() == ["b"]
    router.on_sent("c", 0, 10)  # first send to the restarted rank
    router.load(0).update_stats(SchedulerStats(), 0)
    assert load_tokens(router.load(0), 16) == 10 + 16


def test_queue_length_policy_is_overwritten_by_snapshots() -> None:
    policy, router = QueueLengthPolicy(), RequestRouter()
    router.load(0).update_stats(SchedulerStats(), 0)
    router.load(1).update_stats(SchedulerStats(num_running_reqs=2), 0)
    router.on_sent("a", 0, 10)
    policy.on_sent(0)
    assert policy.score(RouteRequest(10), _views(router, [0])[0]) == 4
    policy.on_stats(0)  # stale stats: vLLM's scheme forgets the send all the same
    assert policy.score(RouteRequest(10), _views(router, [0])[0]) == 0


def test_round_robin_cycles() -> None:
    policy, router = RoundRobinPolicy(), RequestRouter()
    assert [_pick(policy, router, [0, 1, 2]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_cache_aware_weighs_the_saved_prefill_against_the_extra_load() -> None:
    policy, router = CacheAwarePolicy(decode_cost=16), RequestRouter()
    # Rank 0 holds 960 of the prompt's 1000 tokens and has a little more load.
    router.load(0).update_stats(SchedulerStats(num_pending_prefill_tokens=300), 0)
    router.load(1).update_stats(SchedulerStats(), 0)
    decision = policy.choose(RouteRequest(1000), _views(router, [0, 1], {0: 960}))
    assert (decision.rank, decision.reason, decision.predicted_hit_tokens) == (0, "cache", 960)
    # Once its load outweighs the prefill it saves, the request goes elsewhere.
    router.load(0).update_stats(SchedulerStats(step_counter=1, num_pending_prefill_tokens=2000), 0)
    decision = policy.choose(RouteRequest(1000), _views(router, [0, 1], {0: 960}))
    assert (decision.rank, decision.reason) == (1, "load")
    # A load weight of 0 follows the cache whatever the load.
    assert (
        CacheAwarePolicy(load_weight=0)
        .choose(RouteRequest(1000), _views(router, [0, 1], {0: 960}))
        .rank
        == 0
    )


def test_a_single_rank_is_reported_as_the_only_choice() -> None:
    decision = CacheAwarePolicy().choose(RouteRequest(10), [RankView(3, RankLoad())])
    assert (decision.rank, decision.reason) == (3, "only-rank")


def test_session_affinity_holds_a_session_while_its_rank_is_within_the_bound() -> None:
    router = RequestRouter()
    policy = SessionAffinityPolicy(inner=LeastLoadedPolicy(), max_extra_load=1000)
    first = policy.choose(RouteRequest(10, "s"), _views(router, [0, 1]))
    assert first.rank == 0
    router.load(0).update_stats(SchedulerStats(num_pending_prefill_tokens=900), 0)
    again = policy.choose(RouteRequest(10, "s"), _views(router, [0, 1]))
    assert (again.rank, again.reason) == (0, "session")
    # Past the bound, the session moves to the inner policy's choice, and stays there.
    router.load(0).update_stats(SchedulerStats(step_counter=1, num_pending_prefill_tokens=5000), 0)
    moved = policy.choose(RouteRequest(10, "s"), _views(router, [0, 1]))
    assert moved.rank == 1
    router.load(0).update_stats(SchedulerStats(step_counter=2), 0)
    assert policy.choose(RouteRequest(10, "s"), _views(router, [0, 1])).rank == 1
    # A rank that is gone releases its sessions; without a session the inner policy decides.
    assert policy.choose(RouteRequest(10, "s"), _views(router, [0])).rank == 0
    assert policy.choose(RouteRequest(10), _views(router, [0, 1])).reason != "session"


def test_make_policy_knows_the_cli_names() -> None:
    for name in ("cache-aware", "least-loaded", "round-robin", "queue_length"):
        assert isinstance(make_policy(name), SessionAffinityPolicy)
    try:
        make_policy("random")
    except ValueError as e:
        assert "cache-aware" in str(e)
    else:
        raise AssertionError("an unknown policy name was accepted")


def test_make_policy_sets_the_cost_of_loading_an_adapter() -> None:
    """Rank 0 holds the adapter and has 300 tokens more to do: the default cost (512) keeps
    the request there; a cost of 0 sends it to the idler rank 1."""
    router = RequestRouter()
    router.load(0).update_stats(
        SchedulerStats(num_pending_prefill_tokens=300, lora_live=["sql"], max_loras=2), 0
    )
    router.load(1).update_stats(SchedulerStats(max_loras=2), 0)
    request = RouteRequest(100, lora_name="sql")
    views = [
        RankView(r, router.load(r), 0, 0, has_lora=router.load(r).holds_lora("sql")) for r in (0, 1)
    ]
    held = make_policy("cache-aware").choose(request, views)
    assert (held.rank, held.reason) == (0, "lora")
    assert make_policy("cache-aware", lora_load_cost=0).choose(request, views).rank == 1
    try:
        make_policy("cache-aware", lora_load_cost=-1)
    except ValueError as e:
        assert "lora_load_cost" in str(e)
    else:
        raise AssertionError("a negative cost was accepted")


def test_at_equal_cache_cache_aware_chooses_as_least_loaded_does() -> None:
    # No rank holds more of the prompt than another: the cache term is the same everywhere,
    # so both policies pick the same rank for every load (the bench's equal-cache target).
    rng = random.Random(5)
    router = RequestRouter()
    cache_aware, least_loaded = CacheAwarePolicy(), LeastLoadedPolicy()
    for i in range(2000):
        ranks = list(range(rng.randrange(2, 6)))
        for r in ranks:
            stats = SchedulerStats(
                num_pending_prefill_tokens=rng.choice([0, 0, rng.randrange(2000)]),
                num_running_reqs=rng.randrange(4),
                num_waiting_reqs=rng.randrange(3),
                num_cached_blocks=rng.randrange(50),
                step_counter=i + 1,
            )
            router.load(r).update_stats(stats, 0)
        shared = rng.choice([0, 0, 16 * rng.randrange(8)])
        views = [
            RankView(r, router.load(r), shared, router.load(r).stats.num_cached_blocks)  # type: ignore[union-attr]
            for r in ranks
        ]
        request = RouteRequest(rng.randrange(1, 1200))
        first, second = cache_aware.choose(request, views), least_loaded.choose(request, views)
        assert first.rank == second.rank, (i, views)
