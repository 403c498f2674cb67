"""`MultiprocExecutor`: a tensor-parallel rank's workers behind the `Executor` interface — the
driver worker (TP rank 0) in the engine's own process, one process for each other worker.

Protocol. At start the driver serves a `TCPStore` on a free local port and has its
`WorkerLauncher` (`shoal.engine.model.tp_links`) start workers 1..N-1, handing each its TP rank,
its device, the store's address and a link to the driver: pipes to a spawned child, or a
loopback ZMQ socket to a worker a Ray placement group holds in a bundle of its own. Every worker
and the driver join the TP group over the store (`ProcessGroups`: gloo on CPU, NCCL on CUDA)
and build their runner at their shard's sizes; each worker then answers READY (its
`WorkerInfo`: TP rank, pid, device; or the error that stopped it) on its link. After that
every executor call is:

1. the driver writes one `WorkerCall` frame (msgspec; nothing is pickled) to every worker: a
   STEP (the step's `StepInput`), a CALL (a worker method: load, size or bind the KV cache; the
   MoE exchange's groups, dummy forwards and staged experts under expert parallelism
   (`shoal.engine.model.tp_experts`); or a public runner method for `collective_rpc`) or
   SHUTDOWN;
2. the driver runs the same call itself; a step's collectives keep the workers in lockstep;
3. a STEP is not answered: only the driver samples, and only its output comes back. A CALL is
   answered by one `WorkerReply` per worker, read in rank order.

Calls may come from several threads (a resize stages experts beside the busy loop): a lock
keeps each call's frames and replies, and each step's frames, together on the links.

A worker blocks on its link while the rank is idle, without a timeout, and ends when the driver
is gone (its pipe closes, or its process exits). The link's frame handoff is measured against a
gloo broadcast of the same frame in `bench/tensor_parallel.py`.

Failure: a monitor thread watches the worker processes. One that exits while the executor is
open ends the engine's process (SIGTERM, then `os._exit` after a grace period), so the rank goes
down as one unit and the engine's host restarts it with all its workers. A collective that waits
past `collective_timeout_s` (a worker hung) raises in the driver's step, which ends the engine's
busy loop the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import replace
from datetime import timedelta
from functools import partial
from multiprocessing.connection import wait
from typing import Any

import msgspec
import torch
from torch.distributed import TCPStore

from shoal.engine.config import EngineConfig
from shoal.engine.model.executor_base import Executor
from shoal.engine.model.model_runner import resolve_device
from shoal.engine.model.step_input import StepInput, plan_step
from shoal.engine.model.tp_experts import TPExpertWorkers
from shoal.engine.model.tp_links import DriverLink, SpawnLauncher, WorkerLauncher, WorkerLink
from shoal.engine.model.worker import Worker, WorkerInfo
from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.distributed import ProcessGroups, Rendezvous, connect_store
from shoal.engine.parallel.expert_parallel import make_expert_parallel
from shoal.engine.parallel.shm_collectives import ShmCollectives, shm_supported
from shoal.engine.parallel.tensor_parallel import TensorParallel
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# How long the workers have to start (import torch, join the group) and answer READY.
START_TIMEOUT_S = 180.0
# How long a worker has to exit after SHUTDOWN before it is terminated.
_SHUTDOWN_GRACE_S = 5.0
# How long the engine's process has to stop cleanly after a worker died.
_DEATH_EXIT_S = 3.0

STEP, CALL, SHUTDOWN = 0, 1, 2
# CALL targets: the worker's own lifecycle, or (collective_rpc) its model runner.
_WORKER_METHODS = (
    "load_model",
    "determine_num_blocks",
    "initialize_kv_cache",
    # the MoE exchange under expert parallelism (`TPExpertWorkers`)
    "join_expert_groups",
    "bind_expert_groups",
    "leave_expert_groups",
    "run_dummy_forward",
    "start_staging_experts",
    "is_staging_done",
    "commit_staged_experts",
    "drop_staged_experts",
)


class WorkerCall(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One call of the driver on every worker.

    Attributes:
        kind: STEP, CALL or SHUTDOWN.
        step: a STEP's batch.
        method: a CALL's method: a worker lifecycle method or a public runner method.
        args: a CALL's arguments (msgspec-encodable values).
    """

    kind: int
    step: StepInput | None = None
    method: str = ""
    args: list[Any] = msgspec.field(default_factory=list)


class WorkerReply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A worker's answer to READY or a CALL: a value, or the error it raised (type, message)."""

    value: Any = None
    error_type: str = ""
    error: str = ""


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed to start or to run a call; the rank cannot go on."""


class MultiprocExecutor(Executor):
    """N workers of one rank, one per device: the driver here, N - 1 in their own processes.

    Args:
        config: the engine's configuration (`parallel.tensor_parallel_size` > 1).
        arch: the checkpoint's architecture facts (checked to split by the TP size).
        max_model_len: the context length served.

    Raises:
        WorkerError: a worker did not start (its error, or its exit) within `START_TIMEOUT_S`.
        GroupJoinError: the TP group did not form.
    """

    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArch,
        *,
        max_model_len: int,
        launcher: WorkerLauncher | None = None,
    ) -> None:
        self.size = config.parallel.tensor_parallel_size
        assert self.size > 1, "one worker runs in-process (UniProcExecutor)"
        timeout_s = config.parallel.collective_timeout_s
        device = resolve_device(config.model.device)
        config = _sharing_cores(config, device, self.size)
        self._is_closing = False
        # One frame sequence at a time on the links: a call's frames and replies, or a step's.
        self._lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._reply_decoder = msgspec.msgpack.Decoder(WorkerReply)
        self._store = TCPStore(
            "127.0.0.1", 0, None, True, timedelta(seconds=START_TIMEOUT_S), wait_for_workers=False
        )
        rendezvous = Rendezvous("127.0.0.1", self._store.port, group_name="tp")
        launcher = launcher or SpawnLauncher()
        self._links: list[WorkerLink] = []
        try:
            for rank in range(1, self.size):
                main = partial(
                    run_worker,
                    config,
                    arch,
                    max_model_len,
                    rendezvous,
                    _worker_device(device, launcher.device_index(rank)),
                )
                self._links.append(launcher.launch(rank, main))
            own_device = _worker_device(device, launcher.device_index(0))
            self.tp = join_group(rendezvous, 0, self.size, own_device, timeout_s)
            expert_parallel = make_expert_parallel(config, arch)
            self.worker = Worker(
                config,
                arch,
                max_model_len=max_model_len,
                expert_parallel=expert_parallel,
                tensor_parallel=self.tp,
                device=own_device,
            )
            if expert_parallel is not None:
                self.expert_workers = TPExpertWorkers(expert_parallel, self._call_all)
            # READY carries each worker's `WorkerInfo`.
            ready = self._collect(deadline=time.monotonic() + START_TIMEOUT_S)
            self._infos = [self.worker.info()] + [msgspec.convert(r, WorkerInfo) for r in ready]
        except BaseException:
            self.shutdown()
            raise
        atexit.register(self.shutdown)
        self._monitor = threading.Thread(target=self._watch_workers, name="TPWorkerMonitor")
        self._monitor.daemon = True
        self._monitor.start()

    @property
    def device(self) -> torch.device:
        return self.worker.device

    def describe_workers(self) -> list[WorkerInfo]:
        return list(self._infos)

    @property
    def worker_pids(self) -> list[int]:
        """The pids of the worker processes (TP ranks 1..N-1)."""
        return [link.pid for link in self._links if link.pid is not None]

    def load_model(self) -> None:
        self._call_all("load_model", ())

    def determine_num_blocks(self) -> int:
        return min(self._call_all("determine_num_blocks", ()))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call_all("initialize_kv_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        step, samplers, poolers = plan_step(scheduler_output, self.worker.model_runner.block_size)
        with self._lock:
            self._send(WorkerCall(STEP, step=step))
        return self.worker.model_runner.execute_step(step, samplers, poolers)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        if method.startswith("_") or not callable(getattr(self.worker.model_runner, method, None)):
            raise AttributeError(f"model runner has no public method {method!r}")
        return self._call_all(method, args)

    def shutdown(self) -> None:
        if self._is_closing:
            return
        self._is_closing = True
        atexit.unregister(self.shutdown)
        frame = self._encoder.encode(WorkerCall(SHUTDOWN))
        for link in self._links:
            with contextlib.suppress(OSError):  # that worker is gone already
                link.send_bytes(frame)
        deadline = time.monotonic() + _SHUTDOWN_GRACE_S
        for link in self._links:
            link.stop(max(0.0, deadline - time.monotonic()))
        if hasattr(self, "tp"):
            self.tp.destroy()

    # --- internals ---------------------------------------------------------------------------

    def _send(self, call: WorkerCall) -> None:
        frame = self._encoder.encode(call)
        for link in self._links:
            link.send_bytes(frame)

    def _call_all(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """Runs `method` on every worker (the driver's own first in the list); from any thread
        (a resize stages experts on one of its own while the busy loop steps)."""
        with self._lock:
            self._send(WorkerCall(CALL, method=method, args=list(args)))
            try:
                own = _dispatch(self.worker, method, args)
            except Exception:
                # The driver's own error is the one raised; the workers' replies are still all
                # read, so the next call reads its own.
                with contextlib.suppress(WorkerError, AttributeError):
                    self._collect()
                raise
            return [own, *self._collect()]

    def _collect(self, deadline: float | None = None) -> list[Any]:
        """One reply per worker, in rank order; every reply is read before any error is raised.

        Raises:
            AttributeError: a worker's runner has no such method.
            WorkerError: a worker answered with another error, or exited first.
        """
        replies = [self._reply(rank, deadline) for rank in range(1, self.size)]
        for rank, reply in enumerate(replies, 1):
            if reply.error_type == "AttributeError":
                raise AttributeError(reply.error)
            if reply.error_type:
                raise WorkerError(f"TP worker {rank}: {reply.error_type}: {reply.error}")
        return [reply.value for reply in replies]

    def _reply(self, rank: int, deadline: float | None) -> WorkerReply:
        link = self._links[rank - 1]
        while not link.poll(0.1):
            if not link.is_alive():
                raise WorkerError(f"TP worker {rank} exited (code {link.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerError(f"TP worker {rank} did not start in {START_TIMEOUT_S:.0f} s")
        try:
            return self._reply_decoder.decode(link.recv_bytes())
        except EOFError:
            raise WorkerError(f"TP worker {rank} exited (code {link.exitcode})") from None

    def _watch_workers(self) -> None:
        sentinels = {link.sentinel: (rank, link) for rank, link in enumerate(self._links, 1)}
        ready = wait(list(sentinels))
        if self._is_closing:
            return
        rank, link = sentinels[ready[0]]  # type: ignore[index]
        logger.critical(
            "TP worker %d (pid %s) exited with code %s: ending this rank",
            rank,
            link.pid,
            link.exitcode,
        )
        self.tp.destroy()  # a collective in flight with the dead worker fails now
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(_DEATH_EXIT_S)
        logging.shutdown()
        os._exit(1)


def join_group(
    rendezvous: Rendezvous, rank: int, size: int, device: torch.device, timeout_s: float
) -> TensorParallel:
    """Joins the rank's TP group (and, on the CPU, its shared-memory collectives: the workers
    share a node); collectives wait at most `timeout_s` for a worker."""
    groups = ProcessGroups.join(
        rendezvous, rank, size, device=device, timeout_s=timeout_s, join_timeout_s=START_TIMEOUT_S
    )
    shm = None
    if device.type == "cpu" and shm_supported():
        store = connect_store(rendezvous, START_TIMEOUT_S)
        shm = ShmCollectives.join(store, rank, size, timeout_s, join_timeout_s=START_TIMEOUT_S)
    return TensorParallel(rank, size, groups, shm)


def _sharing_cores(config: EngineConfig, device: torch.device, size: int) -> EngineConfig:
    """On CPU, each of the `size` workers gets its share of the rank's cores (unless the config
    says how many threads): N processes each at torch's default (every core) would
    oversubscribe them N times."""
    if device.type != "cpu" or config.model.cpu_threads is not None:
        return config
    threads = max(1, torch.get_num_threads() // size)
    return replace(config, model=replace(config.model, cpu_threads=threads))


def _worker_device(device: torch.device, rank: int) -> torch.device:
    """TP rank r's device: the r-th visible GPU, or the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _dispatch(worker: Worker, method: str, args: tuple[Any, ...] | list[Any]) -> Any:
    if method in _WORKER_METHODS:
        return getattr(worker, method)(*args)
    return worker.call(method, tuple(args))


def run_worker(
    config: EngineConfig,
    arch: ModelArch,
    max_model_len: int,
    rendezvous: Rendezvous,
    device: torch.device,
    rank: int,
    link: DriverLink,
) -> None:
    """A worker process (`WorkerMain` once the first five arguments are bound): join the
    group, build the worker, answer READY, then serve calls until SHUTDOWN or until the
    driver is gone."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s TP{rank} %(message)s")
    encoder = msgspec.msgpack.Encoder()
    try:
        tp = join_group(
            rendezvous,
            rank,
            config.parallel.tensor_parallel_size,
            device,
            config.parallel.collective_timeout_s,
        )
        worker = Worker(
            config,
            arch,
            max_model_len=max_model_len,
            expert_parallel=make_expert_parallel(config, arch),
            tensor_parallel=tp,
            device=device,
        )
    except Exception as e:
        link.send_bytes(encoder.encode(WorkerReply(error_type=type(e).__name__, error=str(e))))
        raise
    link.send_bytes(encoder.encode(WorkerReply(value=worker.info())))
    decoder = msgspec.msgpack.Decoder(WorkerCall)
    runner = worker.model_runner
    while True:
        try:
            call = decoder.decode(link.recv_bytes())
        except EOFError:
            return  # the driver is gone
        if call.kind == SHUTDOWN:
            tp.destroy()
            return
        if call.kind == STEP:
            assert call.step is not None, "a STEP carries its batch"
            runner.execute_step(call.step, None)
            continue
        try:
            reply = WorkerReply(value=_dispatch(worker, call.method, call.args))
        except Exception as e:
            reply = WorkerReply(error_type=type(e).__name__, error=str(e))
        link.send_bytes(encoder.encode(reply))
