"""Paged KV cache bookkeeping per request: block tables, prefix-cache hits and registration, and
the blocks a sliding window leaves behind.

Owns which blocks each request holds and the chain of block hashes of its full blocks; the
physical pool (reference counts, free queue, index) is `shoal.engine.block_pool`. It does not know
about scheduling policy, and the model runner owns the tensors. No torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from shoal.engine.block_hash import num_hit_blocks
from shoal.engine.block_pool import BlockPool
from shoal.engine.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# A block table entry whose block a sliding window released (attention never reads it).
FREED_BLOCK = -1


class KVCacheManager:
    """Reserves KV slots for requests and shares full blocks of identical prefixes.

    A full block's hash chains over everything before it: block i is keyed by
    `(hash of block i-1, token ids of block i)`, so a hit means the whole prefix matches.
    Both prompt and generated tokens are registered once their KV is computed.

    With a `sliding_window` W (a model whose every layer attends to its last W positions only),
    a request's blocks wholly before position `num_computed_tokens - W + 1` are never read
    again: `allocate_slots` gives them back to the pool before it reserves the next tokens
    (they stay in the prefix cache until evicted) and their table entries become FREED_BLOCK.
    A later prefix hit still walks the chain from the first block, so a prefix whose early
    blocks were evicted hits shorter.

    Args:
        num_blocks: blocks in the pool (ids 0..num_blocks-1).
        block_size: token slots per block.
        enable_prefix_caching: share and keep full blocks across requests.
        sliding_window: the model's window when every layer slides; None otherwise.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks)
        self._block_ids: dict[str, list[int]] = {}
        # Hashes of each request's leading full blocks that are registered (or found) so far.
        self._block_hashes: dict[str, list[int]] = {}
        self.num_prefix_cache_queries = 0  # tokens looked up at admission
        self.num_prefix_cache_hits = 0  # of those, tokens found

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by some request, 0..1 (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (read-only; empty if it holds none)."""
        return self._block_ids.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Looks up the longest cached full-block prefix of a request that holds no blocks.

        The hit stops before the last token, so at least one token is computed and there are
        logits to sample from. Nothing changes until `allocate_slots` takes the blocks.

        Returns:
            the cached block ids, and the number of tokens they cover.
        """
        if not self.enable_prefix_caching or request.request_id in self._block_ids:
            return [], 0
        tokens = request.all_token_ids
        max_hit_blocks = num_hit_blocks(len(tokens), self.block_size)
        block_ids: list[int] = []
        parent_hash = request.root_block_hash
        for i in range(max_hit_blocks):
            block_tokens = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            block_id = self.block_pool.lookup(parent_hash, block_tokens)
            if block_id is None:
                break
            block_ids.append(block_id)
            block_hash = self.block_pool.blocks[block_id].block_hash
            assert block_hash is not None
            parent_hash = block_hash
        return block_ids, len(block_ids) * self.block_size

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Whether `allocate_slots` with the same arguments would succeed."""
        return self._num_blocks_to_take(request, num_new_tokens, computed_blocks) <= (
            self.num_free_blocks
        )

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Reserves slots for `num_computed + num_new_tokens` tokens of a request.

        Args:
            request: its `num_computed_tokens` is what its blocks already hold.
            num_new_tokens: tokens to compute next.
            computed_blocks: prefix-cache hit from `get_computed_blocks`, only when the
                request holds no blocks yet (and has `num_computed_tokens == 0`); they count
                as computed in front of the new tokens.

        Returns:
            False, changing nothing (but releasing blocks its window left behind), if there are
            not enough free blocks.
        """
        self._release_out_of_window(request)
        num_to_take = self._num_blocks_to_take(request, num_new_tokens, computed_blocks)
        if num_to_take > self.num_free_blocks:
            return False
        request_id = request.request_id
        if request_id not in self._block_ids:
            # Hit blocks come off the free queue first so that allocation cannot evict them.
            self._admit(request, computed_blocks)
        block_ids = self._block_ids[request_id]
        num_required = _cdiv(
            request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens,
            self.block_size,
        )
        block_ids.extend(self.block_pool.allocate(max(0, num_required - len(block_ids))))
        return True

    def free(self, request: Request) -> None:
        """Releases all of a request's blocks (no-op if it holds none).

        Its tail blocks are queued for eviction before its head blocks: a later request is
        more likely to share the beginning of a prompt than its end.
        """
        block_ids = self._block_ids.pop(request.request_id, None)
        self._block_hashes.pop(request.request_id, None)
        if block_ids is not None:
            self.block_pool.free(b for b in reversed(block_ids) if b != FREED_BLOCK)

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's full blocks whose KV is now computed (prompt and output)."""
        if not self.enable_prefix_caching:
            return
        block_ids = self._block_ids[request.request_id]
        block_hashes = self._block_hashes[request.request_id]
        num_full_blocks = request.num_computed_tokens // self.block_size
        assert num_full_blocks <= len(block_ids), f"{request} computed past its blocks"
        tokens = request.all_token_ids
        for i in range(len(block_hashes), num_full_blocks):
            parent_hash = block_hashes[-1] if block_hashes else request.root_block_hash
            block_tokens = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            block_hashes.append(
                self.block_pool.cache_block(block_ids[i], parent_hash, block_tokens)
            )

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached prefixes (e.g. after a weight update).

        Returns:
            False, changing nothing, while any request holds blocks.
        """
        return self.block_pool.reset_prefix_cache()

    def _release_out_of_window(self, request: Request) -> None:
        """Gives back the held blocks no query of the request's next tokens can see."""
        block_ids = self._block_ids.get(request.request_id)
        if self.sliding_window is None or not block_ids:
            return
        # A request admitted with a prefix hit holds all of it for its first step: it is not in
        # `_block_ids` before then, and its `num_computed_tokens` counts the hit after.
        num_computed = request.num_computed_tokens
        num_unseen = max(0, num_computed + 1 - self.sliding_window) // self.block_size
        released = [b for b in block_ids[:num_unseen] if b != FREED_BLOCK]
        if released:
            block_ids[:num_unseen] = [FREED_BLOCK] * num_unseen
            self.block_pool.free(released)

    def _num_blocks_to_take(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int]
    ) -> int:
        held = self._block_ids.get(request.request_id, [])
        assert not computed_blocks or (not held and request.num_computed_tokens == 0), (
            f"{request} already has KV; prefix hits apply only at admission"
        )
        num_tokens = (
            request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        )
        num_required = _cdiv(num_tokens, self.block_size) - len(held) - len(computed_blocks)
        # Cached blocks nobody owns sit in the free queue; taking them uses it up too.
        num_free_hits = sum(1 for b in computed_blocks if self.block_pool.blocks[b].ref_count == 0)
        return max(0, num_required) + num_free_hits

    def _admit(self, request: Request, computed_blocks: Sequence[int]) -> None:
        self.block_pool.touch(computed_blocks)
        self._block_ids[request.request_id] = list(computed_blocks)
        block_hashes = []
        for block_id in computed_blocks:
            block_hash = self.block_pool.blocks[block_id].block_hash
            assert block_hash is not None, f"hit block {block_id} is not cached"
            block_hashes.append(block_hash)
        self._block_hashes[request.request_id] = block_hashes
        if self.enable_prefix_caching and not request.num_preemptions:
            # Counted once per request, as vLLM counts `prefix_cache_queries`: a preempted
            # request's re-lookup is left out (its recompute shows in the prompt-token count).
            self.num_prefix_cache_queries += request.num_tokens
            self.num_prefix_cache_hits += len(computed_blocks) * self.block_size
