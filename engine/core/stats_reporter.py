"""When an engine reports its load, and what the report holds (`EngineStatsReport`).

The busy loop marks the stats dirty whenever something may have changed them (an input, a
step) and asks `report` on each turn. A report goes out no more often than
STATS_MIN_INTERVAL_S while the load changes, and at least every STATS_MAX_INTERVAL_S as a
heartbeat when it does not; a look that finds the same stats as the last report sends nothing.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from shoal.engine.core.rank_engine import RankEngine
from shoal.engine.parallel.dp_wave import DPWave
from shoal.engine.protocol import EngineStatsReport, SchedulerStats

# Stats reports: no more often than this while the load changes...
STATS_MIN_INTERVAL_S = 0.05
# ...and at least this often as a heartbeat when it does not.
STATS_MAX_INTERVAL_S = 1.0


class StatsReporter:
    """The report schedule of one engine; the busy loop is its only caller."""

    def __init__(self, engine_index: int, identity: bytes) -> None:
        self._engine_index = engine_index
        self._identity = identity
        self.is_dirty = True
        self._last_stats: SchedulerStats | None = None
        self._last_wave_facts: tuple[int, bool, int] | None = None
        self._last_time = 0.0  # when the last report was sent
        self._next_check = 0.0  # no look at the stats before this (rate limit)

    def wait_s(self) -> float:
        """How long an idle busy loop may block before a report is due."""
        wake_at = self._next_check if self.is_dirty else self._last_time + STATS_MAX_INTERVAL_S
        return max(0.0, wake_at - time.monotonic())

    def report(
        self,
        core: RankEngine,
        wave: DPWave | None,
        attached_clients: Collection[int],
        attaches_seen: int,
    ) -> EngineStatsReport | None:
        """The report to send now, or None when none is due."""
        now = time.monotonic()
        if now < self._next_check:
            return None
        is_heartbeat_due = now >= self._last_time + STATS_MAX_INTERVAL_S
        if not (self.is_dirty or is_heartbeat_due):
            return None
        stats = core.make_stats()
        wave_facts = (0, False, 0) if wave is None else wave.facts()
        self.is_dirty = False
        self._next_check = now + STATS_MIN_INTERVAL_S
        is_same = stats == self._last_stats and wave_facts == self._last_wave_facts
        if is_same and not is_heartbeat_due:
            return None
        self._last_stats, self._last_time = stats, now
        self._last_wave_facts = wave_facts
        return EngineStatsReport(
            self._engine_index,
            stats,
            timestamp=time.time(),
            requests_seen=dict(core.requests_seen),
            identity=self._identity,
            attached_clients=sorted(attached_clients),
            attaches_seen=attaches_seen,
            current_wave=wave_facts[0],
            is_wave_running=wave_facts[1],
            num_dummy_steps=wave_facts[2],
        )
