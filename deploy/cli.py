"""The `shoal` command: serve a cluster, drive it, resize it, show its status, stop it, or run
the demo.

    shoal serve --model PATH --data-parallel-size N [--namespace NAME] [--port P] [engine flags]
    shoal api-server --namespace NAME [--host H] [--port P] [--api-key KEY]
    shoal generate [--namespace NAME] [--chat] [--max-tokens N] PROMPT [PROMPT ...]
    shoal scale --namespace NAME --data-parallel-size M [--switch-timeout-s S] [--json]
    shoal status [--namespace NAME] [--json]
    shoal stop [--namespace NAME] [--timeout S]
    shoal demo [--data-parallel-size N]

Every subcommand reaches Ray at --address (default "auto": RAY_ADDRESS or the local node).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

import ray

from shoal.cluster.launch import ClusterHandle, ClusterNotFoundError, attach
from shoal.deploy import demo, generate, scale, serve
from shoal.deploy.openai import server as api_server

logger = logging.getLogger("shoal")

STOP_TIMEOUT_S = 60.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="LLM serving on a Ray cluster.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_serve_args(
        commands.add_parser("serve", help="launch a cluster and serve until stopped")
    )
    api_server.add_api_server_args(
        commands.add_parser(
            "api-server", help="serve the OpenAI API of a running cluster (attach by namespace)"
        )
    )
    status = commands.add_parser("status", help="ranks, their load, and attached clients")
    serve.add_ray_args(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    scale.add_scale_args(
        commands.add_parser("scale", help="resize a running cluster while it serves")
    )
    stop = commands.add_parser("stop", help="tear the cluster down")
    serve.add_ray_args(stop)
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
        serve.connect_ray(address, namespace, can_start_local=False)
    except ConnectionError as e:
        raise ConnectionError(f"no Ray cluster at {address!r} ({e})") from e
    return attach(namespace)


def show_status(handle: ClusterHandle, *, as_json: bool) -> int:
    """Prints the cluster's ranks, their state and load, resizes, and the attached clients."""
    status = handle.status()
    if as_json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        print(format_status(status))
    return 0


def format_status(status: dict[str, Any]) -> str:
    """The human-readable `shoal status` table."""
    lines = [
        f"namespace {status['namespace']}  model {status['model']}  epoch {status['epoch']}",
        f"served by {status['served_by'] or '-'}"
        + ("  (detached)" if status["detached"] else "")
        + ("  STOPPING" if status["stopping"] else ""),
        "",
        f"{'RANK':<5}{'STATE':<10}{'INC':<5}{'RUNNING':>8}{'WAITING':>8}{'KV USE':>8}"
        f"{'STEPS':>8}  ADDRESS",
    ]
    for rank in status["ranks"]:
        load = rank.get("load") or {}
        kv = f"{100 * load['kv_cache_usage']:.1f}%" if load else "-"
        lines.append(
            f"{rank['rank']:<5}{rank['state']:<10}{rank['incarnation']:<5}"
            f"{load.get('num_running_reqs', '-'):>8}{load.get('num_waiting_reqs', '-'):>8}"
            f"{kv:>8}{load.get('step_counter', '-'):>8}  {rank['address'] or '-'}"
        )
    lines.append("")
    lines += scale.scale_status_lines(status)
    lines += _expert_parallel_lines(status.get("expert_parallel"))
    clients = status["clients"]
    lines.append(f"clients: {len(clients)}")
    now = time.time()
    for client in clients:
        lines.append(
            f"  {client['client_index']:<4}{client['name']}"
            f"  (attached {now - client['attached_at']:.0f} s ago)"
        )
    return "\n".join(lines)


def _expert_parallel_lines(expert_parallel: dict[str, Any] | None) -> list[str]:
    """EP size, each rank's experts, and the DP wave (nothing for a dense cluster)."""
    if expert_parallel is None:
        return []
    state = "running" if expert_parallel.get("running") else "paused"
    lines = [
        f"expert parallel: {expert_parallel['size']} ranks, "
        f"{expert_parallel['num_experts']} experts; wave {expert_parallel.get('current_wave', 0)} "
        f"{state}"
    ]
    for rank, experts in enumerate(expert_parallel["experts_per_rank"]):
        lines.append(f"  rank {rank}: experts {', '.join(map(str, experts))}")
    return [*lines, ""]


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
