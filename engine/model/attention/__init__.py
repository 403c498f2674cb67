"""Paged attention behind one seam: a backend builds its metadata from the step's token batch
once, and every layer's `PagedAttention` calls its `forward`.

Backends (one module each): `cpu_attn` (CPU_ATTN, the C kernels), `torch_sdpa` (TORCH_SDPA, the
plain torch reference) and `triton_attn` (TRITON_ATTN, the Triton kernels of `triton_kernels`).
`selector` picks one at start-up. Knows nothing about requests, scheduling or sampling.
"""

from shoal.engine.model.attention.backend import (
    AttentionBackend,
    AttentionBatch,
    AttentionMetadata,
    token_positions,
)
from shoal.engine.model.attention.layer import PagedAttention
from shoal.engine.model.attention.selector import select_attention_backend

__all__ = [
    "AttentionBackend",
    "AttentionBatch",
    "AttentionMetadata",
    "PagedAttention",
    "select_attention_backend",
    "token_positions",
]
