"""A tensor-parallel rank's workers on a Ray cluster: one `TPWorkerActor` per device, each in a
bundle of its own of the rank's placement group.

A rank of N workers reserves N bundles of one device each (one CPU per worker on CPU), packed
on one node (STRICT_PACK, `shoal.cluster.placement`). The engine's actor holds bundle 0 and runs
the driver worker. At engine start its `MultiprocExecutor` asks `RayWorkerLauncher` for workers
1..N-1; for each, the launcher:

1. creates a `TPWorkerActor` in bundle i, asking for exactly that bundle's resources, so Ray
   gives its process that bundle's GPU (`CUDA_VISIBLE_DEVICES`: its one GPU is `cuda:0`);
2. learns the worker's pid (the driver watches it through a pidfd: the bundles share a node);
3. starts the worker's loop (`serve`) over a loopback ZMQ link to the driver, and returns; the
   worker answers READY on that link once it has joined the TP group and built its shard.

Lifetimes. The engine's actor creates the workers, so it owns them: when its process dies, Ray
ends them too, and a restarted engine creates new ones in the same bundles. A worker whose
process dies ends the engine's process (the executor's monitor), and Ray restarts the rank
whole. A worker ends its own process when its loop returns (SHUTDOWN, or the driver gone).
"""

from __future__ import annotations

import os
from typing import Any, cast

import ray
import zmq
from ray.actor import ActorProxy
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shoal.engine.model.tp_links import (
    WorkerLauncher,
    WorkerLink,
    WorkerMain,
    ZmqDriverLink,
    ZmqWorkerLink,
)

# How long a worker's bundle may take to host its actor (the bundles are reserved already, but
# a restarted rank's old workers may still be releasing them).
WORKER_START_TIMEOUT_S = 120.0


class TPWorkerActor:
    """One worker process of a tensor-parallel rank (TP rank >= 1)."""

    @ray.method
    def pid(self) -> int:
        return os.getpid()

    @ray.method
    def serve(self, main: WorkerMain, tp_rank: int, address: str, driver_pid: int) -> None:
        """Runs the worker until SHUTDOWN or until the driver is gone; then ends the process,
        whose exit the driver sees."""
        link = ZmqDriverLink(address, driver_pid)
        try:
            main(tp_rank, link)
        finally:
            link.close()
            ray.actor.exit_actor()


class RayWorkerLauncher:
    """Starts workers 1..N-1 of the rank whose engine actor holds bundle 0 of `group`.

    Args:
        group: the rank's placement group, one bundle per worker.
    """

    def __init__(self, group: PlacementGroup) -> None:
        self._group = group
        self._context: zmq.Context[Any] = zmq.Context()

    def device_index(self, tp_rank: int) -> int:
        return 0  # each worker's process sees only its own bundle's GPU

    def launch(self, tp_rank: int, main: WorkerMain) -> WorkerLink:
        bundle = self._group.bundle_specs[tp_rank]
        actor: ActorProxy[TPWorkerActor] = (
            ray.remote(TPWorkerActor)
            .options(
                num_cpus=bundle.get("CPU", 0.0),
                num_gpus=bundle.get("GPU", 0.0),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._group, placement_group_bundle_index=tp_rank
                ),
            )
            .remote()
        )
        handle = cast("ray.actor.ActorHandle[Any]", actor)
        link = ZmqWorkerLink(self._context, on_stop=lambda: ray.kill(handle, no_restart=True))
        link.attach(ray.get(actor.pid.remote(), timeout=WORKER_START_TIMEOUT_S))
        # Kept by the link's closure: the handle keeps the actor (owned by this process) alive.
        actor.serve.remote(main, tp_rank, link.address, os.getpid())
        return link


def worker_launcher() -> WorkerLauncher | None:
    """The launcher for the calling engine actor: its placement group's other bundles, when
    it has one of several bundles; else None (the executor spawns children)."""
    group = ray.util.get_current_placement_group()
    if group is None or len(group.bundle_specs) < 2:
        return None
    return RayWorkerLauncher(group)
