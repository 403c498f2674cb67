"""A paged attention step to hand any backend: a random K/V pool with shuffled block tables, and
the step's new q/k/v for chunks given as (cached positions, new tokens), decodes first; plus a
float64 dense softmax(QK^T)V of the same step that shares no code with the backends.

A step may carry a layer's extras: a sliding window (the blocks wholly before every query's
window are filled with NaN, so a backend that reads them shows it), sink logits, or latent
attention (a one-part pool whose rows' first `value_dim` entries are the values)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shoal.engine.model.attention import AttentionBackend, AttentionBatch

# Decodes (contexts ending mid-block, just past a block, a one-token prompt), then prefill
# chunks: a whole prompt, a later chunk over its cached start, a cached prefix's short tail.
MIXED_CHUNKS = [(37, 1), (16, 1), (0, 1), (0, 21), (24, 9), (5, 2)]
# As MIXED_CHUNKS, with contexts long past the windows the tests use (a few blocks of 16 and 5).
LONG_CHUNKS = [(75, 1), (16, 1), (0, 1), (0, 40), (48, 21), (60, 2)]
# The layer extras a step can carry, by test id.
VARIANTS = {
    "plain": {},
    "window": {"sliding_window": 12},
    "sinks": {"sinks": True},
    "window+sinks": {"sliding_window": 7, "sinks": True},
    "latent": {"value_dim": 24},
}


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
        sliding_window: int | None = None,
        sinks: bool = False,
        value_dim: int | None = None,
    ):
        gen = torch.Generator().manual_seed(seed)
        self.sliding_window = sliding_window
        self.value_dim = value_dim
        if value_dim is not None:
            num_kv_heads = 1  # latent attention: one shared row of K (and V) per token
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
        shape = (1 if value_dim else 2, num_kv_heads, num_blocks, block_size, head_dim)
        pool = torch.randn(shape, generator=gen)
        if sliding_window is not None:
            for i, (start, _) in enumerate(chunks):
                # Blocks wholly before the first query's window: freed, as far as attention knows.
                for b in range(max(0, start + 1 - sliding_window) // block_size):
                    pool[:, :, table[i, b]] = float("nan")
        self.pool = pool.to(dtype).to(self.device)
        num_tokens = self.batch.num_tokens

        def rand(*size: int) -> torch.Tensor:
            return torch.randn(*size, generator=gen).to(dtype).to(self.device)

        # q as the model hands it: a strided view into a wider (fused qkv) row.
        self.q = rand(num_tokens, num_heads + 2, head_dim)[:, :num_heads]
        self.k = rand(num_tokens, num_kv_heads, head_dim)
        self.v = None if value_dim else rand(num_tokens, num_kv_heads, head_dim)
        self.sinks = torch.randn(num_heads, generator=gen).to(self.device) if sinks else None
        self.scale = head_dim**-0.5

    def run(self, backend: AttentionBackend[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [T, H, D], the pool after the step) from `backend`, on a copy of the pool."""
        pool = self.pool.clone()
        meta = backend.build_metadata(self.batch, self.device)
        out = backend.forward(
            self.q,
            self.k,
            self.v,
            pool,
            meta,
            scale=self.scale,
            sliding_window=self.sliding_window,
            sinks=self.sinks,
            value_dim=self.value_dim,
        )
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
            if self.v is not None:
                pool[1, :, block, pos % b.block_size] = self.v[t]
        num_tokens, num_heads, head_dim = self.q.shape
        num_kv_heads = pool.shape[1]
        value_dim = self.value_dim or head_dim
        out = torch.empty(num_tokens, num_heads, value_dim, dtype=torch.float64, device=self.device)
        for t, (r, pos) in enumerate(zip(req_of_token, positions, strict=True)):
            first = 0 if self.sliding_window is None else max(0, pos + 1 - self.sliding_window)
            ids = torch.from_numpy(b.block_table[r, : pos // b.block_size + 1]).to(self.device)
            kv = pool[:, :, ids].double().flatten(2, 3)[:, :, first : pos + 1]
            kv = kv.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [parts, H, keys, D]
            keys, values = kv[0], kv[-1][..., :value_dim]
            scores = torch.einsum("hd,htd->ht", self.q[t].double(), keys) * self.scale
            if self.sinks is not None:
                scores = torch.cat([scores, self.sinks.double()[:, None]], dim=-1)
            probs = scores.softmax(-1)[:, : keys.shape[1]]
            out[t] = torch.einsum("ht,htd->hd", probs, values)
        return out, pool
