"""The physical KV block pool: reference counts, the LRU free queue and the prefix-cache index.

Owns the bookkeeping of block ids 0..num_blocks-1 only. The model runner owns the KV tensors,
and which request holds which blocks is `shoal.engine.kv_cache`'s business. No torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from shoal.engine.block_hash import hash_block, routing_key
from shoal.engine.kv_events import KVEventLog

# (parent block hash, the block's token ids): the exact content of a full block in its context.
BlockKey = tuple[int, tuple[int, ...]]


@dataclass
class KVBlock:
    """Bookkeeping of one block of `block_size` token slots.

    `block_hash` is set while the block is in the prefix cache; `cache_key` is the exact
    content it was registered under.
    """

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    cache_key: BlockKey | None = None


class BlockPool:
    """All blocks, the free queue and the prefix-cache index.

    Free queue: every block with `ref_count == 0`, in eviction order. Blocks that hold cached
    KV are appended at the back when freed (least recently used is evicted first); blocks with
    nothing worth keeping go to the front so they are reused before any cached block.

    Block hashes are the chained 128-bit content hashes of `shoal.engine.block_hash`, the
    same ones clients compute to route by cache: the index maps the exact key
    `(parent hash, token ids)` to a block, so serving wrong KV would take two different
    prefixes with equal 128-bit hashes. A block whose parent was evicted stays cached and is
    reachable again once its parent's content is cached again.

    Every block that enters or leaves the index is recorded in `kv_events` (as its
    `routing_key`), for the clients' routing indexes.

    Args:
        num_blocks: number of blocks in the pool.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached_block_ids: dict[BlockKey, int] = {}
        self.kv_events = KVEventLog()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner, cached ones included (they are evictable)."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached_block_ids)

    def cached_routing_keys(self) -> list[int]:
        """The routing keys of every cached block (a KV-events snapshot)."""
        return [routing_key(b.block_hash) for b in self.blocks if b.block_hash is not None]

    def free_block_ids(self) -> Iterator[int]:
        """The free queue, next to be reused first."""
        return iter(self._free_queue)

    def lookup(self, parent_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The cached block holding `token_ids` after the prefix `parent_hash`, if any."""
        return self._cached_block_ids.get((parent_hash, token_ids))

    def allocate(self, num_blocks: int) -> list[int]:
        """Takes `num_blocks` blocks from the front of the free queue, evicting cached KV.

        Returns:
            the block ids, each with `ref_count == 1`.

        Raises:
            AssertionError: if fewer blocks are free (callers check `num_free_blocks` first).
        """
        assert num_blocks <= len(self._free_queue), (
            f"asked for {num_blocks} blocks with {len(self._free_queue)} free"
        )
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._uncache(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Adds an owner to cached blocks (a prefix hit), taking free ones off the queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.block_hash is not None, f"block {block_id} is not cached"
            if block.ref_count == 0:
                del self._free_queue[block_id]
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one owner of each block; blocks left without one join the free queue.

        Args:
            block_ids: in the order they should be evicted among themselves, first soonest.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than allocated"
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            self._free_queue[block_id] = None
            if block.block_hash is None:
                self._free_queue.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, parent_hash: int, token_ids: tuple[int, ...]) -> int:
        """Registers an owned, fully computed block under its content.

        If another block already holds the same content (two requests computed it in the same
        steps), that block stays the cached one and this one is left uncached.

        Returns:
            the hash of this content, to chain the next block onto.
        """
        key: BlockKey = (parent_hash, token_ids)
        cached_id = self._cached_block_ids.get(key)
        if cached_id is not None:
            cached_hash = self.blocks[cached_id].block_hash
            assert cached_hash is not None
            return cached_hash
        block = self.blocks[block_id]
        assert block.ref_count > 0 and block.block_hash is None, f"cannot cache {block}"
        block.block_hash = hash_block(parent_hash, token_ids)
        block.cache_key = key
        self._cached_block_ids[key] = block_id
        self.kv_events.on_stored(routing_key(block.block_hash))
        return block.block_hash

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached content, only when no block has an owner.

        Returns:
            False (and nothing changes) while any block is in use.
        """
        if len(self._free_queue) != len(self.blocks):
            return False
        for block in self.blocks:
            self._uncache(block)
        return True

    def _uncache(self, block: KVBlock) -> None:
        if block.cache_key is not None:
            del self._cached_block_ids[block.cache_key]
            assert block.block_hash is not None
            self.kv_events.on_removed(routing_key(block.block_hash))
        block.block_hash = None
        block.cache_key = None
