"""The output task's reader on its socket's FD: gone before the socket closes, and optional."""

from __future__ import annotations

import asyncio

import pytest

import shoal.client.transport.frame_reader as frame_reader
from shoal.client import AsyncMPClient
from tests.client.async_utils import TIMEOUT_S
from tests.engine.core_proc_utils import (
    ServedEngine,
    request,
)


async def _finishes(client: AsyncMPClient, request_id: str) -> bool:
    await client.add_request_async(request(request_id, max_tokens=3))
    while True:
        outputs = await asyncio.wait_for(client.get_output_async(), TIMEOUT_S)
        if any(o.request_id == request_id and o.finished for o in outputs.outputs):
            return True


async def test_shutdown_removes_the_reader_before_the_socket_closes(engine: ServedEngine) -> None:
    loop = asyncio.get_running_loop()
    first = AsyncMPClient([engine.endpoint], client_index=0)
    assert await asyncio.wait_for(first.call_utility_async("echo", 1), TIMEOUT_S) == 1
    reader = first.resources.output_reader
    assert reader is not None and reader[0] is loop
    first.shutdown()
    assert first.resources.output_reader is None
    # Nothing is left registered under the closed FD, whose number a new socket may reuse.
    assert not loop.remove_reader(reader[1])
    for index in (1, 2, 3):
        client = AsyncMPClient([engine.endpoint], client_index=index)
        try:
            echoed = await asyncio.wait_for(client.call_utility_async("echo", index), TIMEOUT_S)
            assert echoed == index
            assert await _finishes(client, f"after-{index}")
        finally:
            client.shutdown()


async def test_without_fd_readers_the_task_reads_through_zmq_asyncio(
    engine: ServedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(frame_reader._FrameWaiter, "start", classmethod(lambda *_: None))
    client = AsyncMPClient([engine.endpoint])
    try:
        assert await asyncio.wait_for(client.call_utility_async("echo", "x"), TIMEOUT_S) == "x"
        assert await _finishes(client, "fallback")
        assert client.resources.output_reader is None
    finally:
        client.shutdown()
