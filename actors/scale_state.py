"""What the registry keeps of resizes: the scale lock with its phase, the past scales, what
a starting rank is told about the set it serves in, and the autoscaler's decisions.

Plain dataclasses, saved with the registry's state (a registry that Ray restarts still holds
the lock of a scale in progress, until the scale ends or its lease runs out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.engine.config import EngineConfig
from shoal.engine.parallel.elastic import ScalePlan

# A scale whose driver stopped renewing it (it died) frees the lock after this long.
SCALE_LEASE_S = 120.0
# Past scales kept for `status` and the metrics.
SCALE_HISTORY = 32
# The autoscaler's last decisions kept for `status`.
AUTOSCALER_DECISIONS = 16


class ScaleInProgressError(RuntimeError):
    """A scale was asked for while another one holds the cluster's scale lock."""


@dataclass
class ScaleRecord:
    """The scale holding the lock.

    Phases: starting (new ranks start; old ones stage their experts) → switching (the ranks
    change sets) → finishing (leaving ranks are removed, clients are told) → gone; or
    rolling_back → gone.
    """

    epoch: int
    owner: str
    from_size: int
    to_size: int
    phase: str
    started_at: float
    renewed_at: float
    plan: ScalePlan | None = None
    new_ranks: list[int] = field(default_factory=list)


@dataclass
class ScaleEvent:
    """One finished scale: how it ended and how long it took."""

    epoch: int
    from_size: int
    to_size: int
    outcome: str  # "committed", "rolled_back", "unchanged" or "drained" (`shoal drain`)
    duration_s: float
    detail: str = ""
    finished_at: float = 0.0


@dataclass
class AutoscalerDecision:
    """One decision of the autoscaler to change the cluster's size.

    Attributes:
        at: when it was made (wall clock).
        direction: "up" or "down".
        reason: why (`shoal.cluster.autoscale_policy.REASONS`).
        from_size: the size it found.
        to_size: the size it asked for.
        detail: the load that decided it, in words.
        outcome: how the resize it asked for ended ("committed", "rolled_back", "refused"
            when another resize held the lock); empty while it runs.
    """

    at: float
    direction: str
    reason: str
    from_size: int
    to_size: int
    detail: str = ""
    outcome: str = ""


@dataclass
class AutoscalerRecord:
    """What the autoscaler shows (`shoal status`, the metrics), kept by the registry so
    that a restarted autoscaler goes on counting.

    Attributes:
        min_size: the fewest ranks it keeps.
        max_size: the most ranks it asks for.
        desired_size: the size it wants now.
        decisions_total: decisions by "direction/reason", since the cluster started.
        decisions: the last `AUTOSCALER_DECISIONS`, oldest first.
    """

    min_size: int
    max_size: int
    desired_size: int
    decisions_total: dict[str, int] = field(default_factory=dict)
    decisions: list[AutoscalerDecision] = field(default_factory=list)


@dataclass
class ResizeState:
    """What the registry's resizes part keeps (saved with the rest of the registry's state).

    Attributes:
        scale: the resize holding the scale lock (None: no resize runs).
        scale_epoch: the last resize epoch handed out.
        ep_group_name: the rendezvous prefix of the current set's groups (None: the namespace).
        ep_placement: the current set's expert -> rank table, under expert parallelism.
        scale_history: the past resizes, oldest first (at most `SCALE_HISTORY`).
        launch_options: how the launch started its ranks, so that a resize starts them alike
            (`shoal.cluster.launch.LaunchOptions.as_dict`).
        autoscaler: what the autoscaler shows (None: the cluster has none).
    """

    scale: ScaleRecord | None = None
    scale_epoch: int = 0
    ep_group_name: str | None = None
    ep_placement: list[int] | None = None
    scale_history: list[ScaleEvent] = field(default_factory=list)
    launch_options: dict[str, Any] = field(default_factory=dict)
    autoscaler: AutoscalerRecord | None = None


@dataclass(frozen=True)
class EngineStart:
    """What a starting rank needs from the registry.

    Attributes:
        config: the configuration to build the engine with (its data-parallel size is the
            size of the set the rank joins).
        group_name: the rendezvous prefix of that set's process groups.
        joining: the resize the rank was started for, while it has not committed: the rank
            joins the new set's groups as the old ranks switch.
    """

    config: EngineConfig
    group_name: str
    joining: ScalePlan | None = None
