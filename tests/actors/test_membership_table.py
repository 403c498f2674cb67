"""`MembershipTable` on its own (no Ray): epochs, the save hook, registration, long-polls, clients."""

from __future__ import annotations

import asyncio
import time

import pytest

from shoal.actors.membership import RankInfo, RankState, RankWorker, registration_digest
from shoal.actors.membership_table import MAX_RANK_FAILURES_KEPT, MembershipTable, TableState
from shoal.engine.config import EngineConfig
from shoal.engine.protocol import EngineEndpoint

CONFIG = EngineConfig.from_kwargs("/models/none", data_parallel_size=2)


class _Saves:
    """The save hook: counts the registry's writes."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def _table(client_timeout_s: float = 30.0) -> tuple[MembershipTable, _Saves]:
    saves = _Saves()
    return MembershipTable(TableState(config=CONFIG), saves, client_timeout_s), saves


def _endpoint(rank: int, identity: bytes) -> EngineEndpoint:
    return EngineEndpoint(rank, identity, f"tcp://127.0.0.1:{5000 + rank}")


def test_every_change_is_saved_and_a_refused_registration_changes_nothing() -> None:
    table, saves = _table()
    digest = registration_digest(b"the rank's token")
    table.set_rank(RankInfo(0, RankState.STARTING, "e-0", "pg-0", registration_digest=digest))
    assert table.bump() == 1 and saves.count == 1
    with pytest.raises(KeyError, match="rank 1 is not planned"):
        table.register(_endpoint(1, b"1:a"), "10.0.0.1", b"", joining=False)
    with pytest.raises(PermissionError, match="rank 0"):
        table.register(_endpoint(0, b"0:fake"), "6.6.6.6", b"another token", joining=False)
    assert (table.epoch, saves.count) == (1, 1)
    assert table.register(_endpoint(0, b"0:a"), "10.0.0.1", b"the rank's token", joining=True)
    assert table.rank(0).state == RankState.JOINING and not table.rank(0).is_routable
    assert (table.epoch, saves.count) == (2, 2)
    table.mark_dead(0, b"0:old")  # not the registered incarnation: nothing happens
    assert table.rank(0).state == RankState.JOINING and table.epoch == 2
    table.mark_dead(0, b"0:a")
    assert table.rank(0).state == RankState.DEAD and table.epoch == 3
    assert table.serving_ranks() == [] and saves.count == 3


def test_each_rank_failure_is_recorded_once_and_only_the_latest_are_kept() -> None:
    table, _ = _table()
    table.set_rank(RankInfo(0, RankState.STARTING, "e-0", "pg-0"))
    for n in range(MAX_RANK_FAILURES_KEPT + 2):
        table.register(_endpoint(0, f"0:{n}".encode()), "10.0.0.1", b"", joining=False)
        table.mark_dead(0, f"0:{n}".encode())
        table.mark_dead(0, f"0:{n}".encode())  # a second report of the same death
    failures = table.rank_failures()
    assert len(failures) == MAX_RANK_FAILURES_KEPT
    assert {rank for _, rank in failures} == {0}
    assert [at for at, _ in failures] == sorted(at for at, _ in failures)


def test_a_restart_seen_before_its_death_still_counts_the_failure() -> None:
    """Ray restarted the rank and the new incarnation registered before the old one's death
    was seen: the death counts once, and a first registration counts none."""
    table, _ = _table()
    table.set_rank(RankInfo(0, RankState.STARTING, "e-0", "pg-0"))
    table.register(_endpoint(0, b"0:a"), "10.0.0.1", b"", joining=False)
    assert table.rank_failures() == []
    table.register(_endpoint(0, b"0:b"), "10.0.0.1", b"", joining=False)
    table.mark_dead(0, b"0:a")  # the late word of the old incarnation's death
    assert [rank for _, rank in table.rank_failures()] == [0]
    assert table.rank(0).state == RankState.READY


def test_each_incarnation_registers_its_workers_and_a_dead_one_shows_none() -> None:
    table, _ = _table()
    table.set_rank(RankInfo(0, RankState.STARTING, "e-0", "pg-0"))
    first = (
        RankWorker(0, 100, "cpu", "10.0.0.1", "n1"),
        RankWorker(1, 101, "cpu", "10.0.0.1", "n1"),
    )
    table.register(_endpoint(0, b"0:a"), "10.0.0.1", b"", joining=False, workers=first)
    assert table.rank(0).workers == first
    table.mark_dead(0, b"0:a")
    assert table.rank(0).workers == ()  # no stale pids while the rank restarts
    second = (RankWorker(0, 200, "cpu", "10.0.0.2", "n2"),)
    table.register(_endpoint(0, b"0:b"), "10.0.0.2", b"", joining=False, workers=second)
    assert table.rank(0).workers == second and table.snapshot().ranks[0].workers == second


async def test_a_long_poll_wakes_on_the_next_bump_or_returns_at_its_timeout() -> None:
    table, _ = _table()
    started = time.monotonic()
    assert (await table.wait_for_change(0, 0.2)).epoch == 0
    assert time.monotonic() - started >= 0.19
    poll = asyncio.create_task(table.wait_for_change(0, 30.0))
    await asyncio.sleep(0.05)
    assert not poll.done()
    table.request_stop()
    membership = await asyncio.wait_for(poll, 5)
    assert membership.epoch == 1 and membership.stopping


def test_clients_are_pruned_when_silent_listed_again_when_heard_and_never_reuse_an_index() -> None:
    table, saves = _table(client_timeout_s=0.05)
    assert [table.attach_client(f"c{i}", None) for i in range(2)] == [0, 1]
    time.sleep(0.1)
    table.heard_from(1, None)
    assert [c.client_index for c in table.clients()] == [1]  # 0 went silent
    table.heard_from(0, "c0 again")
    table.heard_from(7, "stranger")  # never handed out here
    assert [(c.client_index, c.name) for c in table.clients()] == [(0, "c0 again"), (1, "c1")]
    assert table.attach_client("c2", b"key") == 2
    assert table.snapshot().client_keys == {2: b"key"}
    assert table.detach_client(2) and not table.detach_client(2)
    assert table.snapshot().client_keys == {} and saves.count >= 5


def test_a_resumed_state_moves_the_epoch_on_and_counts_every_client_as_just_seen() -> None:
    state = TableState(config=CONFIG)
    table = MembershipTable(state, _Saves(), client_timeout_s=0.05)
    table.attach_client("paused", None)
    table.bump()
    time.sleep(0.1)
    state.resume(time.time())
    assert table.epoch == 2
    assert [c.name for c in table.clients()] == ["paused"]
