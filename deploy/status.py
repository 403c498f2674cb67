"""`shoal status`: the cluster's ranks, their load and cache (and, under tensor parallelism,
each rank's placement group and workers), what a rank still starting waits for, resizes,
the autoscaler, expert placement and attached clients, as a table with a legend, or as JSON."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from shoal.cluster.launch import ClusterHandle
from shoal.deploy import scale
from shoal.deploy.autoscale import autoscaler_status_lines
from shoal.deploy.ray_connection import add_ray_args, attach_cluster

# Under the table: what each column means.
LEGEND = (
    "STATE: ready serves; pending is still starting (the last column says what it waits for); "
    "joining / leaving are in a resize; dead is restarting; lost has no node with room. "
    "ENGINE: the rank's engine, shoal or vllm. "
    "RESTARTS: times Ray restarted the rank. RUNNING, QUEUED: requests it is running and "
    "holding back. KV USED: share of its KV cache blocks in use. STEPS: engine steps so far. "
    "CACHED: KV blocks it keeps for prefix reuse. HIT RATE: prompt tokens found in that cache."
)
_STATE_SHOWN = {"starting": "pending"}


def add_status_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `shoal status`."""
    add_ray_args(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    """Runs `shoal status`. Returns the exit code (1: no cluster to show)."""
    handle = attach_cluster("status", args)
    return 1 if handle is None else show_status(handle, as_json=args.json)


def show_status(handle: ClusterHandle, *, as_json: bool) -> int:
    """Prints the cluster's ranks, their state and load, resizes, and the attached clients."""
    status = handle.status()
    if as_json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        print(format_status(status))
    return 0


def _hit_rate(load: dict[str, Any]) -> str:
    """The rank's prefix-cache hit rate since it started: hit tokens / looked-up tokens."""
    queries = load.get("prefix_cache_queries_total", 0)
    return f"{100 * load.get('prefix_cache_hits_total', 0) / queries:.1f}%" if queries else "-"


def _tensor_parallel(status: dict[str, Any]) -> str:
    """The TP size and the workers of all ranks (one process per device each)."""
    tp = status.get("tensor_parallel_size", 1)
    return f"  TP {tp} ({tp * len(status['ranks'])} workers)" if tp > 1 else ""


def _served_by(status: dict[str, Any]) -> str:
    """Which process keeps the cluster, in words (the registry records it as "host:pid")."""
    server = status["served_by"]
    if server:
        host, _, pid = server.rpartition(":")
        line = f"served by `shoal serve`, process {pid} on {host} (it stops the cluster on `shoal stop`)"
    elif status["detached"]:
        line = "detached: no process serves it; `shoal stop` tears it down"
    else:
        line = "launched by a driver process; it ends with that process"
    return line + ("  STOPPING" if status["stopping"] else "")


def format_status(status: dict[str, Any]) -> str:
    """The human-readable `shoal status` table, with its legend."""
    lines = [
        f"namespace {status['namespace']}  model {status['model']}  "
        f"membership epoch {status['epoch']}" + _tensor_parallel(status),
        _served_by(status),
        "",
        f"{'RANK':<5}{'STATE':<9}{'ENGINE':<7}{'RESTARTS':>8}{'RUNNING':>9}{'QUEUED':>8}"
        f"{'KV USED':>9}{'STEPS':>8}{'CACHED':>8}{'HIT RATE':>10}  ADDRESS, OR WHAT IT WAITS FOR",
    ]
    for rank in status["ranks"]:
        lines.append(_rank_line(rank))
        if status.get("tensor_parallel_size", 1) > 1:
            lines += _worker_lines(rank)
    lines += ["", *_wrap(LEGEND, 96), ""]
    lines += _failure_lines(status.get("rank_failures", []))
    lines += scale.scale_status_lines(status)
    lines += autoscaler_status_lines(status)
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


def _rank_line(rank: dict[str, Any]) -> str:
    load = rank.get("load") or {}
    kv = f"{100 * load['kv_cache_usage']:.1f}%" if load else "-"
    incarnation = rank.get("incarnation", 0)
    restarts = incarnation - 1 if incarnation else "-"
    state = _STATE_SHOWN.get(rank["state"], rank["state"])
    last = rank.get("pending") if state == "pending" else rank.get("address")
    return (
        f"{rank['rank']:<5}{state:<9}{rank.get('engine') or '-':<7}{restarts:>8}"
        f"{load.get('num_running_reqs', '-'):>9}{load.get('num_waiting_reqs', '-'):>8}"
        f"{kv:>9}{load.get('step_counter', '-'):>8}"
        f"{load.get('num_cached_blocks', '-'):>8}{_hit_rate(load):>10}"
        f"  {last or '-'}"
    )


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return [*lines, line] if line else lines


def _worker_lines(rank: dict[str, Any]) -> list[str]:
    """A tensor-parallel rank's placement group and its workers: TP rank, pid, device, node."""
    lines = [f"     placement group {rank.get('placement_group', '-')}"]
    for w in rank.get("workers", []):
        lines.append(
            f"     TP {w['tp_rank']:<3}pid {w['pid']:<8}{w['device']:<18}"
            f"node {w['node_ip']} ({w['node_id'][:12]})"
        )
    return lines


# `shoal status` counts the rank failures of this last stretch.
RECENT_FAILURES_S = 600.0


def _failure_lines(failures: list[dict[str, Any]]) -> list[str]:
    """How many ranks failed (died, or hung and were restarted) in the last 10 minutes."""
    now = time.time()
    recent = [f for f in failures if now - f["at"] <= RECENT_FAILURES_S]
    line = f"rank failures in the last {RECENT_FAILURES_S / 60:.0f} min: {len(recent)}"
    if recent:
        last = recent[-1]
        line += f" (latest: rank {last['rank']}, {now - last['at']:.0f} s ago)"
    return [line, ""]


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
