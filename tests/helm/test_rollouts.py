"""The chart's rollouts and autoscaling: a deleted worker pod drains its ranks in its preStop
hook (a `shoal drain` that the CLI parses), its grace period covers the drain's deadline, and
`autoscaling` turns on `shoal serve --autoscale` with flags that `shoal serve` parses."""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest

from shoal.deploy.autoscale import autoscaler_config
from shoal.deploy.cli import build_parser
from tests.helm.rendering import OVERRIDES, render, render_error, render_values


def _worker_pod(values: dict[str, Any]) -> dict[str, Any]:
    (group,) = render_values(values).worker_groups().values()
    return dict(group["template"]["spec"])


def test_a_deleted_worker_pod_drains_its_ranks_first() -> None:
    pod = _worker_pod({})
    (container,) = pod["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/bash", "-c"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    words = shlex.split(command[2].replace('"$POD_IP"', "10.0.0.7"))
    assert words[:2] == ["shoal", "drain"]
    args = build_parser().parse_args(words[1:])
    assert (args.namespace, args.node_ip, args.no_restart) == ("shoal", "10.0.0.7", True)
    assert args.deadline_s == 30
    # The pod is killed only after the drain's deadline and its hand-over.
    assert pod["terminationGracePeriodSeconds"] == 60


def test_the_drain_deadline_sets_the_grace_period_and_drain_can_be_off() -> None:
    pod = _worker_pod({"drain": {"deadlineSeconds": 300}})
    assert pod["terminationGracePeriodSeconds"] == 330
    assert "--deadline-s 300" in pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][2]
    pod = _worker_pod({"drain": {"enabled": False}})
    assert "lifecycle" not in pod["containers"][0] and "terminationGracePeriodSeconds" not in pod
    assert "env" not in pod["containers"][0]


def test_autoscaling_serves_with_the_autoscaler_between_its_bounds() -> None:
    values = {
        **OVERRIDES["autoscaling"],
        "autoscaling": {
            "enabled": True,
            "minDataParallelSize": 2,
            "config": {"scale_down_delay_s": 120, "target_waiting_per_rank": 4},
        },
    }
    argv = render_values(values).serve_argv()
    args = build_parser().parse_args(argv[1:])  # argv is "shoal serve ..."

    config = autoscaler_config(args)
    assert config is not None
    assert (config.min_size, config.max_size) == (2, 8)  # the groups' 8 pods at maxReplicas
    assert (config.scale_down_delay_s, config.target_waiting_per_rank) == (120.0, 4.0)
    assert argv.count("--max-data-parallel-size") == 1
    explicit = {**values, "autoscaling": {"enabled": True, "maxDataParallelSize": 3}}
    argv = render_values(explicit).serve_argv()
    assert argv[argv.index("--max-data-parallel-size") + 1] == "3"
    assert "--autoscaling-config" not in argv
    assert "--autoscale" not in render("defaults").serve_argv()
    assert json.loads(json.dumps(values["autoscaling"]["config"])) == {
        "scale_down_delay_s": 120,
        "target_waiting_per_rank": 4,
    }


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"autoscaling": {"enabled": True}}, "autoscaling.enabled needs"),
        ({"autoscaling": {"enabled": True, "minDataParallelSize": 0}}, "minimum"),
        ({"drain": {"deadlineSeconds": -1}}, "minimum"),
        ({"drain": {"deadline": 30}}, "deadline"),
    ],
)
def test_bad_autoscaling_and_drain_values_are_refused(values: dict[str, Any], message: str) -> None:
    assert message in render_error(values)
