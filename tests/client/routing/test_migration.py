"""`RequestMigrator` on a real DP client with no rank to move to: what may not move is lost at
once, what may is "moving" until no rank takes it, an abort stops a move, and a poison request
is failed rather than moved. (Moves that succeed, on a real cluster:
tests/cluster/test_failover.py; a real poison request: tests/cluster/test_poison.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from shoal.client.routing.lb_client import DPLBAsyncMPClient
from shoal.client.routing.migration import (
    POISON_INTAKE,
    POISON_RANK_DEATHS,
    REASON_LIMIT,
    REASON_NO_RANK,
    REASON_PINNED,
    PoisonRequestError,
    RequestMigrator,
    RequestsLostError,
)
from shoal.engine.protocol import EngineCoreRequest, SamplingParams, StructuredOutputsParams


@pytest_asyncio.fixture
async def client() -> AsyncIterator[DPLBAsyncMPClient]:
    made = DPLBAsyncMPClient([], migration_limit=2)
    yield made
    made.shutdown()


def _send(
    client: DPLBAsyncMPClient,
    request_id: str,
    *,
    pinned: bool = False,
    num_migrations: int = 0,
    streamed: bool = True,
    rank: int = 0,
    grammar: bool = False,
) -> None:
    """Records `request_id` as sent to `rank`, with two tokens streamed if `streamed`, and a
    JSON grammar to compile at intake if `grammar`."""
    structured = StructuredOutputsParams(json={"type": "object"}) if grammar else None
    request = EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_tokens=8, structured_outputs=structured),
        data_parallel_rank=rank if pinned else None,
    )
    client.router.on_sent(request_id, rank, 3, request, num_migrations=num_migrations)
    if streamed:
        client.router.on_output(request_id, False, [7, 8])


def _poisoned(client: DPLBAsyncMPClient) -> list[str]:
    """The requests failed as poison so far (taken off the consumer's queue)."""
    failed = []
    while not client.outputs_queue.empty():
        item = client.outputs_queue.get_nowait()
        if isinstance(item, PoisonRequestError):
            failed.extend(item.request_ids)
    return failed


async def _lost(client: DPLBAsyncMPClient) -> list[RequestsLostError]:
    """The losses queued for the consumer so far."""
    await asyncio.sleep(0.05)  # the move's side task runs
    lost = []
    while not client.outputs_queue.empty():
        item = client.outputs_queue.get_nowait()
        assert isinstance(item, RequestsLostError), item
        lost.append(item)
    return lost


async def test_requests_that_may_not_move_are_lost_at_once(client: DPLBAsyncMPClient) -> None:
    _send(client, "moved-enough", num_migrations=2)
    _send(client, "pinned", pinned=True)
    client.migrator.on_rank_failed(client, 0)
    assert client.rank_of("moved-enough") is None and not client.is_moving("moved-enough")
    assert not client.is_moving("pinned")
    lost = client.outputs_queue.get_nowait(), client.outputs_queue.get_nowait()
    assert sorted((e.request_ids, e.engine_index) for e in lost) == [  # type: ignore[union-attr]
        (["moved-enough"], 0),
        (["pinned"], 0),
    ]
    assert client.router.stats.failed == {REASON_LIMIT: 1, REASON_PINNED: 1}
    assert not client.router.stats.migrated


async def test_a_request_no_rank_takes_is_moving_then_lost(client: DPLBAsyncMPClient) -> None:
    _send(client, "a")
    client.migrator.on_rank_failed(client, 0)
    assert client.rank_of("a") is None
    assert client.is_moving("a")  # the consumer does not fail it for the rank's death
    lost = await _lost(client)
    assert [(e.request_ids, e.engine_index) for e in lost] == [(["a"], 0)]
    assert isinstance(lost[0], RequestsLostError)
    assert not client.is_moving("a")
    assert client.router.stats.failed == {REASON_NO_RANK: 1}


async def test_an_abort_while_moving_stops_the_move(client: DPLBAsyncMPClient) -> None:
    _send(client, "a")
    client.migrator.on_rank_failed(client, 0)
    await client.abort_requests_async(["a"])
    assert not client.is_moving("a")
    assert await _lost(client) == []
    assert not client.router.stats.failed


async def test_late_outputs_of_a_failed_rank_are_dropped(client: DPLBAsyncMPClient) -> None:
    _send(client, "a")
    client.migrator.on_rank_failed(client, 0)
    await _lost(client)
    assert client.router.on_output("a", False, [9], from_rank=0) is False


def test_a_negative_limit_is_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        RequestMigrator(-1)


def test_outside_the_event_loop_nothing_moves() -> None:
    """A rank removed while the client closes, with no loop running: its requests are lost."""
    client = DPLBAsyncMPClient([], migration_limit=2)
    try:
        _send(client, "a")
        client.migrator.on_rank_failed(client, 0)
        lost = client.outputs_queue.get_nowait()
        assert isinstance(lost, RequestsLostError) and lost.request_ids == ["a"]
        assert not client.is_moving("a")
        assert client.router.stats.failed == {REASON_NO_RANK: 1}
    finally:
        client.shutdown()


async def test_the_request_a_rank_died_taking_in_is_failed_not_moved(
    client: DPLBAsyncMPClient,
) -> None:
    """Of the sends with a grammar the rank had not reported taking in, the oldest without
    output is the one it was compiling; plain ones before it were taken in, younger ones
    never reached it, and they all move."""
    _send(client, "streaming", grammar=True)
    _send(client, "queued", streamed=False, grammar=True)  # taken in: the rank reported it
    _send(client, "plain", streamed=False)  # intake cannot crash on it
    _send(client, "compiling", streamed=False, grammar=True)
    _send(client, "behind-it", streamed=False, grammar=True)
    client.router.load(0).requests_seen = 2
    client.migrator.on_rank_failed(client, 0)
    assert _poisoned(client) == ["compiling"]
    assert client.router.stats.poisoned == {POISON_INTAKE: 1}
    assert all(client.is_moving(r) for r in ("streaming", "queued", "plain", "behind-it"))
    assert not client.is_moving("compiling")


async def test_a_plain_request_is_never_suspected_at_intake(client: DPLBAsyncMPClient) -> None:
    """A rank killed while plain requests waited for it (an operator, the OOM killer) fails
    none of them: with nothing to compile, they move."""
    _send(client, "first", streamed=False)
    _send(client, "second", streamed=False)
    client.migrator.on_rank_failed(client, 0)
    assert _poisoned(client) == [] and not client.router.stats.poisoned
    assert client.is_moving("first") and client.is_moving("second")


async def test_a_request_running_on_two_ranks_as_they_died_is_failed(
    client: DPLBAsyncMPClient,
) -> None:
    _send(client, "a")
    client.migrator.on_rank_failed(client, 0)
    assert client.is_moving("a") and not client.router.stats.poisoned
    # It reached rank 1 (the move itself is the failover tests'), and streams there.
    client.migrator.forget(["a"])
    _send(client, "a", rank=1, num_migrations=1)
    client.router.load(1).requests_seen = 1
    client.migrator.on_rank_failed(client, 1)
    assert "a" in _poisoned(client)
    assert client.router.stats.poisoned == {POISON_RANK_DEATHS: 1}
    assert not client.is_moving("a")
