"""`PagedAttention`: the attention op of one decoder layer, bound to its slice of the KV pool and
to the backend the model runner chose, with what the layer adds to plain causal attention (its
softmax scale, sliding window, sink logits, latent values). It holds no device logic of its own."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.engine.model.attention.backend import AttentionBackend, AttentionMetadata


class PagedAttention(nn.Module):
    """Writes a layer's new K/V into its pool and attends through `backend`.

    The pool (`kv_cache`, bound by the model runner) has shape
    [2, num_kv_heads, num_blocks, block_size, head_dim], or [1, 1, ...] for latent attention.

    Args:
        num_heads, num_kv_heads, head_dim: this worker's query heads, KV heads and K width.
        backend: the model runner's backend.
        scale: the softmax scale; default head_dim ** -0.5.
        sliding_window: this layer's window, or None for full causal attention.
        sinks: float32 [num_heads] sink logits (read at every call: loaded later), or None.
        value_dim: latent attention: the values are the first value_dim entries of K.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: AttentionBackend[Any],
        *,
        scale: float | None = None,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        value_dim: int | None = None,
    ):
        super().__init__()
        self.backend = backend
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.sinks = sinks
        self.value_dim = value_dim
        self.kv_cache: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (v None: latent) -> [T, H * Dv]."""
        cache = self.kv_cache
        assert cache is not None, "the KV cache is not bound; call ModelRunner.initialize_kv_cache"
        out = self.backend.forward(
            q,
            k,
            v,
            cache,
            meta,
            scale=self.scale,
            sliding_window=self.sliding_window,
            sinks=self.sinks,
            value_dim=self.value_dim,
        )
        return out.view(meta.num_tokens, -1)
