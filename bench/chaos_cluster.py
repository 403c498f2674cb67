"""The simulated multi-node Ray cluster bench/chaos.py runs on: a head that holds no CPUs (the
drivers, the HTTP front end and the control actors live there) and worker raylets on this
machine, each offering a custom resource of its own, that hold the ranks.

Losing a node SIGKILLs its whole process group at once, as a preempted machine goes; the GCS
counts it dead within ~3 s (`FAST_NODE_DEATH`) and a replacement node joins, as Kubernetes
would recreate the pod. Every raylet started here is stopped when the cluster is left, on any
exit short of a SIGKILL of this process. Knows nothing of shoal.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

import psutil
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.ray_utils import (
    FAST_NODE_DEATH,
    RayHead,
    kill_process_group,
    start_ray_head,
    start_ray_worker,
    stop_process_group,
    stop_ray_head,
    wait_for_node,
)


@dataclass(frozen=True)
class WorkerNode:
    """One worker raylet: its custom resource (its name) and its process group."""

    name: str
    process_group: int


class SimulatedCluster:
    """A Ray head and `num_nodes` worker nodes of `num_cpus` CPUs each, this driver attached.

    Use as a context manager: entering starts the head, attaches (`ray.init`) and adds the
    workers; leaving, however it happens, detaches and stops every node started here. On
    SIGINT, SIGTERM or SIGHUP meanwhile the nodes are stopped at once and the process exits
    (128 + the signal): unwinding a run mid-fault could wait on a call that never returns.
    """

    def __init__(self, num_nodes: int, num_cpus: int, namespace: str) -> None:
        self.num_nodes, self.num_cpus, self.namespace = num_nodes, num_cpus, namespace
        self.head: RayHead | None = None
        self.workers: list[WorkerNode] = []
        self._ordinals = itertools.count()

    def __enter__(self) -> SimulatedCluster:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._exit_on_signal)
        try:
            self.head = start_ray_head(num_cpus=0, system_env=FAST_NODE_DEATH)
            ray.init(address=self.head.gcs_address, namespace=self.namespace, log_to_driver=False)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # ray.init sets its own
                signal.signal(sig, self._exit_on_signal)
            for _ in range(self.num_nodes):
                self.add_node()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def add_node(self, timeout_s: float = 120.0) -> WorkerNode:
        """Starts a worker node; returns it once the GCS lists it alive.

        Raises:
            TimeoutError: it did not join within `timeout_s` (it is still stopped at the end).
        """
        assert self.head is not None, "the head is not started"
        name = f"chaos-node-{next(self._ordinals)}"
        node = WorkerNode(name, start_ray_worker(self.head, self.num_cpus, {name: 1}))
        self.workers.append(node)
        wait_for_node(node.name, timeout_s)
        return node

    def lose(self, node: WorkerNode) -> None:
        """SIGKILLs every process of `node` at once (blocks until they are gone)."""
        self.workers.remove(node)
        kill_process_group(node.process_group)

    def node_of(self, pid: int) -> WorkerNode | None:
        """The worker node a process runs on (it or an ancestor is in the node's group)."""
        groups = {node.process_group: node for node in self.workers}
        try:
            process = psutil.Process(pid)
            for p in [process, *process.parents()]:
                group = os.getpgid(p.pid)
                if group in groups:
                    return groups[group]
        except (psutil.Error, ProcessLookupError):
            pass
        return None

    def ranks_by_node(self, rank_pids: dict[int, int]) -> dict[WorkerNode, list[int]]:
        """The ranks (given with their processes' ids) on each worker node that holds some."""
        held: dict[WorkerNode, list[int]] = {}
        for rank, pid in sorted(rank_pids.items()):
            node = self.node_of(pid)
            if node is not None:
                held.setdefault(node, []).append(rank)
        return held

    def stop(self) -> None:
        """Detaches, then stops every node started here: the workers, then the head."""
        if ray.is_initialized():
            ray.shutdown()
        self._stop_nodes()

    def _stop_nodes(self) -> None:
        for node in self.workers:
            stop_process_group(node.process_group)
        self.workers = []
        if self.head is not None:
            stop_ray_head(self.head)
            self.head = None

    def _exit_on_signal(self, signum: int, frame: FrameType | None) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # not cut short by a second one
        print(f"\nsignal {signum}: stopping the Ray nodes", file=sys.stderr, flush=True)
        self._stop_nodes()
        os._exit(128 + signum)
