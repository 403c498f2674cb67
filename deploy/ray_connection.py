"""Reaching the Ray cluster from a `shoal` command: the --address / --namespace flags every
subcommand that talks to a cluster shares, and `connect_ray`, which fails at once where
ray.init would retry for minutes."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

import ray

from shoal.cluster.launch import DEFAULT_NAMESPACE, ClusterHandle, ClusterNotFoundError, attach

logger = logging.getLogger("shoal.serve")


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    """--address and --namespace, shared by every subcommand that talks to a cluster."""
    parser.add_argument(
        "--address",
        default="auto",
        help="Ray address for ray.init (default: auto, i.e. RAY_ADDRESS or the local node)",
    )
    parser.add_argument(
        "--namespace", default=DEFAULT_NAMESPACE, help="the cluster's Ray namespace"
    )


def connect_ray(address: str, namespace: str, *, can_start_local: bool) -> None:
    """ray.init at `address`; with "auto" and no running Ray, a local instance if allowed.

    Raises:
        ConnectionError: no Ray cluster at the address (and none may be started).
    """
    if ray.is_initialized():
        return
    _check_reachable(address)
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False)
    except ConnectionError:
        if address != "auto" or not can_start_local:
            raise
        logger.info("no running Ray cluster found; starting a local one")
        ray.init(namespace=namespace, log_to_driver=False)


def _check_reachable(address: str) -> None:
    """Fails fast where ray.init would retry for minutes: nothing listens at HOST:PORT."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "auto")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return  # "auto", "local", or a scheme Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except OSError as e:
        raise ConnectionError(f"nothing listens at {address}: {e}") from e


def attach_cluster(command: str, args: argparse.Namespace) -> ClusterHandle | None:
    """The cluster of `args.namespace`, reached at `args.address` (Ray is never started here);
    None, after one line on stderr that says why, when there is none."""
    try:
        try:
            connect_ray(args.address, args.namespace, can_start_local=False)
        except ConnectionError as e:
            raise ConnectionError(f"no Ray cluster at {args.address!r} ({e})") from e
        return attach(args.namespace)
    except (ConnectionError, ClusterNotFoundError) as e:
        print(f"shoal {command}: {e}", file=sys.stderr)
        return None
