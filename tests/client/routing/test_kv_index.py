"""`KVCacheIndex`: the per-rank view of the engines' prefix caches and its resync protocol."""

from __future__ import annotations

from shoal.client.routing.kv_index import MAX_BUFFERED_BATCHES, KVCacheIndex, SyncState
from shoal.engine.protocol import KVCacheEvents, KVCacheSnapshot


def _live(index: KVCacheIndex, rank: int, keys: list[int], seq: int = 0) -> None:
    index.add_rank(rank, block_size=16)
    assert index.need_snapshot(rank)
    assert not index.apply_snapshot(rank, KVCacheSnapshot(seq, keys, 16))


def test_match_counts_each_ranks_leading_blocks() -> None:
    index = KVCacheIndex()
    _live(index, 0, [1, 2, 3])
    _live(index, 1, [1, 2, 9])
    _live(index, 2, [2, 3])
    assert index.match([1, 2, 3, 4], [0, 1, 2]) == {0: 3, 1: 2, 2: 0}
    assert index.match([1, 2, 3], [1]) == {1: 2}
    assert index.match([], [0, 1]) == {0: 0, 1: 0}
    assert index.match([1], [0, 7]) == {0: 1, 7: 0}  # an unknown rank holds nothing
    assert index.block_size == 16 and index.num_cached_blocks(0) == 3


def test_batches_apply_in_order_and_stale_ones_are_ignored() -> None:
    index = KVCacheIndex()
    _live(index, 0, [1], seq=4)
    assert not index.apply_events(0, KVCacheEvents(4, stored=[99]))  # in the snapshot already
    assert not index.apply_events(0, KVCacheEvents(5, stored=[2, 3], removed=[1]))
    assert index.match([1, 2, 3], [0]) == {0: 0}
    assert index.match([2, 3], [0]) == {0: 2}
    assert index.views[0].keys == {2, 3}


def test_a_gap_drops_the_view_until_a_snapshot_resyncs_it() -> None:
    index = KVCacheIndex()
    _live(index, 0, [1, 2])
    assert index.apply_events(0, KVCacheEvents(2, stored=[3]))  # batch 1 was missed
    assert index.views[0].state is SyncState.UNSYNCED
    assert index.match([1, 2], [0]) == {0: 0}  # no guess while unsynced
    assert index.need_snapshot(0) and not index.need_snapshot(0)  # one request at a time
    # Batches that arrive while the snapshot is on its way are replayed past it.
    index.apply_events(0, KVCacheEvents(3, stored=[4]))
    index.apply_events(0, KVCacheEvents(4, stored=[5]))
    assert not index.apply_snapshot(0, KVCacheSnapshot(3, [1, 2, 3, 4], 16))
    assert index.views[0].keys == {1, 2, 3, 4, 5}
    assert index.views[0].num_resyncs == 1


def test_an_overflow_marker_or_a_lost_buffer_asks_for_another_snapshot() -> None:
    index = KVCacheIndex()
    _live(index, 0, [1])
    assert index.apply_events(0, KVCacheEvents(1, is_overflow=True))
    assert index.need_snapshot(0)
    for seq in range(1, MAX_BUFFERED_BATCHES + 10):  # more than the buffer holds
        index.apply_events(0, KVCacheEvents(seq, stored=[seq]))
    assert index.apply_snapshot(0, KVCacheSnapshot(0, [], 16))  # batches 1..9 are gone
    assert index.views[0].state is SyncState.UNSYNCED


def test_a_failed_snapshot_and_a_rank_that_leaves() -> None:
    index = KVCacheIndex()
    _live(index, 0, [1, 2])
    _live(index, 1, [1])
    index.add_rank(2, 16)
    assert index.need_snapshot(2)
    index.snapshot_failed(2)
    assert index.views[2].state is SyncState.UNSYNCED
    index.drop_rank(0)
    assert index.match([1, 2], [0, 1]) == {0: 0, 1: 1}
    assert not index.apply_events(0, KVCacheEvents(1, stored=[5]))  # a rank not known
    assert not index.apply_snapshot(0, KVCacheSnapshot(1, [5], 16))
    # A rank that comes back starts empty, with its own (possibly reused) bit.
    _live(index, 0, [7])
    assert index.match([1], [0, 1]) == {0: 0, 1: 1}
    assert index.match([7], [0, 1]) == {0: 1, 1: 0}


def test_expected_blocks_match_until_their_prompts_settle() -> None:
    index = KVCacheIndex()
    _live(index, 0, [])
    _live(index, 1, [1])
    index.expect(0, [1, 2, 3])
    index.expect(0, [1, 2])  # a second prompt in flight with the same document
    assert index.match([1, 2, 3, 4], [0, 1]) == {0: 3, 1: 1}
    assert index.num_keys == 1 + 3
    index.settle(0, [1, 2, 3])
    assert index.match([1, 2, 3], [0, 1]) == {0: 2, 1: 1}  # the other prompt still expects 2
    # The rank's events now say what it kept: cached blocks match, expected ones are gone.
    assert not index.apply_events(0, KVCacheEvents(1, stored=[1, 2]))
    index.settle(0, [1, 2])
    assert index.match([1, 2, 3], [0, 1]) == {0: 2, 1: 1}
    assert index.views[0].expected == {}
    index.settle(0, [1, 2])  # settling again, or an unknown rank, changes nothing
    index.settle(5, [1])
    assert index.match([1, 2], [0]) == {0: 2}


def test_a_rank_that_leaves_takes_its_expected_blocks_along() -> None:
    index = KVCacheIndex()
    _live(index, 0, [])
    _live(index, 1, [])
    index.expect(0, [7, 8])
    index.expect(1, [7])
    index.drop_rank(0)
    assert index.match([7, 8], [0, 1]) == {0: 0, 1: 1}
    index.settle(1, [7])
    assert index.num_keys == 0
