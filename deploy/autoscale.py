"""`shoal serve --autoscale`: its flags, the policy's configuration from them, and how `shoal
status` shows the autoscaler.

    shoal serve MODEL --autoscale --min-data-parallel-size 1 --max-data-parallel-size 4 \\
        [--autoscaling-config '{"target_waiting_per_rank": 2, "scale_down_delay_s": 30}']

The policy is `shoal.cluster.autoscale_policy`; the actor that applies it,
`shoal.cluster.autoscaler`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from shoal.cluster.autoscale_policy import AutoscalerConfig

# The policy's fields that `--autoscaling-config` may set (the bounds have flags of their own).
TUNABLE_FIELDS = tuple(
    f.name for f in dataclasses.fields(AutoscalerConfig) if f.name not in ("min_size", "max_size")
)
# How many of the autoscaler's last decisions `shoal status` lists.
NUM_STATUS_DECISIONS = 5


def add_autoscale_args(parser: argparse.ArgumentParser) -> None:
    """`--autoscale`, `--min-data-parallel-size`, `--autoscaling-config` (the maximum is
    `--max-data-parallel-size`, which also bounds POST /scale_elastic_ep)."""
    group = parser.add_argument_group("autoscaling")
    group.add_argument(
        "--autoscale",
        action="store_true",
        help="size the cluster by its load between --min-data-parallel-size and "
        "--max-data-parallel-size ranks",
    )
    group.add_argument(
        "--min-data-parallel-size",
        type=int,
        default=1,
        help="the fewest ranks the autoscaler keeps (and the size it starts at, if larger "
        "than --data-parallel-size)",
    )
    group.add_argument(
        "--autoscaling-config",
        default=None,
        metavar="JSON",
        help="the autoscaling policy's targets and clocks as a JSON object, keys "
        + ", ".join(TUNABLE_FIELDS)
        + " (defaults: "
        + ", ".join(f"{k} {getattr(AutoscalerConfig(), k):g}" for k in TUNABLE_FIELDS)
        + ")",
    )


def autoscaler_config(args: argparse.Namespace) -> AutoscalerConfig | None:
    """The policy's configuration of `shoal serve`'s flags (None without `--autoscale`).

    Raises:
        ValueError: `--autoscale` without `--max-data-parallel-size`, an unknown or bad
            `--autoscaling-config` key, or bounds that do not hold.
    """
    if not args.autoscale:
        if args.autoscaling_config is not None:
            raise ValueError("--autoscaling-config needs --autoscale")
        return None
    if args.max_data_parallel_size is None:
        raise ValueError("--autoscale needs --max-data-parallel-size (the most ranks it asks for)")
    tunables = _tunables(args.autoscaling_config)
    return AutoscalerConfig(
        min_size=args.min_data_parallel_size, max_size=args.max_data_parallel_size, **tunables
    )


def _tunables(text: str | None) -> dict[str, float]:
    if text is None:
        return {}
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--autoscaling-config is not JSON: {e}") from e
    if not isinstance(values, dict):
        raise ValueError("--autoscaling-config must be a JSON object")
    unknown = sorted(set(values) - set(TUNABLE_FIELDS))
    if unknown:
        raise ValueError(
            f"--autoscaling-config: unknown keys {unknown} (known: {', '.join(TUNABLE_FIELDS)})"
        )
    bad = [k for k, v in values.items() if isinstance(v, bool) or not isinstance(v, int | float)]
    if bad:
        raise ValueError(f"--autoscaling-config: {bad} must be numbers")
    return {k: float(v) for k, v in values.items()}


def launch_size(config: AutoscalerConfig, data_parallel_size: int) -> int:
    """The size an autoscaled cluster starts at: `--data-parallel-size`, raised to the minimum.

    Raises:
        ValueError: a size above the maximum.
    """
    if data_parallel_size > config.max_size:
        raise ValueError(
            f"--data-parallel-size {data_parallel_size} is above --max-data-parallel-size "
            f"{config.max_size}"
        )
    return max(data_parallel_size, config.min_size)


def autoscaler_status_lines(status: dict[str, Any], now: float | None = None) -> list[str]:
    """`shoal status`'s lines about the autoscaler (nothing for a cluster without one): its
    bounds, the size it wants against the ranks that serve and those pending, its last
    decisions with their reasons and outcomes."""
    record = status.get("autoscaler")
    if record is None:
        return []
    now = time.time() if now is None else now
    states = [rank["state"] for rank in status["ranks"]]
    serving = states.count("ready")
    pending = len(states) - serving
    lines = [
        f"autoscaler: {record['min_size']}..{record['max_size']} ranks, wants "
        f"{record['desired_size']}, {serving} serving"
        + (f", {pending} not serving (pending, restarting or leaving)" if pending else "")
    ]
    for entry in record["decisions"][-NUM_STATUS_DECISIONS:]:
        outcome = entry["outcome"] or "running"
        lines.append(
            f"  {now - entry['at']:.0f} s ago: {entry['direction']} {entry['from_size']} → "
            f"{entry['to_size']} ({entry['reason']}: {entry['detail']}) {outcome}"
        )
    return [*lines, ""]
