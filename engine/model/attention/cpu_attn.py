"""CPU_ATTN: the C paged-attention kernels (engine/kernels/csrc/paged_attention.c) reading the pool in
place, decodes in one call and every prefill chunk of the step in another.

The kernels compute in fp32: bf16 queries are widened and the results narrowed here, the bf16
pool is read as it is. Relies on the batch order of `AttentionBatch` (decodes first).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.profiler import record_function

from shoal.engine.kernels.paged_attention import PagedDecodeKernel, is_supported
from shoal.engine.model.attention.backend import (
    AttentionBackend,
    AttentionBatch,
    AttentionMetadata,
    value_pool,
    write_kv,
)

# Positions per kernel work item: longer contexts are split so a few long requests still spread
# over all threads, and merged afterwards.
_KERNEL_PARTITION_TOKENS = 512


@dataclass
class KernelDecode:
    """The step's decodes (batch rows [0, num_seqs))."""

    num_seqs: int
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks] (padding entries never read)
    context_lens: torch.Tensor  # int32 [num_seqs]: positions [0, len) are attended
    partition_blocks: int


@dataclass
class KernelPrefill:
    """Every prefill chunk of the step."""

    block_tables: torch.Tensor  # int32 [P, max_blocks]
    q_starts: torch.Tensor  # int32 [P]: each chunk's first row in the token batch
    q_lens: torch.Tensor  # int32 [P]
    start_pos: torch.Tensor  # int32 [P]: position of each chunk's first token


@dataclass
class CpuAttnMetadata(AttentionMetadata):
    decode: KernelDecode | None
    prefill: KernelPrefill | None
    num_threads: int  # torch's intra-op thread count, applied to the kernels' OpenMP region


class CpuAttnBackend(AttentionBackend[CpuAttnMetadata]):
    """The C kernels; CPU tensors, fp32 or bf16 pools, GQA groups up to the kernel's bound."""

    name = "CPU_ATTN"

    def __init__(self, kernel: PagedDecodeKernel):
        self.kernel = kernel

    @staticmethod
    def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        return is_supported(num_heads, num_kv_heads, head_dim, dtype)

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> CpuAttnMetadata:
        assert device.type == "cpu", f"{self.name} runs on CPU, not {device}"
        d = batch.num_decodes
        num_blocks = batch.num_blocks
        decode = prefill = None
        if d:
            decode = KernelDecode(
                num_seqs=d,
                block_tables=_int32(batch.block_table[:d, : int(num_blocks[:d].max())]),
                context_lens=_int32(batch.context_lens[:d]),
                partition_blocks=max(1, _KERNEL_PARTITION_TOKENS // batch.block_size),
            )
        if d < batch.num_seqs:
            prefill = KernelPrefill(
                block_tables=_int32(batch.block_table[d:, : int(num_blocks[d:].max())]),
                q_starts=_int32(batch.token_starts[d:]),
                q_lens=_int32(batch.num_new_tokens[d:]),
                start_pos=_int32(batch.starts[d:]),
            )
        slot_mapping = torch.from_numpy(batch.slot_mapping)
        return CpuAttnMetadata(
            batch.num_tokens, slot_mapping, decode, prefill, torch.get_num_threads()
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: CpuAttnMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        value_dim: int | None = None,
    ) -> torch.Tensor:
        with record_function("shoal::kv_write"):
            write_kv(kv_cache, k, v, meta.slot_mapping)
        # The kernels read and write fp32 rows with a contiguous head_dim.
        is_fp32 = q.dtype == torch.float32
        query = q if is_fp32 and q.stride(-1) == 1 else q.float().contiguous()
        num_tokens, num_heads, head_dim = query.shape
        out = torch.empty(num_tokens, num_heads, value_dim or head_dim, dtype=torch.float32)
        keys, values = kv_cache[0], value_pool(kv_cache)
        if meta.decode is not None:
            with record_function("shoal::attn_decode"):
                self.kernel.decode(
                    out[: meta.decode.num_seqs],
                    query[: meta.decode.num_seqs],
                    keys,
                    values,
                    meta.decode.block_tables,
                    meta.decode.context_lens,
                    scale=scale,
                    partition_blocks=meta.decode.partition_blocks,
                    num_threads=meta.num_threads,
                    sliding_window=sliding_window,
                    sinks=sinks,
                )
        if meta.prefill is not None:
            with record_function("shoal::attn_prefill"):
                pre = meta.prefill
                self.kernel.prefill(
                    out,
                    query,
                    keys,
                    values,
                    pre.block_tables,
                    pre.q_starts,
                    pre.q_lens,
                    pre.start_pos,
                    scale=scale,
                    num_threads=meta.num_threads,
                    sliding_window=sliding_window,
                    sinks=sinks,
                )
        return out if is_fp32 else out.to(q.dtype)


def _int32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
