"""Rate-limited warnings: what a hostile or broken peer can make an engine log.

A peer that sends 10,000 bad frames must not write 10,000 lines: each kind of warning is
logged at most once per interval, and the next line says how many were held back. It knows
nothing of sockets or of what the warnings are about.
"""

from __future__ import annotations

import logging
import threading
import time

# The shortest time between two lines of one kind.
WARN_INTERVAL_S = 5.0


class LogRateLimiter:
    """Logs each kind of message at most once per `interval_s`; thread-safe.

    Args:
        logger: where the lines go.
        interval_s: the shortest time between two lines of one kind.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = WARN_INTERVAL_S) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._lock = threading.Lock()
        # kind → (when its last line was written, how many were held back since)
        self._state: dict[str, tuple[float, int]] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        """Logs `message % args` at WARNING unless a line of `kind` went out lately."""
        now = time.monotonic()
        with self._lock:
            last, held_back = self._state.get(kind, (float("-inf"), 0))
            if now - last < self._interval_s:
                self._state[kind] = (last, held_back + 1)
                return
            if len(self._state) > 1024:  # kinds are few; a flood of distinct ones is bounded
                self._state.clear()
            self._state[kind] = (now, 0)
        if held_back:
            message += f" (and {held_back} more like it in the last {self._interval_s:.0f} s)"
        self._logger.warning(message, *args)
