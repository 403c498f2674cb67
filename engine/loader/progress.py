"""Progress of loading a checkpoint's weights, as log records a host can follow.

`with_progress` passes a checkpoint's tensors through and logs, on the
`shoal.engine.loader.progress` logger, each tenth of them loaded; every record carries a
`LoadProgress` as `record.load_progress`. Whoever hosts the engine decides where progress goes
(a Ray actor tells its registry, and so `shoal serve`, `shoal status` and the demo show it;
a plain log shows the lines as they are): the engine knows nothing of its host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How many records a load logs at most (one per tenth), besides its first and last.
NUM_STEPS = 10


@dataclass(frozen=True)
class LoadProgress:
    """How far a load has come.

    Attributes:
        done: items loaded so far.
        total: items there are (0: unknown).
        elapsed_s: seconds since the load started.
        what: what is loaded ("weights", "GGUF blocks").
        unit: what one item is ("tensors", "projections").
    """

    done: int
    total: int
    elapsed_s: float
    what: str = "weights"
    unit: str = "tensors"

    @property
    def percent(self) -> int:
        return 100 * self.done // self.total if self.total else 0

    def describe(self) -> str:
        """`loading weights 40% (108 of 272 tensors, 3.1 s)`; `loaded weights: 272 tensors
        in 7.9 s` at the end."""
        what, unit, seconds = self.what, self.unit, f"{self.elapsed_s:.1f} s"
        if self.total and self.done >= self.total:
            return f"loaded {what}: {self.total} {unit} in {seconds}"
        if not self.total:
            return f"loading {what} ({self.done} {unit} so far, {seconds})"
        return f"loading {what} {self.percent}% ({self.done} of {self.total} {unit}, {seconds})"


def with_progress(
    items: Iterable[T], total: int, *, what: str = "weights", unit: str = "tensors"
) -> Iterator[T]:
    """Yields `items` (a checkpoint's tensors), logging the load's progress as it goes: at the
    start, at each tenth of `total`, and at the end.

    Args:
        items: the tensors, in load order.
        total: how many there are (0 if unknown: only the start and the end are logged).
        what, unit: as `LoadProgress` names them.
    """
    start = time.monotonic()
    _log(LoadProgress(0, total, 0.0, what, unit))
    step = max(1, total // NUM_STEPS) if total else 0
    done = 0
    for item in items:
        yield item
        done += 1
        if step and done % step == 0 and done < total:
            _log(LoadProgress(done, total, time.monotonic() - start, what, unit))
    _log(LoadProgress(done, max(total, done), time.monotonic() - start, what, unit))


def _log(progress: LoadProgress) -> None:
    logger.info("%s", progress.describe(), extra={"load_progress": progress})
