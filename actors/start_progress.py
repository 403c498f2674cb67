"""What a starting rank tells its registry while it starts: each step of its engine actor's
construction, and the engine's weight-loading progress (`shoal.engine.loader.progress` log
records, followed here while the engine is built).

A report never waits for the registry: one thread of the actor sends them, one call at a
time, so they arrive in the order they were made (an async actor, the registry does not keep
the order of calls in flight together); one that fails (the registry restarting) is only lost.
`close` sends what is left before the rank registers. `shoal status` shows the last report of
each rank still starting; the launch (or resize) waiting on the rank logs each new one.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import ray

from shoal.engine.loader.progress import LoadProgress

if TYPE_CHECKING:
    from shoal.actors.registry import RegistryHandle

logger = logging.getLogger(__name__)

# The engine loggers whose progress records are followed.
_ENGINE_LOGGER = "shoal.engine"
# How long one report, and `close`, may wait for the registry.
_SEND_TIMEOUT_S = 10.0


class StartProgress(logging.Handler):
    """Tells the registry what rank `rank` is doing while its actor starts.

    Args:
        registry: the cluster's registry.
        rank: the starting rank.
    """

    def __init__(self, registry: RegistryHandle, rank: int) -> None:
        super().__init__(level=logging.INFO)
        self._registry = registry
        self._rank = rank
        self._last = ""
        self._outbox: queue.Queue[str | None] = queue.Queue()
        self._sender = threading.Thread(
            target=self._send_all, name=f"shoal-start-progress-{rank}", daemon=True
        )
        self._sender.start()

    def report(self, detail: str) -> None:
        """Tells the registry what the rank does now (repeats are not sent again)."""
        if detail != self._last:
            self._last = detail
            self._outbox.put(detail)

    def close(self) -> None:
        """Sends the reports not sent yet (waiting at most `_SEND_TIMEOUT_S` for them) and
        stops the sender."""
        self._outbox.put(None)
        self._sender.join(_SEND_TIMEOUT_S)

    def _send_all(self) -> None:
        while (detail := self._outbox.get()) is not None:
            try:
                call = self._registry.report_start_progress.remote(self._rank, detail)
                ray.get(call, timeout=_SEND_TIMEOUT_S)
            except Exception as e:  # the registry restarts: the next report may get through
                logger.debug("rank %d: progress not reported: %s", self._rank, e)

    def emit(self, record: logging.LogRecord) -> None:
        progress = getattr(record, "load_progress", None)
        if isinstance(progress, LoadProgress):
            self.report(progress.describe())

    @contextlib.contextmanager
    def following_engine_logs(self) -> Iterator[None]:
        """Reports the engine's progress records while the block runs (and lets the engine's
        INFO records through to this process's log, where they are also shown)."""
        engine_logger = logging.getLogger(_ENGINE_LOGGER)
        level = engine_logger.level
        if engine_logger.getEffectiveLevel() > logging.INFO:
            engine_logger.setLevel(logging.INFO)
        engine_logger.addHandler(self)
        try:
            yield
        finally:
            engine_logger.removeHandler(self)
            engine_logger.setLevel(level)
