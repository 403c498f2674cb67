"""The autoscaling policy: a pure function from the cluster's load to the size it should have.

    decide(config, state, load) -> (Decision, state)

The load is what the ranks already publish through the coordinator (per serving rank: waiting
and running requests, pending prefill tokens, KV use); the state is three clocks. Called
about once a second; each call is one of these, in this order:

1. **Bounds.** A committed size below `min_size` goes up to it ("below_min"), one above
   `max_size` down to it ("above_max"), at once: bounds are not load.
2. **Hold.** While a resize runs, and for `cooldown_s` after one ends, nothing is decided
   and the clocks below stop: ranks that are still starting are no capacity, and the load a
   resize is meant to move has not moved yet.
3. **Pressure.** Per serving rank, the mean waiting requests, the mean pending prefill
   tokens and the mean KV use, each over its target (`target_waiting_per_rank`,
   `target_pending_prefill_tokens_per_rank`, `max_kv_cache_usage`). If any is over, without a
   break, for `scale_up_delay_s`: up to ceil(serving ranks * the largest ratio) (the ranks
   that would hold this load at target), at least one rank more, at most `max_size`
   (reason "queue", "prefill" or "kv_cache": the largest ratio's).
   A break (one tick under every target) restarts the clock.
4. **Idle.** The cluster is idle when nothing waits and what it holds would still sit
   under half of every target on one rank fewer: its running requests under
   `idle_running_per_rank` each, its pending prefill tokens under half the target each, its
   KV use under half the limit. Idle without a break for `scale_down_delay_s`: down by one
   rank ("idle"). One rank at a time: the next one needs the cool-down and a new idle stretch.
5. Otherwise the size stays ("steady").

Hysteresis: a size that scale-down reaches carries the same load at most at half of each
up-target, so a scale-up cannot follow from the load that allowed the scale-down; and
scale-down waits far longer than scale-up. Pure: no clock, no I/O; `load.now` is the time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

Direction = Literal["up", "down", "none"]
# Why a size was chosen, and the direction each reason resizes in, as counted in
# `shoal:autoscaler_decisions_total{direction,reason}`.
DIRECTION_OF_REASON: dict[str, Direction] = {
    "below_min": "up",
    "queue": "up",
    "prefill": "up",
    "kv_cache": "up",
    "above_max": "down",
    "idle": "down",
}
REASONS = tuple(DIRECTION_OF_REASON)


@dataclass(frozen=True)
class AutoscalerConfig:
    """The policy's bounds, targets and clocks (`shoal serve --autoscaling-config` JSON keys).

    Attributes:
        min_size: the fewest ranks (`--min-data-parallel-size`).
        max_size: the most ranks (`--max-data-parallel-size`).
        target_waiting_per_rank: mean requests waiting per serving rank above which the
            cluster is short of ranks.
        target_pending_prefill_tokens_per_rank: mean prompt tokens waiting for prefill per
            serving rank above which it is short (what a new request queues behind).
        max_kv_cache_usage: mean KV use (0..1) above which it is short.
        idle_running_per_rank: running requests per rank under which one rank fewer is idle.
        scale_up_delay_s: how long the pressure must last before a scale-up.
        scale_down_delay_s: how long idle must last before a scale-down.
        cooldown_s: nothing is decided for this long after a resize ends.
        interval_s: how often the autoscaler reads the load and decides.
    """

    min_size: int = 1
    max_size: int = 1
    target_waiting_per_rank: float = 2.0
    target_pending_prefill_tokens_per_rank: float = 2048.0
    max_kv_cache_usage: float = 0.9
    idle_running_per_rank: float = 2.0
    scale_up_delay_s: float = 3.0
    scale_down_delay_s: float = 30.0
    cooldown_s: float = 10.0
    interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_size <= self.max_size:
            raise ValueError(
                f"the autoscaler needs 1 <= min <= max data-parallel size, not "
                f"{self.min_size}..{self.max_size}"
            )
        targets = (
            self.target_waiting_per_rank,
            self.target_pending_prefill_tokens_per_rank,
            self.max_kv_cache_usage,
            self.interval_s,
        )
        if min(targets) <= 0 or self.max_kv_cache_usage > 1:
            raise ValueError(f"autoscaler targets must be positive (KV use at most 1): {self}")
        clocks = (self.scale_up_delay_s, self.scale_down_delay_s, self.cooldown_s)
        if min(clocks) < 0 or self.idle_running_per_rank < 0:
            raise ValueError(f"autoscaler delays must not be negative: {self}")


@dataclass(frozen=True)
class RankLoad:
    """One serving rank's latest published load (`SchedulerStats` fields)."""

    num_waiting_reqs: int = 0
    num_running_reqs: int = 0
    num_pending_prefill_tokens: int = 0
    kv_cache_usage: float = 0.0


@dataclass(frozen=True)
class ClusterLoad:
    """What one decision reads.

    Attributes:
        now: the time (seconds, any monotonic origin).
        size: the committed number of ranks (serving, starting or restarting).
        ranks: the load of each serving rank; a rank still starting (pending a node, say) or
            restarting is no capacity and is not here.
        is_resizing: a resize holds the cluster's scale lock.
    """

    now: float
    size: int
    ranks: tuple[RankLoad, ...] = ()
    is_resizing: bool = False


@dataclass(frozen=True)
class PolicyState:
    """The policy's clocks: since when the pressure (or idle) has lasted, and until when
    the cool-down holds."""

    pressure_since: float | None = None
    idle_since: float | None = None
    hold_until: float = float("-inf")

    def after_resize(self, now: float, cooldown_s: float) -> PolicyState:
        """A resize ended at `now`: the cool-down starts and both clocks stop."""
        return PolicyState(None, None, now + cooldown_s)


@dataclass(frozen=True)
class Decision:
    """The size the cluster should have, and why."""

    desired_size: int
    direction: Direction = "none"
    reason: str = "steady"
    detail: str = ""


def decide(
    config: AutoscalerConfig, state: PolicyState, load: ClusterLoad
) -> tuple[Decision, PolicyState]:
    """One decision (the module docstring is the algorithm).

    Returns:
        The decision and the policy's next state; a decision to resize starts no cool-down
        by itself: the caller reports the resize's end with `PolicyState.after_resize`.
    """
    size = load.size
    if size < config.min_size:
        return Decision(config.min_size, "up", "below_min", f"{size} < {config.min_size}"), state
    if size > config.max_size:
        return Decision(config.max_size, "down", "above_max", f"{size} > {config.max_size}"), state
    if load.is_resizing or load.now < state.hold_until or not load.ranks:
        return Decision(size), replace(state, pressure_since=None, idle_since=None)
    pressure = _pressure(config, load)
    if pressure is not None:
        reason, ratio, detail = pressure
        since = load.now if state.pressure_since is None else state.pressure_since
        state = PolicyState(since, None, state.hold_until)
        if load.now - since < config.scale_up_delay_s or size >= config.max_size:
            return Decision(size), state
        # The serving ranks' load at target needs ceil(serving * ratio) ranks.
        needed = math.ceil(len(load.ranks) * ratio)
        desired = min(config.max_size, max(size + 1, needed))
        return Decision(desired, "up", reason, detail), state
    if _is_idle(config, load) and size > config.min_size:
        since = load.now if state.idle_since is None else state.idle_since
        state = PolicyState(None, since, state.hold_until)
        if load.now - since < config.scale_down_delay_s:
            return Decision(size), state
        idle_s = load.now - since
        return Decision(size - 1, "down", "idle", f"idle for {idle_s:.0f} s"), state
    return Decision(size), PolicyState(None, None, state.hold_until)


def _means(load: ClusterLoad) -> tuple[float, float, float, float]:
    """Per serving rank: mean waiting, running, pending prefill tokens and KV use."""
    n = len(load.ranks)
    return (
        sum(r.num_waiting_reqs for r in load.ranks) / n,
        sum(r.num_running_reqs for r in load.ranks) / n,
        sum(r.num_pending_prefill_tokens for r in load.ranks) / n,
        sum(r.kv_cache_usage for r in load.ranks) / n,
    )


def _pressure(config: AutoscalerConfig, load: ClusterLoad) -> tuple[str, float, str] | None:
    """The largest of the load's ratios to its targets, when one is over 1: (reason, ratio,
    detail); None when every ratio is at most 1."""
    waiting, _, prefill, kv = _means(load)
    ratios = [
        ("queue", waiting / config.target_waiting_per_rank, f"{waiting:.1f} waiting per rank"),
        (
            "prefill",
            prefill / config.target_pending_prefill_tokens_per_rank,
            f"{prefill:.0f} prefill tokens pending per rank",
        ),
        ("kv_cache", kv / config.max_kv_cache_usage, f"KV cache {100 * kv:.0f}% used"),
    ]
    reason, ratio, detail = max(ratios, key=lambda r: r[1])
    return (reason, ratio, detail) if ratio > 1.0 else None


def _is_idle(config: AutoscalerConfig, load: ClusterLoad) -> bool:
    """Nothing waits, and the load on one serving rank fewer stays under half of every
    target (and under `idle_running_per_rank` running requests a rank)."""
    n = len(load.ranks)
    if n < 2 or any(r.num_waiting_reqs for r in load.ranks):
        return False
    _, running, prefill, kv = _means(load)
    fewer = n / (n - 1)  # what each of n - 1 ranks would hold
    return (
        running * fewer <= config.idle_running_per_rank
        and prefill * fewer <= config.target_pending_prefill_tokens_per_rank / 2
        and kv * fewer <= config.max_kv_cache_usage / 2
    )
