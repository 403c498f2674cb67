"""How a tensor-parallel rank's driver reaches its workers, and each end knows the other is alive.

`MultiprocExecutor` speaks to each worker over a `WorkerLink` (its end) and the worker answers
over a `DriverLink` (the worker's end); both carry raw msgspec frames, never pickles. A
`WorkerLauncher` starts worker processes and hands back their links. Two are built:

- `SpawnLauncher`: each worker is a child process of the engine's, spawned with two one-way
  `multiprocessing` pipes (calls in, replies out). A child ends when its call pipe closes (the
  engine's process is gone); the driver watches the child's process sentinel. Devices: TP rank
  r runs on the r-th visible GPU. What an engine outside a Ray cluster uses.
- a launcher that places each worker in its own bundle of the rank's placement group
  (`shoal.actors.tp_worker`): those workers are not children of the engine's process, so they
  speak over `ZmqWorkerLink` / `ZmqDriverLink` below.

ZMQ links. The driver binds one PAIR socket per worker on the loopback interface (a rank's
bundles are packed on one node) and the worker connects to it. Liveness, both ways, is a
Linux pidfd of the other end's process (`os.pidfd_open`): it becomes readable when that
process exits, whoever its parent is. The driver waits on the workers' pidfds exactly as on
child sentinels; a worker polls its socket together with the driver's pidfd, and its
`recv_bytes` raises EOFError once the driver is gone (what a closed pipe does).

Knows nothing of Ray, the model or the frames' schema.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import zmq

# How often a worker blocked on its socket checks that the driver still lives (a pidfd read
# is cheap; the socket wakes it at once for a call).
_DRIVER_POLL_MS = 1000


class WorkerLink(Protocol):
    """The driver's end of one worker: frames both ways, and the worker's process."""

    @property
    def pid(self) -> int | None: ...

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the worker's process has exited."""
        ...

    def is_alive(self) -> bool: ...

    @property
    def exitcode(self) -> int | None: ...

    def send_bytes(self, frame: bytes) -> None:
        """Raises OSError when the worker's end is gone."""
        ...

    def poll(self, timeout_s: float) -> bool:
        """Whether a reply is ready to read, waiting up to `timeout_s`."""
        ...

    def recv_bytes(self) -> bytes:
        """Raises EOFError when the worker's end is gone."""
        ...

    def stop(self, grace_s: float) -> None:
        """Waits up to `grace_s` for the worker to exit, then ends it; closes the link."""
        ...


class DriverLink(Protocol):
    """A worker's end of the link to its driver."""

    def recv_bytes(self) -> bytes:
        """The next call; raises EOFError once the driver is gone."""
        ...

    def send_bytes(self, frame: bytes) -> None: ...


# A worker process's body: (its TP rank, its link to the driver) -> None.
WorkerMain = Callable[[int, DriverLink], None]


class WorkerLauncher(Protocol):
    """Starts the worker processes of one rank (TP ranks 1..N-1)."""

    def device_index(self, tp_rank: int) -> int:
        """Which visible GPU TP rank `tp_rank` (0: the driver) uses, when on CUDA."""
        ...

    def launch(self, tp_rank: int, main: WorkerMain) -> WorkerLink:
        """Starts worker `tp_rank` running `main`; returns at once (READY comes on the link)."""
        ...


# --- spawned children over pipes ------------------------------------------------------------


class PipeDriverLink:
    """A spawned worker's end: a call pipe in, a reply pipe out."""

    def __init__(self, calls: Connection, replies: Connection) -> None:
        self._calls, self._replies = calls, replies

    def recv_bytes(self) -> bytes:
        return self._calls.recv_bytes()

    def send_bytes(self, frame: bytes) -> None:
        self._replies.send_bytes(frame)


class ChildWorkerLink:
    """The driver's end of a spawned worker."""

    def __init__(self, process: BaseProcess, calls: Connection, replies: Connection) -> None:
        self.process, self._calls, self._replies = process, calls, replies

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    def is_alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def send_bytes(self, frame: bytes) -> None:
        self._calls.send_bytes(frame)

    def poll(self, timeout_s: float) -> bool:
        return self._replies.poll(timeout_s)

    def recv_bytes(self) -> bytes:
        return self._replies.recv_bytes()

    def stop(self, grace_s: float) -> None:
        self.process.join(grace_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(1.0)
        self._calls.close()
        self._replies.close()


def _run_child(main: WorkerMain, tp_rank: int, calls: Connection, replies: Connection) -> None:
    main(tp_rank, PipeDriverLink(calls, replies))


class SpawnLauncher:
    """Workers as spawned children of the engine's process, each on the TP rank-th GPU."""

    def device_index(self, tp_rank: int) -> int:
        return tp_rank

    def launch(self, tp_rank: int, main: WorkerMain) -> WorkerLink:
        context = multiprocessing.get_context("spawn")
        call_reader, call_writer = context.Pipe(duplex=False)
        reply_reader, reply_writer = context.Pipe(duplex=False)
        process = context.Process(
            target=_run_child,
            args=(main, tp_rank, call_reader, reply_writer),
            name=f"ShoalTPWorker-{tp_rank}",
            # Not daemonic: an engine process is one (it may start no daemonic children). A
            # worker ends with its pipe instead, and the executor's shutdown runs at exit.
            daemon=False,
        )
        with _children_allowed():
            process.start()
        call_reader.close()
        reply_writer.close()
        return ChildWorkerLink(process, call_writer, reply_reader)


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """Lets a daemonic process (an engine process started by a client is one) start a worker.

    multiprocessing refuses children to daemonic processes because it would not clean them up
    at exit; these workers clean themselves up (they end when their call pipe closes, and the
    executor's shutdown runs at exit), so the flag is lifted for the start only.
    """
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    was_daemon = config.get("daemon", False)
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = was_daemon


# --- workers elsewhere on the node, over ZMQ ----------------------------------------------------


def _process_gone(pidfd: int) -> bool:
    """Whether the process behind `pidfd` has exited (its pidfd is readable then)."""
    return bool(zmq.select([pidfd], [], [], 0)[0])


class ZmqWorkerLink:
    """The driver's end of a worker that is not its child: a PAIR socket it binds on the
    loopback interface, and a pidfd of the worker's process once it has said its pid.

    Args:
        context: the ZMQ context of the driver.
        on_stop: ends the worker's process when it would not exit by itself (its host's way).
    """

    def __init__(self, context: zmq.Context[Any], on_stop: Callable[[], None]) -> None:
        self._socket = context.socket(zmq.PAIR)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._on_stop = on_stop
        self._pid: int | None = None
        self._pidfd = -1
        self._exitcode: int | None = None

    def attach(self, pid: int) -> None:
        """Starts watching the worker's process (it runs on this node)."""
        self._pid = pid
        self._pidfd = os.pidfd_open(pid)

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def sentinel(self) -> int:
        assert self._pidfd >= 0, "the worker's pid is not known yet"
        return self._pidfd

    def is_alive(self) -> bool:
        if self._pidfd < 0:
            return True  # not started yet: its host reports a failed start on its own
        if self._exitcode is None and _process_gone(self._pidfd):
            self._exitcode = -1  # not our child: its status is its host's to reap
        return self._exitcode is None

    @property
    def exitcode(self) -> int | None:
        return None if self.is_alive() else self._exitcode

    def send_bytes(self, frame: bytes) -> None:
        if not self.is_alive():
            raise OSError(f"worker process {self._pid} is gone")
        self._socket.send(frame, copy=False)

    def poll(self, timeout_s: float) -> bool:
        return bool(self._socket.poll(int(timeout_s * 1000)))

    def recv_bytes(self) -> bytes:
        if not self.poll(0) and not self.is_alive():
            raise EOFError
        return self._socket.recv()

    def stop(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.is_alive():
            self._on_stop()
        self._socket.close()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


class ZmqDriverLink:
    """A worker's end over ZMQ: connects to the driver's socket and watches the driver's
    process, so `recv_bytes` ends (EOFError) when the driver is gone.

    Args:
        address: the driver's socket for this worker.
        driver_pid: the driver's process (on this node).
    """

    def __init__(self, address: str, driver_pid: int) -> None:
        self._context: zmq.Context[Any] = zmq.Context()
        self._socket = self._context.socket(zmq.PAIR)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._driver = os.pidfd_open(driver_pid)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._driver, zmq.POLLIN)

    def recv_bytes(self) -> bytes:
        while True:
            ready = dict(self._poller.poll(_DRIVER_POLL_MS))
            if self._socket in ready:
                return self._socket.recv()
            if self._driver in ready:
                raise EOFError("the driver's process is gone")

    def send_bytes(self, frame: bytes) -> None:
        self._socket.send(frame, copy=False)

    def close(self) -> None:
        self._socket.close()
        self._context.term()
        os.close(self._driver)


def terminate_pid(pid: int | None) -> None:
    """SIGTERM to a worker process that outlived its grace period."""
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
