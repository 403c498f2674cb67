"""`RequestRouter` / `RankLoad`: a rank's load costs O(1) to read, whatever is in flight."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from shoal.client.lb_policy import CacheAwarePolicy, RankView, RouteRequest, load_tokens
from shoal.client.routing import RequestRouter
from shoal.engine.protocol import SchedulerStats

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
