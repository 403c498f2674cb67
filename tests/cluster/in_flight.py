"""What the failover tests watch of a driver's in-flight requests: its DPLB client, and when its
requests on a rank have streamed enough tokens for a fault to strike mid-stream."""

from __future__ import annotations

import asyncio
import time

from shoal.client import AsyncLLM
from shoal.client.routing.lb_client import DPLBAsyncMPClient


def dplb_client(driver: AsyncLLM) -> DPLBAsyncMPClient:
    assert isinstance(driver.engine_core, DPLBAsyncMPClient)
    return driver.engine_core


async def decoding_on(drivers: list[AsyncLLM], rank: int, min_tokens: int) -> None:
    """Waits until every driver's request on `rank` has streamed `min_tokens` tokens."""
    deadline = time.monotonic() + 60
    while True:
        entries = [
            entry for d in drivers for entry in dplb_client(d).router.loads[rank].in_flight.values()
        ]
        if entries and all(len(e.token_ids) >= min_tokens for e in entries):
            return
        assert time.monotonic() < deadline, "the requests did not decode on the rank"
        await asyncio.sleep(0.02)
