"""A TP=2 engine in a child process of its own, for tests that kill or stop its worker: its
exit (the rank going down) must not take the test process with it. Imports little, so the
child starts quickly."""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.model.multiproc_executor import MultiprocExecutor
from shoal.engine.protocol import EngineCoreRequest, SamplingParams


def _serve_tp2(path: str, timeout_s: float, conn: Connection) -> None:
    """Child process: a TP=2 engine that reports its worker pid, then generates on demand."""
    core = EngineCore(
        EngineConfig.from_kwargs(
            path, max_model_len=64, tensor_parallel_size=2, collective_timeout_s=timeout_s
        )
    )
    assert isinstance(core.executor, MultiprocExecutor)
    conn.send(core.executor.worker_pids)
    conn.recv()  # go
    started = time.monotonic()
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        core.add_request(EngineCoreRequest("r", [5, 6, 7], params))
        while core.scheduler.has_unfinished_requests():
            core.step()
        conn.send(("finished", time.monotonic() - started))
    except Exception as e:
        conn.send((type(e).__name__, time.monotonic() - started))
    time.sleep(30)


def start_tp2_engine(path: str, timeout_s: float) -> tuple[BaseProcess, Connection, list[int]]:
    """(the child, our end of its pipe, its worker's pid); send it anything to run a request,
    whose outcome comes back as (exception name or "finished", seconds)."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    # Daemonic, as an engine process started by a client is: its workers start all the same.
    child = context.Process(target=_serve_tp2, args=(path, timeout_s, theirs), daemon=True)
    child.start()
    assert ours.poll(120), "the TP engine did not start"
    return child, ours, ours.recv()
