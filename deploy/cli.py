"""The `shoal` command: serve a cluster, drive it, resize it, show its status, stop it, or run
the demo.

    shoal serve PATH --data-parallel-size N [--namespace NAME] [--port P] [engine flags]
    shoal api-server --namespace NAME [--port P] [--ready-timeout S] [--exit-with-cluster]
    shoal generate [--namespace NAME] [--chat] [--max-tokens N] PROMPT [PROMPT ...]
    shoal scale --namespace NAME --data-parallel-size M [--switch-timeout-s S] [--json]
    shoal status [--namespace NAME] [--json]
    shoal stop [--namespace NAME] [--timeout S]
    shoal demo [--data-parallel-size N]

Every subcommand reaches Ray at --address (default "auto": RAY_ADDRESS or the local node).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

import ray

from shoal.cluster.launch import ClusterHandle, ClusterNotFoundError, attach
from shoal.deploy import demo, generate, ray_connection, scale, serve
from shoal.deploy.flags import HelpFormatter
from shoal.deploy.openai import server as api_server
from shoal.deploy.status import show_status

logger = logging.getLogger("shoal")

STOP_TIMEOUT_S = 60.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="LLM serving on a Ray cluster.")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_SubcommandParser
    )
    serve.add_serve_args(
        commands.add_parser("serve", help="launch a cluster and serve until stopped")
    )
    api_server.add_api_server_args(
        commands.add_parser(
            "api-server", help="serve the OpenAI API of a running cluster (attach by namespace)"
        )
    )
    status = commands.add_parser("status", help="ranks, their load, and attached clients")
    ray_connection.add_ray_args(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    scale.add_scale_args(
        commands.add_parser("scale", help="resize a running cluster while it serves")
    )
    stop = commands.add_parser("stop", help="tear the cluster down")
    ray_connection.add_ray_args(stop)
    stop.add_argument(
        "--timeout",
        type=float,
        default=STOP_TIMEOUT_S,
        help="how long to wait for the serving process before tearing down directly",
    )
    generate.add_generate_args(
        commands.add_parser("generate", help="stream prompts through a running cluster")
    )
    demo.add_demo_args(commands.add_parser("demo", help="a local two-rank cluster of SmolLM2"))
    return parser


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: its `--help` shows every flag's default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shoal` console script. Returns the exit code."""
    args = build_parser().parse_args(argv)
    serve.configure_logging()
    if args.command == "serve":
        return serve.run(args)
    if args.command == "generate":
        return generate.run(args)
    if args.command == "demo":
        return demo.run(args)
    if args.command == "api-server":
        return api_server.run(args)
    try:
        handle = _attach(args.address, args.namespace)
    except (ConnectionError, ClusterNotFoundError) as e:
        print(f"shoal {args.command}: {e}", file=sys.stderr)
        return 1
    if args.command == "status":
        return show_status(handle, as_json=args.json)
    if args.command == "scale":
        return scale.run(handle, args)
    return stop_cluster(handle, timeout_s=args.timeout)


def _attach(address: str, namespace: str) -> ClusterHandle:
    try:
        ray_connection.connect_ray(address, namespace, can_start_local=False)
    except ConnectionError as e:
        raise ConnectionError(f"no Ray cluster at {address!r} ({e})") from e
    return attach(namespace)


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


if __name__ == "__main__":
    sys.exit(main())
