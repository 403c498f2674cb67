"""Adapter-aware routing end to end: a DPLB client over two real engines with two LoRA slots
each and four adapters. The cache-aware policy adds the cost of loading an adapter where it is
not live, so each adapter's requests stay on one rank and each adapter loads once; with that
cost at 0 (plain cache-aware routing) they scatter and the ranks keep swapping adapters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.client.routing.lb_client import DPLBAsyncMPClient
from shoal.client.routing.lb_policy import CacheAwarePolicy, SessionAffinityPolicy
from shoal.engine.protocol import LoRARequest
from tests.client.async_utils import collect
from tests.engine.core_proc_utils import ServedEngine, request, tiny_config
from tests.lora_factories import make_lora_adapter

NAMES = ("a", "b", "c", "d")
NUM_ROUNDS = 3


@pytest.fixture(scope="module")
def adapters(engine_checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root: Path = tmp_path_factory.mktemp("lora-routing")
    return {
        name: make_lora_adapter(root / name, engine_checkpoint, seed=i, rank=2)
        for i, name in enumerate(NAMES)
    }


@pytest.fixture
def ranks(engine_checkpoint: str) -> Iterator[list[ServedEngine]]:
    config = tiny_config(engine_checkpoint, enable_lora=True, max_loras=2, max_lora_rank=4)
    engines = [ServedEngine(config, engine_index=i) for i in range(2)]
    yield engines
    for engine in engines:
        engine.stop()


async def _run(
    ranks: list[ServedEngine], adapters: dict[str, str], lora_load_cost: float
) -> tuple[dict[str, set[int]], int, dict[str, int]]:
    """Sends NUM_ROUNDS rounds of one request per adapter, one at a time; returns the ranks
    each adapter's requests went to, the adapter loads of both ranks, and the reasons."""
    policy = SessionAffinityPolicy(inner=CacheAwarePolicy(lora_load_cost=lora_load_cost))
    client = DPLBAsyncMPClient([e.endpoint for e in ranks], policy=policy)
    placed: dict[str, set[int]] = {name: set() for name in NAMES}
    try:
        for turn in range(NUM_ROUNDS):
            for i, name in enumerate(NAMES):
                rid = f"{name}-{turn}"
                sent = request(rid, [5 + i, 9, 14 + turn, 3], max_tokens=2)
                sent.lora_request = LoRARequest(name, i + 1, adapters[name])
                await client.add_request_async(sent)
                rank = client.rank_of(rid)
                assert rank is not None
                placed[name].add(rank)
                outputs = (await collect(client, {rid}))[rid]
                assert outputs[-1].error_message is None
        stats = await client.call_utility_all_async("get_stats")
        reasons = dict(client.router.stats.decisions)
    finally:
        client.shutdown()
    return placed, sum(s.num_lora_loads_total for s in stats.values()), reasons


async def test_each_adapter_stays_on_one_rank_and_loads_once(
    ranks: list[ServedEngine], adapters: dict[str, str]
) -> None:
    placed, loads, reasons = await _run(ranks, adapters, lora_load_cost=512.0)
    assert all(len(r) == 1 for r in placed.values()), placed
    assert {next(iter(r)) for r in placed.values()} == {0, 1}  # both ranks serve
    assert loads == len(NAMES)
    assert reasons.get("lora", 0) >= len(NAMES) * (NUM_ROUNDS - 1)


async def test_plain_cache_aware_routing_loads_more(
    ranks: list[ServedEngine], adapters: dict[str, str]
) -> None:
    placed, loads, _ = await _run(ranks, adapters, lora_load_cost=0.0)
    assert loads > len(NAMES), (placed, loads)
