"""`StepWatchdog`: notices an engine step that never returns.

A step can hang where nothing else notices: a kernel or a collective that never completes
leaves the IO threads answering heartbeats and the host answering health checks, while every
request on the engine waits for ever. The busy loop marks each step's start and end (two
attribute writes); this thread looks every so often and, once a step has run longer than the
limit, calls `on_expired` once. The stuck thread cannot be stopped from outside, so the
callback ends the process (`EngineCoreProc._on_step_timeout`), and its host restarts it as
after any other death.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

_MIN_CHECK_INTERVAL_S = 0.01
_MAX_CHECK_INTERVAL_S = 1.0


class StepWatchdog(threading.Thread):
    """Calls `on_expired(seconds_running)` once a step outlives `timeout_s`.

    Args:
        timeout_s: the longest a step may run.
        on_expired: called from this thread, at most once.
    """

    def __init__(self, timeout_s: float, on_expired: Callable[[float], None]) -> None:
        super().__init__(name="EngineStepWatchdog", daemon=True)
        if timeout_s <= 0:
            raise ValueError(f"a step timeout must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._on_expired = on_expired
        self._check_interval_s = min(
            _MAX_CHECK_INTERVAL_S, max(_MIN_CHECK_INTERVAL_S, timeout_s / 4)
        )
        self._step_started_at: float | None = None  # written by the busy loop only
        self._stop_event = threading.Event()

    def step_started(self) -> None:
        self._step_started_at = time.monotonic()

    def step_finished(self) -> None:
        self._step_started_at = None

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        while not self._stop_event.wait(self._check_interval_s):
            started_at = self._step_started_at
            if started_at is None:
                continue
            running_s = time.monotonic() - started_at
            if running_s > self.timeout_s:
                self._on_expired(running_s)
                return
