"""Cache-aware routing end to end: DPLB clients over two real engines and their KV events."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from shoal.client.routing.kv_index import SyncState
from shoal.client.routing.lb_client import DPLBAsyncMPClient
from shoal.engine.block_hash import prompt_routing_keys
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import EngineCoreRequest, KVCacheEvents
from tests.client.async_utils import collect
from tests.engine.core_proc_utils import BLOCK_SIZE, ServedEngine, request, tiny_config
from tests.kv_sync import engine_hits, synced

# Room for one document and its conversations' tails per rank, not for two documents.
NUM_BLOCKS = 20
DOC_TOKENS = 12 * BLOCK_SIZE
DOCS = {
    "A": [3 + (i * 7) % 90 for i in range(DOC_TOKENS)],
    "B": [3 + (i * 11 + 5) % 90 for i in range(DOC_TOKENS)],
}


@pytest.fixture
def ranks(engine_checkpoint: str) -> Iterator[list[ServedEngine]]:
    config = tiny_config(engine_checkpoint, num_gpu_blocks_override=NUM_BLOCKS)
    engines = [ServedEngine(config, engine_index=i) for i in range(2)]
    yield engines
    for engine in engines:
        engine.stop()


async def _turn(
    client: DPLBAsyncMPClient, request_id: str, prompt: list[int]
) -> tuple[int, list[int], int]:
    """Sends one turn; returns its rank, its output tokens and the engine's own hit count."""
    await client.add_request_async(request(request_id, prompt, max_tokens=4))
    rank = client.rank_of(request_id)
    assert rank is not None
    outputs = (await collect(client, {request_id}))[request_id]
    tokens = [t for o in outputs for t in o.new_token_ids]
    return rank, tokens, outputs[0].num_cached_tokens


async def test_conversations_settle_one_document_per_rank_and_hit_their_history(
    ranks: list[ServedEngine],
) -> None:
    front = DPLBAsyncMPClient([e.endpoint for e in ranks])
    other = DPLBAsyncMPClient([e.endpoint for e in ranks], client_index=1)
    try:
        history = {f"{doc}{n}": list(DOCS[doc]) for doc in DOCS for n in (1, 2)}
        placed: dict[str, set[int]] = {doc: set() for doc in DOCS}
        hits_before = await engine_hits(front)
        reported_hits = 0
        for turn in range(3):
            for name, prompt in history.items():
                prompt.extend(range(40 + turn * 8, 48 + turn * 8))  # this turn's question
                rank, answer, hit = await _turn(front, f"{name}-{turn}", prompt)
                placed[name[0]].add(rank)
                reported_hits += hit
                if turn:  # everything before this turn's question was computed last turn
                    previous = len(prompt) - 8
                    assert hit >= previous // BLOCK_SIZE * BLOCK_SIZE, (name, turn, hit)
                prompt.extend(answer)
        assert placed["A"] in ({0}, {1}) and placed["B"] in ({0}, {1})
        assert placed["A"] != placed["B"]
        # The engines' own counters agree with the hits they reported per request...
        assert await engine_hits(front) - hits_before == reported_hits
        # ...and with what the router predicted when it chose each rank.
        stats = front.router.stats
        assert stats.predicted_hit_tokens == stats.actual_hit_tokens == reported_hits
        assert stats.decisions.get("cache", 0) >= 10

        # A second front end, which sent nothing, holds the same view and decides alike.
        await synced(other)
        for doc, prompt in DOCS.items():
            probe = EngineCoreRequest(
                f"probe-{doc}", [*prompt, 1, 2, 3], request("x").sampling_params
            )
            first, second = front.route(probe), other.route(probe)
            assert first.rank == second.rank == next(iter(placed[doc]))
            assert first.predicted_hit_tokens == second.predicted_hit_tokens == DOC_TOKENS
    finally:
        front.shutdown()
        other.shutdown()


async def test_an_evicted_prefix_leaves_every_index_and_missed_events_resync(
    ranks: list[ServedEngine],
) -> None:
    front = DPLBAsyncMPClient([e.endpoint for e in ranks])
    lossy = DPLBAsyncMPClient([e.endpoint for e in ranks], client_index=1)
    dropped: list[KVCacheEvents] = []
    apply = lossy.kv_index.apply_events

    def drop_one(rank: int, batch: KVCacheEvents) -> bool:
        view = lossy.kv_index.views[rank]
        if not dropped and view.state is SyncState.LIVE and batch.seq == view.next_seq:
            dropped.append(batch)  # lost on the way, on purpose
            return False
        return apply(rank, batch)

    lossy.kv_index.apply_events = drop_one  # type: ignore[method-assign]
    try:
        doc = DOCS["A"]
        rank, _, _ = await _turn(front, "doc", [*doc, 1])
        keys = prompt_routing_keys([*doc, 2], BLOCK_SIZE)
        assert front.kv_index.match(keys, [0, 1])[rank] == len(keys)
        # Other prompts pinned to that rank push the document out of its cache.
        for i in range(3):
            flood = [50 + i] + [(i * 13 + t) % 90 + 3 for t in range(DOC_TOKENS + 20)]
            pinned = request(f"flood-{i}", flood, max_tokens=2)
            pinned.data_parallel_rank = rank
            await front.add_request_async(pinned)
            await collect(front, {f"flood-{i}"})
        for client in (front, lossy):
            await synced(client)
            assert client.kv_index.match(keys, [0, 1]) == {0: 0, 1: 0}
            decision = client.route(
                EngineCoreRequest("probe", [*doc, 2], request("x").sampling_params)
            )
            assert decision.predicted_hit_tokens == 0 and decision.reason != "cache"
            # What the flood left cached there is followed: the resynced client too.
            again = client.route(
                EngineCoreRequest("probe", [*flood, 9], request("x").sampling_params)
            )
            assert (again.rank, again.reason) == (rank, "cache")
        assert dropped and sum(v.num_resyncs for v in lossy.kv_index.views.values()) == 1
    finally:
        front.shutdown()
        lossy.shutdown()


async def test_a_killed_rank_leaves_the_index_and_is_never_routed_to(
    ranks: list[ServedEngine],
) -> None:
    client = DPLBAsyncMPClient([e.endpoint for e in ranks])
    try:
        doc = DOCS["B"]
        pinned = request("warm", [*doc, 1], max_tokens=2)
        pinned.data_parallel_rank = 1
        await client.add_request_async(pinned)
        await collect(client, {"warm"})
        await synced(client)
        ranks[1].stop()
        with pytest.raises(EngineDeadError) as lost:
            await asyncio.wait_for(client.get_output_async(), 10)
        assert lost.value.engine_index == 1
        assert client.lb_engines == [0] and 1 not in client.kv_index.views
        for i in range(5):
            rank, _, _ = await _turn(client, f"after-{i}", [*doc, i + 1])
            assert rank == 0
    finally:
        client.shutdown()


async def test_a_session_stays_on_its_rank_while_the_load_allows(
    ranks: list[ServedEngine],
) -> None:
    client = DPLBAsyncMPClient([e.endpoint for e in ranks])
    try:
        doc = DOCS["B"]
        warm = request("warm", [*doc, 1], max_tokens=2)
        warm.data_parallel_rank = 1
        await client.add_request_async(warm)
        await collect(client, {"warm"})
        await synced(client)
        # The session starts where the cache does not pull: rank 0, the emptier cache...
        first = [(t * 17) % 90 + 3 for t in range(40)]
        await client.add_request_async(request("s-0", first, max_tokens=2), session_id="s")
        assert client.rank_of("s-0") == 0 and client.router.stats.decisions == {"load": 1}
        await collect(client, {"s-0"})
        # ...and stays there for prompts that rank 1 holds cached, which go to rank 1 without it.
        for i in range(1, 4):
            turn = request(f"s-{i}", [*doc, i + 1], max_tokens=2)
            await client.add_request_async(turn, session_id="s")
            assert client.rank_of(f"s-{i}") == 0
            await collect(client, {f"s-{i}"})
        assert client.router.stats.decisions.get("session") == 3
        assert client.route(request("free", [*doc, 9])).rank == 1
    finally:
        client.shutdown()


async def test_prompts_sent_before_any_output_follow_the_blocks_expected_there(
    ranks: list[ServedEngine],
) -> None:
    client = DPLBAsyncMPClient([e.endpoint for e in ranks])
    docs = {**DOCS, "C": [3 + (i * 5 + 2) % 90 for i in range(DOC_TOKENS)]}
    # The client sees neither outputs nor KV events during the burst: the window between a
    # send and its first output, when no event can show the prompt's blocks yet.
    held_outputs: list[tuple[list[Any], int]] = []
    held_events: list[tuple[int, KVCacheEvents]] = []
    on_outputs, apply_events = client.router.on_outputs, client.kv_index.apply_events
    try:
        await synced(client)
        client.router.on_outputs = lambda outs, rank: held_outputs.append((list(outs), rank))  # type: ignore[method-assign,func-returns-value]
        client.kv_index.apply_events = lambda rank, b: held_events.append((rank, b)) or False  # type: ignore[method-assign,func-returns-value]
        sent = {}
        for name in ("A1", "B1", "A2", "C1", "B2"):
            await client.add_request_async(request(name, [*docs[name[0]], int(name[1])]))
            sent[name] = client.rank_of(name)
        # A2 and B2 go where A1 and B1 went. With nothing expected, B2 would find no cache
        # anywhere and go to rank 0 (equal load: A1, A2 there, B1, C1 on rank 1).
        assert sent["A1"] != sent["B1"]
        assert sent["A2"] == sent["A1"] and sent["B2"] == sent["B1"], sent
        assert client.router.stats.decisions.get("cache") == 2
        client.router.on_outputs = on_outputs  # type: ignore[method-assign]
        client.kv_index.apply_events = apply_events  # type: ignore[method-assign]
        for outs, rank in held_outputs:
            on_outputs(outs, rank)
        for rank, batch in held_events:
            apply_events(rank, batch)
        await collect(client, set(sent))
        assert all(not view.expected for view in client.kv_index.views.values())
        assert len(client.router) == 0
    finally:
        client.shutdown()
