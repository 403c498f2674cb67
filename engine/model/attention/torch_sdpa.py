"""TORCH_SDPA: the plain torch reference backend. Per sequence, it gathers the K/V of every
position its queries may see through the block table and runs one
`scaled_dot_product_attention`, masked causally from the chunk's first position (and, for a
sliding-window layer, from each query's window start); with sink logits, the softmax is spelt
out with the sinks as one more column.

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
    start: int  # the position of its first query
    key_slots: torch.Tensor  # int64 [context_len]: the slot of positions 0 .. context_len - 1

    def visible(self, sliding_window: int | None) -> tuple[int, torch.Tensor | None]:
        """(first key position read, bool mask [num_tokens, keys from it]; None: all)."""
        context_len = self.start + self.num_tokens
        first = 0 if sliding_window is None else max(0, self.start + 1 - sliding_window)
        if self.num_tokens == 1:
            return first, None  # a decode sees every key from its window start
        device = self.key_slots.device
        keys = torch.arange(first, context_len, device=device)[None, :]
        queries = torch.arange(self.start, context_len, device=device)[:, None]
        mask = keys <= queries
        if sliding_window is not None:
            mask &= keys > queries - sliding_window
        return first, mask


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
            token_start = int(batch.token_starts[i])
            sequences.append(SequenceSlice(token_start, n, start, slots.to(device)))
        slot_mapping = torch.from_numpy(batch.slot_mapping).to(device)
        return TorchSDPAMetadata(batch.num_tokens, slot_mapping, sequences)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: TorchSDPAMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        value_dim: int | None = None,
    ) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        num_parts, num_kv_heads, head_dim = kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[4]
        flat = kv_cache.view(num_parts, num_kv_heads, -1, head_dim)
        num_tokens, num_heads, _ = q.shape
        out = torch.empty(
            num_tokens, num_heads, value_dim or head_dim, dtype=q.dtype, device=q.device
        )
        for seq in meta.sequences:
            rows = slice(seq.token_start, seq.token_start + seq.num_tokens)
            first, mask = seq.visible(sliding_window)
            kv = flat.index_select(2, seq.key_slots[first:])  # [parts, KVH, keys, D]
            keys = kv[0]
            values = kv[1] if num_parts == 2 else kv[0][..., :value_dim]
            query = q[rows].transpose(0, 1)
            if sinks is None:
                res = F.scaled_dot_product_attention(
                    query.unsqueeze(0),
                    keys.unsqueeze(0),
                    values.unsqueeze(0),
                    attn_mask=mask,
                    scale=scale,
                    enable_gqa=True,
                )[0]
            else:
                res = _attend_with_sinks(query, keys, values, mask, scale, sinks)
            out[rows] = res.transpose(0, 1)
        return out


def _attend_with_sinks(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """softmax over [scores, sink] per head, the sink's share dropped: q [H, n, D] -> [H, n, Dv]."""
    group = q.shape[0] // keys.shape[0]
    keys = keys.repeat_interleave(group, dim=0)
    values = values.repeat_interleave(group, dim=0)
    scores = torch.matmul(q, keys.transpose(1, 2)) * scale  # [H, n, keys]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype)[:, None, None].expand(-1, scores.shape[1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)
