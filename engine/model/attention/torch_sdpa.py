"""TORCH_SDPA: the plain torch reference backend. Per sequence, it gathers the K/V of every
position through the block table and runs one `scaled_dot_product_attention`, masked causally
from the chunk's first position.

Obviously correct rather than fast: the tests hold the other backends to it, and it serves where
neither the C kernels nor Triton can run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shoal.engine.model.attention.backend import (
    AttentionBackend,
    AttentionBatch,
    AttentionMetadata,
    write_kv,
)


@dataclass
class SequenceSlice:
    """One request's query rows and every pool slot its queries may read."""

    token_start: int
    num_tokens: int
    key_slots: torch.Tensor  # int64 [context_len]: the slot of positions 0 .. context_len - 1
    mask: torch.Tensor | None  # bool [num_tokens, context_len]; None: every key visible


@dataclass
class TorchSDPAMetadata(AttentionMetadata):
    sequences: list[SequenceSlice]


class TorchSDPABackend(AttentionBackend[TorchSDPAMetadata]):
    """One gather and one SDPA call per sequence and layer; any device and dtype."""

    name = "TORCH_SDPA"

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> TorchSDPAMetadata:
        sequences = []
        for i in range(batch.num_seqs):
            start, n = int(batch.starts[i]), int(batch.num_new_tokens[i])
            context = torch.arange(start + n)
            table = torch.from_numpy(batch.block_table[i])
            slots = table[context // batch.block_size] * batch.block_size
            slots += context % batch.block_size
            mask = None
            if n > 1:
                mask = context[None, :] <= torch.arange(start, start + n)[:, None]
                mask = mask.to(device)
            sequences.append(SequenceSlice(int(batch.token_starts[i]), n, slots.to(device), mask))
        slot_mapping = torch.from_numpy(batch.slot_mapping).to(device)
        return TorchSDPAMetadata(batch.num_tokens, slot_mapping, sequences)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TorchSDPAMetadata,
        *,
        scale: float,
    ) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[4]
        flat = kv_cache.view(2, num_kv_heads, -1, head_dim)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for seq in meta.sequences:
            rows = slice(seq.token_start, seq.token_start + seq.num_tokens)
            kv = flat.index_select(2, seq.key_slots)  # [2, KVH, context_len, D]
            res = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0),
                kv[0].unsqueeze(0),
                kv[1].unsqueeze(0),
                attn_mask=seq.mask,
                scale=scale,
                enable_gqa=True,
            )
            out[rows] = res[0].transpose(0, 1)
        return out
