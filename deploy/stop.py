"""`shoal stop`: tear a cluster down, through the process that serves it when there is one.

    shoal stop --namespace NS [--timeout S]

A cluster served by `shoal serve` (launching or serving: the registry names its process from
the launch's first step) is asked to stop, and that process tears it down and exits 0; this
command waits for it, then checks that nothing is left. A detached cluster, or one whose
server does not finish within the timeout, is torn down from here.
"""

from __future__ import annotations

import argparse
import logging
import time

import ray

from shoal.cluster.launch import ClusterHandle
from shoal.deploy.ray_connection import add_ray_args, attach_cluster

logger = logging.getLogger("shoal")

STOP_TIMEOUT_S = 60.0


def add_stop_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `shoal stop`."""
    add_ray_args(parser)
    parser.add_argument(
        "--timeout",
        type=float,
        default=STOP_TIMEOUT_S,
        help="how long to wait for the serving process before tearing down directly",
    )


def run(args: argparse.Namespace) -> int:
    """Runs `shoal stop`. Returns the exit code (1: no cluster runs there)."""
    handle = attach_cluster("stop", args)
    return 1 if handle is None else stop_cluster(handle, timeout_s=args.timeout)


def stop_cluster(handle: ClusterHandle, *, timeout_s: float) -> int:
    """Asks the serving process to tear the cluster down and waits for it; tears down
    directly if nobody serves the cluster or the server does not finish in time."""
    served_by = ray.get(handle.registry.status.remote())["served_by"]
    ray.get(handle.registry.request_stop.remote())
    if served_by:
        logger.info("asked %s to stop the cluster in namespace %s", served_by, handle.namespace)
        if not _wait_for_registry_exit(handle, timeout_s):
            logger.warning("%s did not stop within %.0f s; tearing down here", served_by, timeout_s)
    # Idempotent: after a clean server exit this only confirms nothing is left.
    handle.shutdown()
    print(f"stopped the shoal cluster in namespace {handle.namespace}")
    return 0


def _wait_for_registry_exit(handle: ClusterHandle, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.registry.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            pass  # busy, not gone
        time.sleep(0.2)
    return False
