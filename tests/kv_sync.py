"""What the cache-routing tests ask a front end's client and its engines: the engines' prefix
cache hits, and a wait until the client's KV index holds exactly what the engines cache."""

from __future__ import annotations

import asyncio

from shoal.client.routing.lb_client import DPLBAsyncMPClient


async def engine_hits(client: DPLBAsyncMPClient) -> int:
    stats = await client.call_utility_all_async("get_stats")
    return sum(s.prefix_cache_hits_total for s in stats.values())


async def synced(client: DPLBAsyncMPClient, attempts: int = 100) -> None:
    """Waits until the client's index holds exactly what every engine's cache holds (asked
    `attempts` times, 50 ms apart)."""
    for _ in range(attempts):
        snapshots = await client.call_utility_all_async("get_kv_cache_snapshot")
        if all(
            client.kv_index.views[rank].keys == set(snap.block_keys)
            for rank, snap in snapshots.items()
        ):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the client's index never matched the engines' caches")
