"""`RequestRouter` / `RankLoad`: a rank's load costs O(1) to read, whatever is in flight."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from shoal.client.routing.lb_policy import CacheAwarePolicy, RankView, RouteRequest, load_tokens
from shoal.client.routing.router import RequestRouter
from shoal.engine.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    SamplingParams,
    SchedulerStats,
)

NUM_REQUESTS = 100_000
WINDOW = 1000


def _count_calls(fn: Callable[[], None]) -> int:
    """Python-level calls (and generator resumptions) `fn` makes: a cost measure that does
    not depend on how loaded the machine is."""
    calls = 0

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_routing_cost_does_not_grow_with_the_requests_in_flight() -> None:
    """100,000 requests routed and left in flight (an n=100000 request, say): the last
    thousand cost as much as the first thousand."""
    router, policy = RequestRouter(), CacheAwarePolicy()
    ranks = [0, 1, 2, 3]
    sent = 0

    def route(num: int) -> None:
        nonlocal sent
        for _ in range(num):
            views = [RankView(r, router.load(r)) for r in ranks]
            rank = policy.choose(RouteRequest(64), views).rank
            router.on_sent(f"r{sent}", rank, 64)
            sent += 1
            if sent % 997 == 0:  # stats that include half the sends, now and then
                load = router.load(rank)
                load.update_stats(SchedulerStats(step_counter=sent), load.num_sent // 2)

    first = _count_calls(lambda: route(WINDOW))
    route(NUM_REQUESTS - 2 * WINDOW)
    last = _count_calls(lambda: route(WINDOW))
    assert len(router) == NUM_REQUESTS
    assert last <= first * 1.05, (first, last)
    # The sums are exact: each rank counts its unseen sends, no more.
    for r in ranks:
        load = router.load(r)
        unseen = sum(1 for e in load.in_flight.values() if e.seq >= load.requests_seen)
        assert load.num_unseen == unseen
        assert load_tokens(load, 0) == 64 * unseen


def _kept_request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id, prompt_token_ids=[1, 2], sampling_params=SamplingParams()
    )


def test_outputs_from_a_rank_a_request_left_are_dropped() -> None:
    """A failed rank's requests leave with the tokens seen; what it sends later is dropped,
    and the rank they moved to continues the same token list."""
    router = RequestRouter()
    router.on_sent("a", 0, 2, _kept_request("a"))
    router.on_sent("b", 1, 2, _kept_request("b"))
    assert router.on_outputs([EngineCoreOutput("a", new_token_ids=[5, 6])], 0) is None

    taken = router.take_rank(0)
    assert list(taken) == ["a"] and router.rank_of("a") is None
    assert router.load(0).num_unseen == 0
    resumed = taken["a"].resumed_request()
    assert resumed.resumed_output_token_ids == [5, 6]
    router.on_sent("a", 1, 2, resumed, num_migrations=1)

    late, fresh, other = (
        EngineCoreOutput("a", new_token_ids=[7]),
        EngineCoreOutput("a", new_token_ids=[8]),
        EngineCoreOutput("b", new_token_ids=[9]),
    )
    assert router.on_outputs([late], 0) == []
    assert router.on_outputs([fresh, other], 1) is None
    entry = router.load(1).in_flight["a"]
    assert entry.num_migrations == 1
    assert entry.resumed_request().resumed_output_token_ids == [5, 6, 8]
    assert router.on_outputs([other, EngineCoreOutput("gone")], 1) == [other]
