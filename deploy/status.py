"""`shoal status`: the cluster's ranks, their load and cache (and, under tensor parallelism,
each rank's placement group and workers), resizes, expert placement and attached clients, as
a table or as JSON."""

from __future__ import annotations

import json
import time
from typing import Any

from shoal.cluster.launch import ClusterHandle
from shoal.deploy import scale


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


def format_status(status: dict[str, Any]) -> str:
    """The human-readable `shoal status` table."""
    lines = [
        f"namespace {status['namespace']}  model {status['model']}  epoch {status['epoch']}"
        + _tensor_parallel(status),
        f"served by {status['served_by'] or '-'}"
        + ("  (detached)" if status["detached"] else "")
        + ("  STOPPING" if status["stopping"] else ""),
        "",
        f"{'RANK':<5}{'STATE':<10}{'INC':<5}{'RUNNING':>8}{'WAITING':>8}{'KV USE':>8}"
        f"{'STEPS':>8}{'CACHED':>8}{'HIT':>8}  ADDRESS",
    ]
    for rank in status["ranks"]:
        load = rank.get("load") or {}
        kv = f"{100 * load['kv_cache_usage']:.1f}%" if load else "-"
        lines.append(
            f"{rank['rank']:<5}{rank['state']:<10}{rank['incarnation']:<5}"
            f"{load.get('num_running_reqs', '-'):>8}{load.get('num_waiting_reqs', '-'):>8}"
            f"{kv:>8}{load.get('step_counter', '-'):>8}"
            f"{load.get('num_cached_blocks', '-'):>8}{_hit_rate(load):>8}"
            f"  {rank['address'] or '-'}"
        )
        if status.get("tensor_parallel_size", 1) > 1:
            lines += _worker_lines(rank)
    lines.append("")
    lines += _failure_lines(status.get("rank_failures", []))
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
