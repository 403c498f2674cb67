"""`PagedAttention`: the attention op of one decoder layer, bound to its slice of the KV pool and
to the backend the model runner chose. It holds no device logic of its own."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.engine.model.attention.backend import AttentionBackend, AttentionMetadata


class PagedAttention(nn.Module):
    """Writes a layer's new K/V into its pool and attends through `backend`.

    The pool (`kv_cache`, bound by the model runner) has shape
    [2, num_kv_heads, num_blocks, block_size, head_dim].
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend[Any]
    ):
        super().__init__()
        self.backend = backend
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.kv_cache: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H * D]."""
        cache = self.kv_cache
        assert cache is not None, "the KV cache is not bound; call ModelRunner.initialize_kv_cache"
        out = self.backend.forward(q, k, v, cache, meta, scale=self.scale)
        return out.view(meta.num_tokens, -1)
