"""vLLM's prefix-cache events as shoal's KV events, for the clients' routing indexes.

vLLM's scheduler reports the blocks its prefix cache gains and loses (`BlockStored` with the
blocks' token ids and the parent block's hash, `BlockRemoved`, `AllBlocksCleared`) under its
own block hashes. Clients key their index by shoal's chained hashes of the same tokens
(`shoal.engine.block_hash`), so each stored block's shoal hash is computed from its parent's
and its tokens, and kept by vLLM hash for the removal. Equal token prefixes give equal keys on
both sides, so the client predicts exactly the blocks vLLM will hit.

vLLM may hold several blocks of one hash (and salted hashes may share tokens): keys are
counted, and a key enters or leaves the feed only when its count does. Blocks in another tier
(a CPU offload's medium) or another KV group are not the engine's prefix cache for routing and
are left out.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from shoal.engine.block_hash import ROOT_BLOCK_HASH, hash_block, routing_key
from shoal.engine.kv_events import KVEventLog
from shoal.engine.protocol import KVCacheSnapshot

_LOCAL_MEDIA = (None, "GPU")


class VllmKVEvents:
    """Translates vLLM's KV event batches into a `KVEventLog`.

    Args:
        block_size: the engine's block size; a stored event of another is left out.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.log = KVEventLog()
        # vLLM block hash → (shoal's 128-bit chained hash, blocks vLLM holds with it).
        self._blocks: dict[Hashable, tuple[int, int]] = {}
        self._key_counts: dict[int, int] = {}  # routing key → vLLM hashes that map to it

    @property
    def num_cached_blocks(self) -> int:
        return len(self._key_counts)

    # vLLM's `EventPublisher` interface: the scheduler publishes each step's batch here.
    def publish(self, batch: Any) -> None:
        self.apply(batch.events)

    def shutdown(self) -> None:
        pass

    def apply(self, events: list[Any]) -> None:
        """Applies one batch of vLLM events, in order."""
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._on_stored(event)
            elif kind == "BlockRemoved":
                self._on_removed(event)
            elif kind == "AllBlocksCleared":
                self._on_cleared()

    def snapshot(self) -> KVCacheSnapshot:
        """Every cached block's routing key, as of the batch it names (pending changes are
        sealed into that batch first)."""
        seq = self.log.seal()
        return KVCacheSnapshot(seq, list(self._key_counts), self.block_size)

    def _on_stored(self, event: Any) -> None:
        if not _is_local(event) or event.block_size != self.block_size:
            return
        if event.parent_block_hash is None:
            parent = ROOT_BLOCK_HASH
        elif event.parent_block_hash in self._blocks:
            parent = self._blocks[event.parent_block_hash][0]
        else:
            return  # a parent never reported: its keys cannot be known (routing misses it)
        size = self.block_size
        for i, vllm_hash in enumerate(event.block_hashes):
            parent = hash_block(parent, event.token_ids[i * size : (i + 1) * size])
            known = self._blocks.get(vllm_hash)
            count = 0 if known is None else known[1]
            self._blocks[vllm_hash] = (parent, count + 1)
            if known is None:
                self._count_key(routing_key(parent), +1)

    def _on_removed(self, event: Any) -> None:
        if not _is_local(event):
            return
        for vllm_hash in event.block_hashes:
            known = self._blocks.get(vllm_hash)
            if known is None:
                continue
            block_hash, count = known
            if count > 1:
                self._blocks[vllm_hash] = (block_hash, count - 1)
                continue
            del self._blocks[vllm_hash]
            self._count_key(routing_key(block_hash), -1)

    def _on_cleared(self) -> None:
        for key in self._key_counts:
            self.log.on_removed(key)
        self._blocks.clear()
        self._key_counts.clear()

    def _count_key(self, key: int, delta: int) -> None:
        count = self._key_counts.get(key, 0) + delta
        if count > 0:
            self._key_counts[key] = count
        else:
            self._key_counts.pop(key, None)
        if count == 1 and delta > 0:
            self.log.on_stored(key)
        elif count == 0:
            self.log.on_removed(key)


def _is_local(event: Any) -> bool:
    """An event of the engine's own prefix cache: its device tier, its first KV group."""
    return event.medium in _LOCAL_MEDIA and getattr(event, "group_idx", None) in (None, 0)
