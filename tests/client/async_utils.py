"""Helpers for the asyncio client tests: a bounded wait, and collecting outputs until finished."""

from __future__ import annotations

import asyncio

from shoal.client import AsyncMPClient
from shoal.engine.protocol import EngineCoreOutput

TIMEOUT_S = 10.0


async def collect(
    client: AsyncMPClient, request_ids: set[str]
) -> dict[str, list[EngineCoreOutput]]:
    """Every output of `request_ids` until each has finished (other ids are recorded too)."""
    seen: dict[str, list[EngineCoreOutput]] = {}
    unfinished = set(request_ids)
    while unfinished:
        outputs = await asyncio.wait_for(client.get_output_async(), TIMEOUT_S)
        for output in outputs.outputs:
            seen.setdefault(output.request_id, []).append(output)
            if output.finished:
                unfinished.discard(output.request_id)
    return seen
