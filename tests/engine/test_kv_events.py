"""KV events: the prefix cache reports what it gains and evicts, as the keys clients compute."""

from __future__ import annotations

from shoal.engine.block_hash import prompt_routing_keys
from shoal.engine.kv_cache import KVCacheManager
from shoal.engine.kv_events import KVEventLog, with_kv_events
from shoal.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequestType,
    KVCacheSnapshot,
    SamplingParams,
)
from shoal.engine.request import Request
from tests.engine.core_proc_utils import BLOCK_SIZE as ENGINE_BLOCK_SIZE
from tests.engine.core_proc_utils import RawPeer, ServedEngine, call_utility, request

BLOCK_SIZE = 4


def _compute(kv: KVCacheManager, request_id: str, tokens: list[int]) -> Request:
    """Admits, 'computes' and frees a request, as the scheduler would over its life."""
    request = Request(request_id, tokens, SamplingParams())
    computed, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, len(tokens) - num_cached, computed)
    request.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(request)
    kv.free(request)
    return request


def test_the_engine_caches_blocks_under_the_keys_a_client_computes() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    tokens = list(range(100, 113))  # 3 full blocks and one token
    _compute(kv, "a", tokens)
    (batch,) = kv.block_pool.kv_events.take()
    assert batch.seq == 1 and not batch.removed
    assert batch.stored == prompt_routing_keys(tokens, BLOCK_SIZE)
    assert sorted(kv.block_pool.cached_routing_keys()) == sorted(batch.stored)
    # A prompt sharing two blocks: its first keys are the same, the third differs.
    other = prompt_routing_keys([*tokens[:8], 1, 2, 3, 4, 5], BLOCK_SIZE)
    assert other[:2] == batch.stored[:2] and other[2] != batch.stored[2]


def test_eviction_and_reset_are_reported_and_batches_are_numbered() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    log = kv.block_pool.kv_events
    _compute(kv, "a", list(range(8)))  # 2 cached blocks
    first = log.take()[0].stored
    _compute(kv, "b", list(range(50, 58)))  # 2 more: the pool is full of cached blocks
    _compute(kv, "c", list(range(80, 88)))  # evicts a's
    batches = log.take()
    assert [b.seq for b in batches] == [2]
    assert sorted(batches[0].removed) == sorted(first)
    assert len(batches[0].stored) == 4
    assert log.take() == []  # nothing new, no batch
    assert kv.reset_prefix_cache()
    (reset,) = log.take()
    assert reset.seq == 3 and len(reset.removed) == 4 and not kv.block_pool.cached_routing_keys()


def test_a_blocks_parent_cached_again_makes_it_reachable_again() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    tokens = list(range(9))
    _compute(kv, "a", tokens)
    # Evict only the first block (the head goes last, so free it and evict by hand).
    pool = kv.block_pool
    head = next(b for b in pool.blocks if b.cache_key is not None and b.cache_key[0] == 0)
    pool._uncache(head)
    _compute(kv, "b", tokens[:5])  # caches the first block again, same hash
    again = kv.get_computed_blocks(Request("c", tokens, SamplingParams()))
    assert again[1] == 8  # both blocks hit: the second was never evicted


def test_a_churning_cache_sends_an_overflow_marker_instead_of_its_keys() -> None:
    log = KVEventLog(max_keys=3)
    for key in range(10):
        log.on_stored(key)
    log.on_removed(99)
    (batch,) = log.take()
    assert batch.is_overflow and not batch.stored and not batch.removed
    log.on_stored(7)
    assert log.take()[0].stored == [7]


def test_every_attached_client_gets_every_batch_in_order() -> None:
    log = KVEventLog()
    log.on_stored(1)
    log.seal()  # a snapshot sealed mid-turn
    log.on_removed(1)
    batches = log.take()
    step = {5: EngineCoreOutputs(engine_index=2)}
    frames = with_kv_events(step, batches, clients=[5, 6], engine_index=2)
    by_client: dict[int, list[int]] = {}
    for client, frame in frames:
        assert frame.kv_events is not None
        by_client.setdefault(client, []).append(frame.kv_events.seq)
    assert by_client == {5: [1, 2], 6: [1, 2]}
    assert frames[1][1] is step[5]  # the last batch rides on the step's own frame
    assert with_kv_events(step, [], [5, 6], 2) == [(5, step[5])]


def test_an_engine_sends_numbered_batches_only_to_the_clients_that_asked(
    engine: ServedEngine,
) -> None:
    router, plain = RawPeer(engine.endpoint, client_index=1), RawPeer(engine.endpoint, 2)
    try:
        router.hello(wants_kv_events=True)
        plain.hello()
        prompt = list(range(3, 3 + 3 * ENGINE_BLOCK_SIZE + 1))
        plain.send_typed(
            EngineCoreRequestType.ADD, request("r", prompt, max_tokens=ENGINE_BLOCK_SIZE)
        )
        assert all(o.kv_events is None for o in _frames_until_finished(plain, "r"))
        # The subscriber sees every block the request cached, in numbered batches.
        keys: set[int] = set()
        seqs: list[int] = []
        while len(keys) < 4:  # the prompt's 3 full blocks and one of prompt + output
            events = router.recv().kv_events
            if events is not None:
                seqs.append(events.seq)
                keys |= set(events.stored)
                keys -= set(events.removed)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert set(prompt_routing_keys(prompt, ENGINE_BLOCK_SIZE)) <= keys
        snapshot = call_utility(router, 7, "get_kv_cache_snapshot")
        assert isinstance(snapshot, KVCacheSnapshot)
        assert set(snapshot.block_keys) == keys and snapshot.seq == seqs[-1]
        assert snapshot.block_size == ENGINE_BLOCK_SIZE
    finally:
        router.close()
        plain.close()


def _frames_until_finished(peer: RawPeer, request_id: str) -> list[EngineCoreOutputs]:
    frames = []
    while True:
        frame = peer.recv()
        frames.append(frame)
        if any(o.request_id == request_id and o.finished for o in frame.outputs):
            return frames
