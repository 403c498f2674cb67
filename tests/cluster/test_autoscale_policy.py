"""The autoscaling policy alone, on synthetic load sequences: it follows bursts, holds through
noise, never flaps, stays within its bounds and keeps its cool-down."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable

import pytest

from shoal.cluster.autoscale_policy import (
    REASONS,
    AutoscalerConfig,
    ClusterLoad,
    Decision,
    PolicyState,
    RankLoad,
    decide,
)

CONFIG = AutoscalerConfig(
    min_size=1,
    max_size=4,
    target_waiting_per_rank=2.0,
    target_pending_prefill_tokens_per_rank=1000.0,
    scale_up_delay_s=3.0,
    scale_down_delay_s=30.0,
    cooldown_s=10.0,
)
# How long a simulated resize takes (the policy holds meanwhile).
RESIZE_S = 5.0


def busy(waiting: int = 0, running: int = 4, prefill: int = 0, kv: float = 0.3) -> RankLoad:
    return RankLoad(waiting, running, prefill, kv)


IDLE = RankLoad(0, 0, 0, 0.0)

# total load at time t -> the load of each of `size` ranks (the router spreads it evenly)
Workload = Callable[[float], tuple[int, int, int]]


def spread(total: tuple[int, int, int], size: int) -> tuple[RankLoad, ...]:
    waiting, running, prefill = total
    return tuple(
        RankLoad(waiting // size, running // size, prefill // size, min(1.0, 0.05 * running / size))
        for _ in range(size)
    )


def simulate(
    workload: Workload, config: AutoscalerConfig = CONFIG, seconds: float = 600.0, size: int = 1
) -> list[tuple[float, Decision]]:
    """Runs the policy once a second over `workload`, applying each resize (which takes
    `RESIZE_S`, then starts the cool-down). Returns every decision that changed the size."""
    state = PolicyState()
    resizing_until = None
    changes = []
    for tick in range(int(seconds)):
        now = float(tick)
        if resizing_until is not None and now >= resizing_until:
            resizing_until = None
            state = state.after_resize(now, config.cooldown_s)
        load = ClusterLoad(now, size, spread(workload(now), size), resizing_until is not None)
        decision, state = decide(config, state, load)
        assert config.min_size <= decision.desired_size <= config.max_size or (
            decision.reason in ("below_min", "above_max")
        )
        if decision.desired_size != size:
            assert resizing_until is None, "a decision while a resize runs"
            changes.append((now, decision))
            size = decision.desired_size
            resizing_until = now + RESIZE_S
    return changes


def sizes(changes: Iterable[tuple[float, Decision]]) -> list[int]:
    return [d.desired_size for _, d in changes]


def test_a_burst_grows_the_cluster_and_idle_shrinks_it_one_rank_at_a_time() -> None:
    def burst(t: float) -> tuple[int, int, int]:
        return (40, 16, 4000) if 60 <= t < 180 else (0, 0, 0)

    changes = simulate(burst)
    ups = [(t, d) for t, d in changes if d.direction == "up"]
    downs = [(t, d) for t, d in changes if d.direction == "down"]
    assert ups and ups[0][0] >= 60 + CONFIG.scale_up_delay_s
    assert max(sizes(changes)) == CONFIG.max_size
    assert all(d.reason in ("queue", "prefill") for _, d in ups)
    # Down: one rank per decision, each after a full idle stretch, ending at the minimum.
    assert [d.desired_size for _, d in downs] == [3, 2, 1]
    assert all(d.reason == "idle" for _, d in downs)
    assert downs[0][0] >= 180 + CONFIG.scale_down_delay_s
    for (t1, _), (t2, _) in itertools.pairwise(downs):
        assert t2 - t1 >= RESIZE_S + CONFIG.cooldown_s + CONFIG.scale_down_delay_s


def test_a_scale_up_jumps_by_the_pressure_ratio_within_max() -> None:
    load = ClusterLoad(10.0, 1, (busy(waiting=7),))
    state = PolicyState(pressure_since=0.0)
    decision, _ = decide(CONFIG, state, load)
    assert (decision.desired_size, decision.reason) == (4, "queue")  # ceil(1 * 7/2), at most 4
    decision, _ = decide(CONFIG, state, ClusterLoad(10.0, 2, (busy(waiting=3),) * 2))
    assert decision.desired_size == 3  # ceil(2 * 1.5)
    decision, _ = decide(CONFIG, state, ClusterLoad(10.0, 4, (busy(waiting=9),) * 4))
    assert decision.desired_size == 4 and decision.direction == "none"


@pytest.mark.parametrize(
    ("rank", "reason"),
    [
        (busy(waiting=3), "queue"),
        (busy(prefill=1500), "prefill"),
        (busy(kv=0.95), "kv_cache"),
    ],
)
def test_each_signal_alone_scales_up_and_is_named(rank: RankLoad, reason: str) -> None:
    state = PolicyState()
    for now in (0.0, 1.0, 2.0):
        decision, state = decide(CONFIG, state, ClusterLoad(now, 1, (rank,)))
        assert decision.direction == "none"
    decision, state = decide(CONFIG, state, ClusterLoad(3.0, 1, (rank,)))
    assert decision.direction == "up" and decision.reason == reason and decision.detail


def test_short_spikes_under_the_up_delay_never_scale() -> None:
    def spikes(t: float) -> tuple[int, int, int]:
        return (20, 8, 2000) if t % 10 < 2 else (0, 2, 0)  # 2 s of pressure in every 10

    assert simulate(spikes, seconds=300) == []


def test_a_load_at_the_threshold_with_noise_never_flaps() -> None:
    """A noisy load around the scale-up target: the cluster may grow, but it never
    shrinks again while the load stays, and it never resizes back and forth."""
    rng = random.Random(7)

    def noisy(t: float) -> tuple[int, int, int]:
        return (rng.randint(0, 5), rng.randint(4, 10), rng.randint(0, 1200))

    changes = simulate(noisy, seconds=900)
    assert changes, "the load over target never grew the cluster"
    directions = [d.direction for _, d in changes]
    assert "down" not in directions, changes
    assert len(changes) <= CONFIG.max_size - 1


def test_an_oscillating_load_does_not_flap() -> None:
    """Load that swings between a burst and idle every 40 s: every scale-down needs 30 s of
    idle, so no resize is undone by the next one within the cool-down."""

    def swing(t: float) -> tuple[int, int, int]:
        return (12, 8, 3000) if (t // 40) % 2 == 0 else (0, 0, 0)

    changes = simulate(swing, seconds=1200)
    # At most one scale-down per idle phase of 40 s (one rank at a time, 30 s idle each).
    downs = [t for t, d in changes if d.direction == "down"]
    assert downs and len({t // 80 for t in downs}) == len(downs)
    for (t1, d1), (t2, d2) in itertools.pairwise(changes):
        assert t2 - t1 >= RESIZE_S + CONFIG.cooldown_s
        if d1.direction != d2.direction:
            assert t2 - t1 >= RESIZE_S + CONFIG.cooldown_s + CONFIG.scale_up_delay_s


def test_nothing_is_decided_during_a_resize_or_the_cool_down() -> None:
    pressure = ClusterLoad(100.0, 1, (busy(waiting=9),))
    state = PolicyState(pressure_since=0.0)
    resizing = ClusterLoad(100.0, 1, (busy(waiting=9),), is_resizing=True)
    assert decide(CONFIG, state, resizing)[0].direction == "none"
    cooling = state.after_resize(95.0, CONFIG.cooldown_s)
    decision, cooling = decide(CONFIG, cooling, pressure)
    assert decision.direction == "none" and cooling.pressure_since is None
    # After the cool-down the pressure has to last its delay again.
    decision, cooling = decide(CONFIG, cooling, ClusterLoad(105.0, 1, (busy(waiting=9),)))
    assert decision.direction == "none"
    decision, _ = decide(CONFIG, cooling, ClusterLoad(108.0, 1, (busy(waiting=9),)))
    assert decision.direction == "up"


def test_bounds_win_at_once_and_ignore_the_cool_down() -> None:
    held = PolicyState(hold_until=1e9)
    decision, _ = decide(CONFIG, held, ClusterLoad(0.0, 0, ()))
    assert (decision.desired_size, decision.reason) == (1, "below_min")
    decision, _ = decide(CONFIG, held, ClusterLoad(0.0, 6, (IDLE,) * 6))
    assert (decision.desired_size, decision.reason) == (4, "above_max")


def test_never_below_min_never_above_max() -> None:
    config = AutoscalerConfig(min_size=2, max_size=3, scale_down_delay_s=5.0, cooldown_s=1.0)
    rng = random.Random(3)

    def wild(t: float) -> tuple[int, int, int]:
        return rng.choice([(0, 0, 0), (50, 30, 9000), (1, 3, 100)])

    for _, decision in simulate(wild, config, seconds=600, size=2):
        assert 2 <= decision.desired_size <= 3


def test_ranks_not_serving_are_no_capacity() -> None:
    """One of two ranks still starting: the mean is over the serving rank only, so its queue
    counts in full; and a cluster whose ranks all start decides nothing."""
    state = PolicyState(pressure_since=0.0)
    decision, _ = decide(CONFIG, state, ClusterLoad(10.0, 2, (busy(waiting=5),)))
    assert decision.direction == "up" and decision.desired_size == 3  # ceil(2 * 5/2)
    decision, _ = decide(CONFIG, state, ClusterLoad(10.0, 2, ()))
    assert decision.direction == "none"


def test_idle_needs_one_rank_fewer_to_stay_under_half_the_targets() -> None:
    """Two ranks each running 1: one rank would run 2 (at `idle_running_per_rank`): idle.
    Each running 2 would put 4 on one rank: not idle. Anything waiting: not idle."""
    state = PolicyState(idle_since=0.0)
    assert decide(CONFIG, state, ClusterLoad(40.0, 2, (busy(running=1, kv=0.1),) * 2))[0] == (
        Decision(1, "down", "idle", "idle for 40 s")
    )
    assert decide(CONFIG, state, ClusterLoad(40.0, 2, (busy(running=2, kv=0.1),) * 2))[0] == (
        Decision(2)
    )
    waiting = (busy(waiting=1, running=0, kv=0.0), IDLE)
    assert decide(CONFIG, state, ClusterLoad(40.0, 2, waiting))[0] == Decision(2)


def test_every_reason_is_named() -> None:
    assert set(REASONS) == {"below_min", "above_max", "queue", "prefill", "kv_cache", "idle"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_size": 0, "max_size": 2},
        {"min_size": 3, "max_size": 2},
        {"max_kv_cache_usage": 1.5},
        {"target_waiting_per_rank": 0},
        {"scale_down_delay_s": -1},
    ],
)
def test_a_bad_config_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AutoscalerConfig(**{"max_size": 2, **kwargs})  # type: ignore[arg-type]
