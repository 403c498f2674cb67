"""KVCacheManager and BlockPool: allocation, conservation, prefix hits, eviction order, and the
blocks a sliding window frees."""

from __future__ import annotations

import pytest

from shoal.engine.kv_cache import FREED_BLOCK, KVCacheManager
from shoal.engine.protocol import SamplingParams
from shoal.engine.request import Request

BLOCK_SIZE = 4


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams())


def _compute(kv: KVCacheManager, request: Request, num_tokens: int | None = None) -> list[int]:
    """Allocates and 'computes' a request's tokens (after its prefix hit), as a step would."""
    computed, num_cached = kv.get_computed_blocks(request)
    num_new = (request.num_tokens if num_tokens is None else num_tokens) - num_cached
    assert kv.allocate_slots(request, num_new, computed)
    request.num_computed_tokens = num_cached + num_new
    kv.cache_full_blocks(request)
    return kv.get_block_ids(request.request_id)


def _assert_conserved(kv: KVCacheManager, *live: Request) -> None:
    owned = [b for r in live for b in kv.get_block_ids(r.request_id) if b != FREED_BLOCK]
    free = list(kv.block_pool.free_block_ids())
    assert len(set(owned)) + len(free) == kv.num_blocks
    assert not set(owned) & set(free)


def test_allocate_and_free_conserve_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    a, b = _request("a", list(range(9))), _request("b", list(range(100, 105)))
    assert kv.allocate_slots(a, 9)
    assert kv.allocate_slots(b, 5)
    assert len(kv.get_block_ids("a")) == 3 and len(kv.get_block_ids("b")) == 2
    assert not set(kv.get_block_ids("a")) & set(kv.get_block_ids("b"))
    assert kv.num_free_blocks == 5 and kv.usage == pytest.approx(0.5)
    _assert_conserved(kv, a, b)
    # Growing within the last block takes nothing; crossing a boundary takes one block.
    a.num_computed_tokens = 9
    assert kv.allocate_slots(a, 3) and kv.num_free_blocks == 5
    assert kv.allocate_slots(a, 4) and kv.num_free_blocks == 4
    kv.free(a)
    kv.free(b)
    kv.free(b)  # freeing twice is a no-op
    assert kv.num_free_blocks == 10 and kv.usage == 0.0
    assert kv.get_block_ids("a") == []


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    a = _request("a", list(range(12)))
    _compute(kv, a)
    b = _request("b", list(range(20)))
    assert not kv.can_allocate(b, 20)
    assert not kv.allocate_slots(b, 20)
    assert kv.num_free_blocks == 1 and kv.get_block_ids("b") == []
    assert kv.num_prefix_cache_queries == 12  # b was never admitted


def test_repeated_prompt_hits_full_block_prefix_but_never_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    prompt = list(range(10))  # two full blocks and a partial one
    a = _request("a", prompt)
    a_blocks = list(_compute(kv, a))
    b = _request("b", prompt)
    computed, num_cached = kv.get_computed_blocks(b)
    assert computed == a_blocks[:2] and num_cached == 8
    # A prompt of exactly two blocks may reuse only the first: its last token must be computed.
    c = _request("c", prompt[:8])
    computed, num_cached = kv.get_computed_blocks(c)
    assert computed == a_blocks[:1] and num_cached == 4


def test_shared_blocks_are_reference_counted() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    prompt = list(range(10))
    a = _request("a", prompt)
    a_blocks = list(_compute(kv, a))
    b = _request("b", [*prompt, 77])
    b_blocks = _compute(kv, b)
    assert b_blocks[:2] == a_blocks[:2] and b_blocks[2] != a_blocks[2]
    assert [kv.block_pool.blocks[i].ref_count for i in a_blocks[:2]] == [2, 2]
    assert kv.num_free_blocks == 16 - 4
    kv.free(a)
    assert kv.num_free_blocks == 16 - 3  # a's shared blocks stay owned by b
    kv.free(b)
    assert kv.num_free_blocks == 16
    assert kv.num_prefix_cache_queries == 10 + 11 and kv.num_prefix_cache_hits == 8


def test_hash_chains_over_the_whole_prefix() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    _compute(kv, _request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block after a different first block: no hit at all.
    computed, num_cached = kv.get_computed_blocks(_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert computed == [] and num_cached == 0
    # Same first block, different second: only the first.
    computed, num_cached = kv.get_computed_blocks(_request("c", [1, 2, 3, 4, 5, 6, 7, 0, 9]))
    assert len(computed) == 1 and num_cached == 4


def test_generated_tokens_are_cached_too() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    a = _request("a", [1, 2, 3, 4, 5, 6])
    _compute(kv, a)
    for token in (7, 8, 9):  # decode: the KV of each sampled token is computed next step
        a.append_output_token(token)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        kv.cache_full_blocks(a)
    # 9 tokens, 8 computed: blocks [1..4] and [5..8] are cached, the second with outputs.
    computed, num_cached = kv.get_computed_blocks(_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    assert computed == kv.get_block_ids("a")[:2] and num_cached == 8


def test_duplicate_content_computed_twice_keeps_one_cached_copy() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    a = _request("a", [1, 2, 3, 4, 9])
    b = _request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # Both admitted before either computed anything: no hits, two copies of block [1..4].
    for r in (a, b):
        assert kv.get_computed_blocks(r) == ([], 0)
        assert kv.allocate_slots(r, r.num_tokens)
    for r in (a, b):
        r.num_computed_tokens = r.num_tokens
        kv.cache_full_blocks(r)
    assert kv.block_pool.num_cached_blocks == 2  # a's [1..4] and b's [5..8]
    # b's second block chains onto the surviving copy, so a third request hits both.
    computed, num_cached = kv.get_computed_blocks(_request("c", b.prompt_token_ids))
    assert computed == [kv.get_block_ids("a")[0], kv.get_block_ids("b")[1]]
    assert num_cached == 8
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 16


def test_eviction_is_lru_with_tail_blocks_first_and_plain_blocks_before_cached() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    a = _request("a", list(range(13)))  # three full blocks and one partial
    a_blocks = list(_compute(kv, a))
    kv.free(a)
    free_order = list(kv.block_pool.free_block_ids())
    # Uncached blocks first (the untouched two and a's partial), then a's tail before its head.
    assert set(free_order[:3]) == set(range(6)) - set(a_blocks[:3])
    assert free_order[3:] == [a_blocks[2], a_blocks[1], a_blocks[0]]
    # Taking four blocks evicts only a's last full block; its head is still a hit.
    b = _request("b", list(range(100, 116)))
    assert kv.allocate_slots(b, 16)
    assert kv.block_pool.blocks[a_blocks[2]].block_hash is None
    computed, num_cached = kv.get_computed_blocks(_request("c", list(range(13))))
    assert computed == a_blocks[:2] and num_cached == 8


def test_free_cached_hit_blocks_count_against_the_free_pool() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    a = _request("a", list(range(13)))
    _compute(kv, a)
    kv.free(a)
    b = _request("b", list(range(13)) + [99] * 4)  # hits 3 blocks, needs 2 more: 5 > 4
    computed, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 12
    assert not kv.allocate_slots(b, 5, computed)
    assert kv.num_free_blocks == 4 and kv.block_pool.num_cached_blocks == 3
    c = _request("c", list(range(13)))  # hits 3, needs 1 more: exactly fits
    computed, num_cached = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, 1, computed)
    assert kv.get_block_ids("c")[:3] == computed and kv.num_free_blocks == 0
    # The hit blocks were taken off the free queue before the new block was allocated.
    assert kv.block_pool.num_cached_blocks == 3


def test_reset_prefix_cache_only_when_idle() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    a = _request("a", list(range(9)))
    _compute(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.get_computed_blocks(_request("b", list(range(9))))[1] == 8
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(_request("b", list(range(9)))) == ([], 0)
    assert kv.block_pool.num_cached_blocks == 0 and kv.num_free_blocks == 8


def test_disabled_prefix_caching_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    a = _request("a", list(range(9)))
    _compute(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(_request("b", list(range(9)))) == ([], 0)
    assert kv.block_pool.num_cached_blocks == 0
    assert kv.num_prefix_cache_queries == 0 and kv.num_prefix_cache_hits == 0


def test_a_freed_plain_block_is_reused_before_cached_ones() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    a = _request("a", list(range(8)))
    _compute(kv, a)  # two full blocks, both cached
    kv.free(a)
    b = _request("b", [50, 51, 52])
    _compute(kv, b)  # a partial block: nothing to keep
    kv.free(b)
    c = _request("c", list(range(100, 108)))
    assert kv.allocate_slots(c, 8)  # takes the two plain blocks, evicting nothing
    assert kv.block_pool.num_cached_blocks == 2
    assert kv.get_computed_blocks(_request("d", list(range(9))))[1] == 8


def test_a_sliding_window_frees_the_blocks_behind_it_and_keeps_them_cached() -> None:
    kv = KVCacheManager(
        num_blocks=12, block_size=BLOCK_SIZE, enable_prefix_caching=True, sliding_window=6
    )
    a = _request("a", list(range(30)))
    _compute(kv, a, 8)
    for end in (16, 24, 30):  # chunked prefill, 8 tokens a step
        _advance(kv, a, end)
    # The next query (position 30) sees positions 25..30: blocks 0-5 (positions 0-23) are
    # behind the window, block 6 (24-27) is not.
    assert kv.allocate_slots(a, 1)
    table = kv.get_block_ids("a")
    assert table[:6] == [FREED_BLOCK] * 6 and FREED_BLOCK not in table[6:]
    _assert_conserved(kv, a)
    # Freed, but still cached: the same prompt hits all of its full blocks but the last.
    b = _request("b", list(range(30)))
    computed, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 28 and len(computed) == 7
    kv.free(a)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_window_hit_is_held_whole_for_its_first_step_then_trimmed() -> None:
    kv = KVCacheManager(
        num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=True, sliding_window=5
    )
    a = _request("a", list(range(20)))
    _compute(kv, a)
    kv.free(a)  # its blocks stay cached
    b = _request("b", [*range(20), 99, 98])
    _compute(kv, b)  # hits 20 tokens (5 blocks), computes 2
    assert FREED_BLOCK not in kv.get_block_ids("b")
    assert kv.allocate_slots(b, 1)  # position 22 sees 18..22: blocks 0-3 go
    assert kv.get_block_ids("b")[:4] == [FREED_BLOCK] * 4
    _assert_conserved(kv, b)


def _advance(kv: KVCacheManager, request: Request, end: int) -> None:
    assert kv.allocate_slots(request, end - request.num_computed_tokens)
    request.num_computed_tokens = end
    kv.cache_full_blocks(request)
