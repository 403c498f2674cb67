"""The attention backend seam: what every backend is given each step (`AttentionBatch`), what it
builds from it once per step (its own `AttentionMetadata`), and the per-layer `forward`.

The contract: the model runner orders a step's tokens as decodes first (one token each), then one
contiguous chunk per prefilling request, and describes that order in an `AttentionBatch`. The
chosen backend turns the batch into its metadata once; every layer then calls `forward` with it.
`forward` first writes the step's new K/V into the layer's pool at `slot_mapping`, then attends
each query token over its sequence's positions [0, its own position], or, for a layer with a
sliding window W, over (its position - W, its own position] only: the blocks wholly before that
may have been freed (their block-table entries are then 0 and never read). A layer may add sink
logits (one extra softmax term per head, with no value), and a latent-attention layer keeps K
only: its values are the first `value_dim` entries of each K row. Knows nothing about requests,
scheduling, sampling or which device it runs on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import Generic, TypeVar

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionBatch:
    """One step's token batch as attention sees it, in batch order (host arrays).

    Attributes:
        starts: [R] tokens already in the cache per request (its first new position).
        num_new_tokens: [R] query tokens per request; the first `num_decodes` are 1.
        block_table: [R, max_blocks] int64 block ids covering each request's context
            (entries past a request's last block are ignored).
        num_decodes: how many leading requests are decodes.
        block_size: tokens per KV block.
    """

    starts: np.ndarray
    num_new_tokens: np.ndarray
    block_table: np.ndarray
    num_decodes: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.starts)

    @property
    def num_tokens(self) -> int:
        return int(self.num_new_tokens.sum())

    @cached_property
    def token_starts(self) -> np.ndarray:
        """[R] each request's first row in the token batch."""
        return np.cumsum(self.num_new_tokens) - self.num_new_tokens

    @property
    def context_lens(self) -> np.ndarray:
        """[R] positions each request attends after this step (cached + new)."""
        return self.starts + self.num_new_tokens

    @property
    def num_blocks(self) -> np.ndarray:
        """[R] blocks that cover each request's context."""
        return (self.context_lens - 1) // self.block_size + 1

    @cached_property
    def positions(self) -> np.ndarray:
        """[T] the position of every token."""
        return token_positions(self.starts, self.num_new_tokens)[1]

    @cached_property
    def slot_mapping(self) -> np.ndarray:
        """[T] int64 flat pool slot (block * block_size + offset) of every token's new K/V."""
        req_of_token = np.repeat(np.arange(self.num_seqs), self.num_new_tokens)
        positions = self.positions
        blocks = self.block_table[req_of_token, positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size


def token_positions(
    starts: np.ndarray, num_new_tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(request index, position) of every token of the flat batch, requests in batch order."""
    num_tokens = int(num_new_tokens.sum())
    req_of_token = np.repeat(np.arange(len(starts)), num_new_tokens)
    token_starts = np.cumsum(num_new_tokens) - num_new_tokens
    positions = starts[req_of_token] + (np.arange(num_tokens) - token_starts[req_of_token])
    return req_of_token, positions


@dataclass
class AttentionMetadata:
    """The fields every backend needs; each backend's subclass adds only its own."""

    num_tokens: int
    slot_mapping: torch.Tensor  # int64 [num_tokens] on the pool's device


M = TypeVar("M", bound=AttentionMetadata)


class AttentionBackend(ABC, Generic[M]):
    """One way of running paged attention; chosen once per model runner.

    The pool of one layer has shape [2, num_kv_heads, num_blocks, block_size, head_dim]: K then
    V, head-major; or [1, 1, num_blocks, block_size, head_dim] for latent attention (K only).
    Query head h reads KV head h // (num_heads // num_kv_heads).
    """

    name: str  # the `--attention-backend` spelling (vLLM's)

    @abstractmethod
    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> M:
        """The step's metadata, shared by every layer; called once per step."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: M,
        *,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        value_dim: int | None = None,
    ) -> torch.Tensor:
        """Writes k/v into `kv_cache` and attends.

        Args:
            q: [T, num_heads, head_dim] (rows may be strided views into a fused qkv).
            k, v: [T, num_kv_heads, head_dim], the step's new keys and values; v None for
                latent attention (a one-part pool, `value_dim` given).
            kv_cache: this layer's pool, written in place.
            meta: this step's metadata from `build_metadata`.
            scale: multiplies the scores (usually head_dim ** -0.5).
            sliding_window: this layer's window W: a query at position i sees (i - W, i].
            sinks: float32 [num_heads] sink logits, or None.
            value_dim: latent attention: the values are K[..., :value_dim].

        Returns:
            [T, num_heads, head_dim] (or [T, num_heads, value_dim]) in q's dtype.
        """


def write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor
) -> None:
    """Stores the step's new K/V (K only in a one-part pool) at their slots (torch ops, any
    device)."""
    num_parts, num_kv_heads, head_dim = kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[4]
    flat = kv_cache.view(num_parts, num_kv_heads, -1, head_dim)
    flat[0].index_copy_(1, slots, k.transpose(0, 1))
    if v is not None:
        flat[1].index_copy_(1, slots, v.transpose(0, 1))


def value_pool(kv_cache: torch.Tensor) -> torch.Tensor:
    """The pool's V part; a one-part (latent) pool's values are read from its K rows."""
    return kv_cache[1] if kv_cache.shape[0] == 2 else kv_cache[0]
