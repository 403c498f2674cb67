"""`shoal scale`: resize a running cluster while it serves, and how `shoal status` shows resizes.

    shoal scale --namespace NS --data-parallel-size M [--switch-timeout-s S] [--json]

The resize itself is `shoal.cluster.elastic.scale`, run from this process. The ranks it adds
are started as the launch started its ranks, by the cluster's owner actor, so they live as long
as the cluster although this process exits right after.
Exit codes: 0 done (or nothing to do), 1 refused or rolled back, 2 a size the model cannot be
served at.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from typing import Any

from shoal.cluster.elastic import SWITCH_TIMEOUT_S, ScaleError, ScaleInProgressError, scale
from shoal.deploy.ray_connection import add_ray_args, attach_cluster

logger = logging.getLogger("shoal.scale")

# How many past resizes `shoal status` lists.
NUM_STATUS_SCALES = 5


def add_scale_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `shoal scale`."""
    add_ray_args(parser)
    parser.add_argument(
        "--data-parallel-size", type=int, required=True, help="the number of ranks after the resize"
    )
    parser.add_argument(
        "--switch-timeout-s",
        type=_positive_float,
        default=SWITCH_TIMEOUT_S,
        help=f"how long the new set may take to form before the resize is rolled back "
        f"(default {SWITCH_TIMEOUT_S:.0f})",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def run(args: argparse.Namespace) -> int:
    """Runs `shoal scale`. Returns the exit code."""
    handle = attach_cluster("scale", args)
    if handle is None:
        return 1
    logger.info(
        "resizing namespace %s to %d ranks (each phase is logged as it starts)",
        handle.namespace,
        args.data_parallel_size,
    )
    try:
        report = scale(
            handle,
            args.data_parallel_size,
            owner=f"{socket.gethostname()}:{os.getpid()}",
            switch_timeout_s=args.switch_timeout_s,
        )
    except ValueError as e:
        print(f"shoal scale: {describe_failure(e)}", file=sys.stderr)
        return 2
    except (ScaleInProgressError, ScaleError) as e:
        print(f"shoal scale: {describe_failure(e)}", file=sys.stderr)
        return 1
    result = report.as_dict()
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(format_report(handle.namespace, result))
    return 0


def describe_failure(e: BaseException) -> str:
    """One line saying why a resize was refused or failed: a Ray error's own cause, not the
    remote traceback around it."""
    cause = getattr(e, "cause", None)
    lines = [line.strip() for line in str(cause or e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    if isinstance(e, ScaleError) and "rolled back" not in lines[0]:
        lines[0] = f"rolled back: {lines[0]}"
    # A remote error nested in the message ends with the line that names it.
    return lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1]}"


def format_report(namespace: str, report: dict[str, Any]) -> str:
    """A resize's report, in one line."""
    if report["outcome"] == "unchanged":
        return (
            f"namespace {namespace} has {report['to_size']} ranks already: nothing to do "
            f"(epoch {report['epoch']})"
        )
    phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in report["phases"].items())
    return (
        f"scaled namespace {namespace} from {report['from_size']} to {report['to_size']} ranks "
        f"in {report['total_s']:.2f} s (epoch {report['epoch']}): {phases}"
    )


def scale_status_lines(status: dict[str, Any], now: float | None = None) -> list[str]:
    """`shoal status`'s lines about resizes: the one running, then the last few (nothing when
    the cluster was never resized)."""
    now = time.time() if now is None else now
    lines = []
    scaling = status.get("scaling")
    if scaling is not None:
        lines.append(
            f"scaling: {scaling['from_size']} → {scaling['target_size']} ranks, phase "
            f"{scaling['phase']}, for {scaling['running_s']:.0f} s (epoch {scaling['epoch']}, "
            f"by {scaling['owner'] or '?'})"
        )
    history = status.get("scale_history") or []
    if history:
        shown = history[-NUM_STATUS_SCALES:]
        lines.append(f"scales (the last {len(shown)}):")
        for event in shown:
            detail = f"  ({event['detail']})" if event.get("detail") else ""
            lines.append(
                f"  epoch {event['epoch']}: {event['from_size']} → {event['to_size']} ranks "
                f"{event['outcome']} in {event['duration_s']:.1f} s, "
                f"{now - event['finished_at']:.0f} s ago{detail}"
            )
    return [*lines, ""] if lines else []
