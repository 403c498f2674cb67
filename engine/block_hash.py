"""Chained block hashes: the content key of a full KV block in its context, shared by the
engine's prefix cache and the clients' routing index.

Block i of a token sequence is hashed over (hash of block i-1, token ids of block i), so equal
hashes mean equal whole prefixes. The engine keys its prefix cache on the full 128-bit hash;
KV events and the clients' index carry its low 64 bits (`routing_key`), which fit a msgpack
integer. No torch, no state.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# The parent hash of a sequence's first block.
ROOT_BLOCK_HASH = 0

_ROUTING_KEY_MASK = (1 << 64) - 1


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The 128-bit hash of a block holding `token_ids` after the prefix `parent_hash`.

    Stable across processes and machines (BLAKE2b, not Python's salted `hash`).
    """
    digest = hashlib.blake2b(parent_hash.to_bytes(16, "little"), digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


def adapter_root_hash(lora_name: str, lora_path: str) -> int:
    """The parent hash of the first block of a request that runs with a LoRA adapter: its KV
    differs from the base model's for the same tokens, so its chain starts apart."""
    digest = hashlib.blake2b(b"lora\0", digest_size=16)
    digest.update(f"{lora_name}\0{lora_path}".encode())
    return int.from_bytes(digest.digest(), "little")


def routing_key(block_hash: int) -> int:
    """The 64-bit key of a block hash that KV events and routing indexes carry."""
    return block_hash & _ROUTING_KEY_MASK


def num_hit_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a sequence a prefix-cache hit may cover.

    The hit stops before the last token, so at least one token is computed and there are
    logits to sample from.
    """
    return max(0, num_tokens - 1) // block_size


def prompt_routing_keys(
    token_ids: Sequence[int], block_size: int, root: int = ROOT_BLOCK_HASH
) -> list[int]:
    """The routing keys of the blocks of `token_ids` a prefix-cache hit could cover, in order
    (`root`: the first block's parent; `adapter_root_hash` for a LoRA request).

    O(number of blocks): one hash per block.
    """
    keys = []
    parent = root
    for i in range(num_hit_blocks(len(token_ids), block_size)):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(routing_key(parent))
    return keys
