"""`RequestMigrator` on a real DP client with no rank to move to: what may not move is lost at
once, what may is "moving" until no rank takes it, an abort stops a move. (Moves that succeed,
on a real cluster: tests/cluster/test_failover.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from shoal.client.dp_client import DPLBAsyncMPClient
from shoal.client.migration import (
    REASON_LIMIT,
    REASON_NO_RANK,
    REASON_PINNED,
    RequestMigrator,
    RequestsLostError,
)
from shoal.engine.protocol import EngineCoreRequest, SamplingParams


@pytest_asyncio.fixture
async def client() -> AsyncIterator[DPLBAsyncMPClient]:
    made = DPLBAsyncMPClient([], migration_limit=2)
    yield made
    made.shutdown()


def _send(
    client: DPLBAsyncMPClient, request_id: str, *, pinned: bool = False, num_migrations: int = 0
) -> None:
    """Records `request_id` as sent to rank 0 with two tokens streamed."""
    request = EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_tokens=8),
        data_parallel_rank=0 if pinned else None,
    )
    client.router.on_sent(request_id, 0, 3, request, num_migrations=num_migrations)
    client.router.on_output(request_id, False, [7, 8])


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
