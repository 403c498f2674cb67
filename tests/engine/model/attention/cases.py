"""A paged attention step to hand any backend: a random K/V pool with shuffled block tables, and
the step's new q/k/v for chunks given as (cached positions, new tokens), decodes first; plus a
float64 dense softmax(QK^T)V of the same step that shares no code with the backends."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shoal.engine.model.attention import AttentionBackend, AttentionBatch

# Decodes (contexts ending mid-block, just past a block, a one-token prompt), then prefill
# chunks: a whole prompt, a later chunk over its cached start, a cached prefix's short tail.
MIXED_CHUNKS = [(37, 1), (16, 1), (0, 1), (0, 21), (24, 9), (5, 2)]


class PagedStep:
    def __init__(
        self,
        chunks: list[tuple[int, int]],
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        seed: int = 0,
    ):
        gen = torch.Generator().manual_seed(seed)
        starts = np.array([s for s, _ in chunks], dtype=np.int64)
        new = np.array([n for _, n in chunks], dtype=np.int64)
        num_decodes = next((i for i, n in enumerate(new) if n != 1), len(new))
        blocks_needed = (starts + new - 1) // block_size + 1
        num_blocks = int(blocks_needed.sum()) + 5  # spare blocks no table names
        free = torch.randperm(num_blocks, generator=gen).tolist()
        table = np.zeros((len(chunks), int(blocks_needed.max())), dtype=np.int64)
        for i, n in enumerate(blocks_needed):
            table[i, :n], free = free[:n], free[n:]
        self.batch = AttentionBatch(starts, new, table, num_decodes, block_size)
        self.device = torch.device(device)
        shape = (2, num_kv_heads, num_blocks, block_size, head_dim)
        self.pool = torch.randn(shape, generator=gen).to(dtype).to(self.device)
        num_tokens = self.batch.num_tokens

        def rand(*size: int) -> torch.Tensor:
            return torch.randn(*size, generator=gen).to(dtype).to(self.device)

        # q as the model hands it: a strided view into a wider (fused qkv) row.
        self.q = rand(num_tokens, num_heads + 2, head_dim)[:, :num_heads]
        self.k = rand(num_tokens, num_kv_heads, head_dim)
        self.v = rand(num_tokens, num_kv_heads, head_dim)
        self.scale = head_dim**-0.5

    def run(self, backend: AttentionBackend[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [T, H, D], the pool after the step) from `backend`, on a copy of the pool."""
        pool = self.pool.clone()
        meta = backend.build_metadata(self.batch, self.device)
        out = backend.forward(self.q, self.k, self.v, pool, meta, scale=self.scale)
        return out, pool

    def dense_reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(output in float64, the pool with the new K/V written), token by token."""
        b = self.batch
        pool = self.pool.clone()
        positions = b.positions
        req_of_token = np.repeat(np.arange(b.num_seqs), b.num_new_tokens)
        for t, (r, pos) in enumerate(zip(req_of_token, positions, strict=True)):
            block = b.block_table[r, pos // b.block_size]
            pool[0, :, block, pos % b.block_size] = self.k[t]
            pool[1, :, block, pos % b.block_size] = self.v[t]
        num_heads, num_kv_heads = self.q.shape[1], pool.shape[1]
        out = torch.empty(self.q.shape, dtype=torch.float64, device=self.device)
        for t, (r, pos) in enumerate(zip(req_of_token, positions, strict=True)):
            ids = torch.from_numpy(b.block_table[r, : pos // b.block_size + 1]).to(self.device)
            kv = pool[:, :, ids].double().flatten(2, 3)[:, :, : pos + 1]  # [2, KVH, pos + 1, D]
            kv = kv.repeat_interleave(num_heads // num_kv_heads, dim=1)
            scores = torch.einsum("hd,htd->ht", self.q[t].double(), kv[0]) * self.scale
            out[t] = torch.einsum("ht,htd->hd", scores.softmax(-1), kv[1])
        return out, pool
