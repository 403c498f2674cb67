"""`shoal serve --autoscale` without a cluster: its flags and their refusals, how `shoal status`
shows the autoscaler, and its series in `/metrics`."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shoal.cluster.autoscale_policy import REASONS, AutoscalerConfig
from shoal.deploy.autoscale import autoscaler_config, autoscaler_status_lines, launch_size
from shoal.deploy.cli import build_parser
from shoal.deploy.metrics import ServerMetrics


def _serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "/models/m", *flags])


def test_the_flags_make_the_policys_config() -> None:
    args = _serve_args(
        "--autoscale",
        "--min-data-parallel-size", "2",
        "--max-data-parallel-size", "6",
        "--autoscaling-config", '{"target_waiting_per_rank": 4, "scale_down_delay_s": 90}',
    )  # fmt: skip
    config = autoscaler_config(args)
    assert config == AutoscalerConfig(
        min_size=2, max_size=6, target_waiting_per_rank=4.0, scale_down_delay_s=90.0
    )
    assert autoscaler_config(_serve_args()) is None
    assert launch_size(config, 1) == 2 and launch_size(config, 3) == 3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--autoscale"], "--autoscale needs --max-data-parallel-size"),
        (["--autoscaling-config", "{}"], "--autoscaling-config needs --autoscale"),
        (["--autoscale", "--max-data-parallel-size", "2", "--min-data-parallel-size", "3"],
         "1 <= min <= max"),
        (["--autoscale", "--max-data-parallel-size", "2", "--autoscaling-config", "[1]"],
         "must be a JSON object"),
        (["--autoscale", "--max-data-parallel-size", "2", "--autoscaling-config", "{oops"],
         "is not JSON"),
        (["--autoscale", "--max-data-parallel-size", "2", "--autoscaling-config",
          '{"min_size": 1}'], "unknown keys ['min_size']"),
        (["--autoscale", "--max-data-parallel-size", "2", "--autoscaling-config",
          '{"cooldown_s": "10"}'], "must be numbers"),
        (["--autoscale", "--max-data-parallel-size", "2", "--autoscaling-config",
          '{"cooldown_s": -1}'], "must not be negative"),
    ],
)  # fmt: skip
def test_bad_autoscaling_flags_are_refused_in_one_line(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        autoscaler_config(_serve_args(*flags))


def test_a_launch_size_above_the_maximum_is_refused() -> None:
    with pytest.raises(ValueError, match="above --max-data-parallel-size 2"):
        launch_size(AutoscalerConfig(max_size=2), 3)


RECORD = {
    "min_size": 1,
    "max_size": 3,
    "desired_size": 2,
    "decisions_total": {"up/queue": 2, "down/idle": 1},
    "decisions": [
        {"at": 900.0, "direction": "up", "reason": "queue", "from_size": 1, "to_size": 2,
         "detail": "7.0 waiting per rank", "outcome": "committed"},
        {"at": 950.0, "direction": "down", "reason": "idle", "from_size": 2, "to_size": 1,
         "detail": "idle for 31 s", "outcome": "committed"},
        {"at": 990.0, "direction": "up", "reason": "queue", "from_size": 1, "to_size": 2,
         "detail": "3.0 waiting per rank", "outcome": ""},
    ],
}  # fmt: skip


def test_status_shows_the_bounds_the_wish_and_each_decision_with_its_reason() -> None:
    status = {"autoscaler": RECORD, "ranks": [{"state": "ready"}, {"state": "starting"}]}
    lines = autoscaler_status_lines(status, now=1000.0)
    assert lines[0] == (
        "autoscaler: 1..3 ranks, wants 2, 1 serving, 1 not serving (pending, restarting or leaving)"
    )
    assert lines[1] == "  100 s ago: up 1 → 2 (queue: 7.0 waiting per rank) committed"
    assert lines[2] == "  50 s ago: down 2 → 1 (idle: idle for 31 s) committed"
    assert lines[3] == "  10 s ago: up 1 → 2 (queue: 3.0 waiting per rank) running"
    assert autoscaler_status_lines({"autoscaler": None, "ranks": []}) == []


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def test_metrics_count_decisions_by_direction_and_reason_and_show_both_sizes() -> None:
    metrics = ServerMetrics("m", dict)
    assert not any(name.startswith("shoal:autoscaler") for name, _ in _samples(metrics))
    metrics.cluster.autoscaler = RECORD
    metrics.cluster.ranks_by_state = {"ready": 1, "starting": 1}
    samples = _samples(metrics)

    def decisions(direction: str, reason: str) -> float:
        labels = (("direction", direction), ("model_name", "m"), ("reason", reason))
        return samples[("shoal:autoscaler_decisions_total", labels)]

    assert decisions("up", "queue") == 2 and decisions("down", "idle") == 1
    assert decisions("up", "kv_cache") == 0  # every pair is there from the start
    assert len([n for n, _ in samples if n == "shoal:autoscaler_decisions_total"]) == len(REASONS)
    assert samples[("shoal:autoscaler_desired_size", (("model_name", "m"),))] == 2
    # A rank still starting is no capacity.
    assert samples[("shoal:autoscaler_current_size", (("model_name", "m"),))] == 1
