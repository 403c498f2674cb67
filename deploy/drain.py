"""`shoal drain`: one rank (or every rank on one node) stops taking work, finishes or hands
over what it holds, and is restarted.

    shoal drain --namespace NS --rank R [--deadline-s S] [--no-restart] [--json]
    shoal drain --namespace NS --node-ip IP [--deadline-s S] [--no-restart] [--json]

`--node-ip` drains each serving rank whose engine runs at that address, one at a time: what
a Kubernetes worker pod's `preStop` hook runs (with `--no-restart`: the pod is about to end,
and Ray starts its ranks again on the node that replaces it). The drain itself is
`shoal.cluster.drain.drain`. Exit codes: 0 drained (or no rank on that node), 1 refused
(a resize runs) or failed, 2 no such serving rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

from shoal.cluster.drain import DRAIN_DEADLINE_S, DrainError, drain, ranks_on_node
from shoal.cluster.elastic import ScaleInProgressError
from shoal.cluster.launch import ClusterHandle
from shoal.deploy.ray_connection import add_ray_args, attach_cluster
from shoal.deploy.scale import describe_failure


def add_drain_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `shoal drain`."""
    add_ray_args(parser)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--rank", type=int, help="the rank to drain")
    which.add_argument(
        "--node-ip", help="drain every serving rank whose engine runs at this address"
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=DRAIN_DEADLINE_S,
        help="how long a rank's requests may take to finish before the rest are handed over "
        "to other ranks",
    )
    parser.add_argument(
        "--no-restart",
        action="store_true",
        help="leave the rank drained until its process ends with its node (a pod's preStop), "
        "instead of restarting it now and waiting until it serves again",
    )
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")


def run_command(args: argparse.Namespace) -> int:
    """Runs `shoal drain`. Returns the exit code (1: no cluster there)."""
    handle = attach_cluster("drain", args)
    return 1 if handle is None else run(handle, args)


def run(handle: ClusterHandle, args: argparse.Namespace) -> int:
    """Runs `shoal drain` on an attached cluster. Returns the exit code."""
    ranks = [args.rank] if args.rank is not None else ranks_on_node(handle, args.node_ip)
    if not ranks:
        print(f"no serving rank runs at {args.node_ip}: nothing to drain")
        return 0
    reports = []
    for rank in ranks:
        try:
            report = drain(
                handle,
                rank,
                deadline_s=args.deadline_s,
                restart=not args.no_restart,
                owner=f"{socket.gethostname()}:{os.getpid()} (drain {rank})",
            )
        except ValueError as e:
            print(f"shoal drain: {e}", file=sys.stderr)
            return 2
        except (ScaleInProgressError, DrainError) as e:
            print(f"shoal drain: {describe_failure(e)}", file=sys.stderr)
            return 1
        reports.append(report.as_dict())
        if not args.json:
            print(format_report(handle.namespace, reports[-1]))
    if args.json:
        print(json.dumps(reports, indent=2, sort_keys=True))
    return 0


def format_report(namespace: str, report: dict[str, object]) -> str:
    """One drain's report, in one line."""
    steps = report["steps"]
    assert isinstance(steps, dict)
    how = "its requests finished" if report["finished"] else "its requests were handed over"
    then = "restarted and serving" if report["restarted"] else "left drained"
    timings = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in steps.items())
    return f"drained rank {report['rank']} of namespace {namespace}: {how}; {then} ({timings})"
