"""The engine process: `run_engine_core` (its entry: an `EngineCoreProc` in the process's
main thread, ended by SIGTERM or by its parent's death), and `start_engine_process` /
`stop_engine_process` for the client that launches one."""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import traceback
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from shoal.engine.config import EngineConfig
from shoal.engine.core.parent_watch import exit_with_parent
from shoal.engine.protocol import EngineEndpoint

_ReadyMessage = tuple[str, EngineEndpoint | None, str]


def run_engine_core(
    config: EngineConfig,
    engine_index: int,
    ready_pipe: multiprocessing.connection.Connection,
    *,
    parent_pid: int | None = None,
    use_pdeathsig: bool = False,
    **kwargs: Any,
) -> None:
    """Process entry: builds an `EngineCoreProc`, reports readiness, serves until SIGTERM.

    Sends ("ready", endpoint, "") or ("error", None, traceback) on `ready_pipe` (msgpack).
    Exits 0 after SIGTERM/SIGINT, non-zero after a startup or fatal error. With `parent_pid`,
    it also ends when that process is gone (`shoal.engine.core.parent_watch`).
    """

    def _exit_on_signal(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    if parent_pid is not None:
        exit_with_parent(parent_pid, use_pdeathsig)
    # Here, in the child: the launching client imports this module without the engine (torch,
    # the models), which only the engine process needs.
    from shoal.engine.core.core_proc import EngineCoreProc

    try:
        proc = EngineCoreProc(config, engine_index=engine_index, **kwargs)
    except BaseException:
        ready_pipe.send_bytes(msgspec.msgpack.encode(("error", None, traceback.format_exc())))
        raise SystemExit(1) from None
    # The startup heap (torch, the model, the tokenizer) lives as long as the process: kept
    # out of the collector, a full collection no longer walks it (tens of ms, then a stall).
    gc.collect()
    gc.freeze()
    ready_pipe.send_bytes(msgspec.msgpack.encode(("ready", proc.endpoint, "")))
    ready_pipe.close()
    try:
        proc.run_busy_loop()
    except SystemExit:
        raise
    except BaseException:
        raise SystemExit(1) from None


def start_engine_process(
    config: EngineConfig,
    *,
    engine_index: int = 0,
    startup_timeout_s: float = 120.0,
    **kwargs: Any,
) -> tuple[BaseProcess, EngineEndpoint]:
    """Starts an engine core in a new (spawned) process and waits until it serves.

    Args:
        config: the engine's configuration.
        engine_index: the rank.
        startup_timeout_s: how long model loading may take.
        **kwargs: `EngineCoreProc` keyword arguments (host, transport, identity, stats_address).

    Returns:
        The process and the endpoint to attach clients to.

    Raises:
        RuntimeError: the engine failed to start (the message carries its traceback) or timed out.
    """
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    # The engine ends with this process, however it ends (SIGKILL included).
    kwargs["parent_pid"] = os.getpid()
    kwargs["use_pdeathsig"] = threading.current_thread() is threading.main_thread()
    process = context.Process(
        target=run_engine_core,
        args=(config, engine_index, writer),
        kwargs=kwargs,
        name=f"EngineCore_{engine_index}",
        daemon=True,
    )
    process.start()
    writer.close()
    try:
        ready = multiprocessing.connection.wait([reader, process.sentinel], startup_timeout_s)
        if reader in ready:
            try:
                raw = reader.recv_bytes()
            except EOFError:
                raw = None
            if raw is not None:
                status, endpoint, detail = msgspec.msgpack.decode(raw, type=_ReadyMessage)
                if status == "ready" and endpoint is not None:
                    return process, endpoint
                raise RuntimeError(f"engine {engine_index} failed to start:\n{detail}")
        if ready:
            process.join(timeout=1)  # the sentinel fired: reap it for the exit code
        reason = f"exited with code {process.exitcode}" if ready else "timed out"
        raise RuntimeError(f"engine {engine_index} failed to start: it {reason}")
    except BaseException:
        stop_engine_process(process)
        raise
    finally:
        reader.close()


def stop_engine_process(process: BaseProcess, timeout_s: float = 5.0) -> None:
    """SIGTERM (a clean exit), then SIGKILL if the process is still alive after `timeout_s`."""
    if process.is_alive():
        process.terminate()
        process.join(timeout_s)
    if process.is_alive() and process.pid is not None:
        os.kill(process.pid, signal.SIGKILL)
        process.join(timeout_s)
