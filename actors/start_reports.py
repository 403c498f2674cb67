"""`StartReports`, a part of the registry: what each rank's actor said while it started.

A rank's reports are numbered across ranks in the order they came, so a launch waiting on
several ranks logs each report once, in order. They are not saved with the registry's state:
a rank that starts again says it all again.
"""

from __future__ import annotations

# Start reports kept per rank.
MAX_START_REPORTS = 32


class StartReports:
    """The last `MAX_START_REPORTS` start reports of each rank, until it is planned again or
    removed."""

    def __init__(self) -> None:
        self._reports: dict[int, list[tuple[int, str]]] = {}
        self._count = 0

    def add(self, rank: int, detail: str) -> None:
        self._count += 1
        reports = self._reports.setdefault(rank, [])
        reports.append((self._count, detail))
        del reports[:-MAX_START_REPORTS]

    def forget(self, rank: int) -> None:
        self._reports.pop(rank, None)

    def every_rank(self) -> dict[int, list[tuple[int, str]]]:
        """Each rank's reports as (number, detail), a copy."""
        return {rank: list(kept) for rank, kept in self._reports.items()}

    def last(self, rank: int) -> str | None:
        """The rank's latest report, if it made one."""
        reports = self._reports.get(rank)
        return reports[-1][1] if reports else None
