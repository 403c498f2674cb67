"""TRITON_ATTN: one Triton kernel for the prefill chunks and decodes of a step, reading the paged
pool through the block table (engine/model/attention/triton_kernels.py), after a small kernel that
writes the step's new K/V in place.

Compiled for the GPU it runs on; on CPU tensors the same kernels run under Triton's interpreter
(slow, but the GPU logic can be stepped through and tested here; the selector switches the
interpreter on). Needs the `triton` package.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton

from shoal.engine.model.attention.backend import (
    AttentionBackend,
    AttentionBatch,
    AttentionMetadata,
    value_pool,
)
from shoal.engine.model.attention.triton_kernels import (
    LOG2E,
    paged_attention_kernel,
    write_kv_kernel,
)

# Rows (query tokens x query heads of one KV head) per program: tl.dot wants at least 16; steps
# with prefill chunks take larger tiles, which read each K/V tile for more queries.
_DECODE_ROWS = 16
_PREFILL_ROWS = 64
_TILE_N = 32  # key positions per inner-loop tile


@dataclass
class TritonAttnMetadata(AttentionMetadata):
    block_tables: torch.Tensor  # int32 [R, max_blocks]
    seq_q_starts: torch.Tensor  # int32 [R]: first batch row of each sequence's queries
    seq_q_lens: torch.Tensor  # int32 [R]
    seq_start_pos: torch.Tensor  # int32 [R]: tokens cached before this step's chunk
    prog_seq: torch.Tensor  # int32 [P]: the sequence of each program
    prog_q_offset: torch.Tensor  # int32 [P]: its first query within the chunk
    block_q: int  # query tokens per program


class TritonAttnBackend(AttentionBackend[TritonAttnMetadata]):
    """The Triton kernels: compiled on a GPU, interpreted on CPU.

    Args:
        num_heads, num_kv_heads: the model's query and KV heads (the GQA group sizes the tiles).
    """

    name = "TRITON_ATTN"

    def __init__(self, num_heads: int, num_kv_heads: int):
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
        self.queries_per_kv = num_heads // num_kv_heads
        self.group_pad = triton.next_power_of_2(self.queries_per_kv)

    def build_metadata(self, batch: AttentionBatch, device: torch.device) -> TritonAttnMetadata:
        rows = _PREFILL_ROWS if batch.num_decodes < batch.num_seqs else _DECODE_ROWS
        block_q = max(1, rows // self.group_pad)
        q_lens = batch.num_new_tokens
        programs = -(-q_lens // block_q)
        first_program = np.cumsum(programs) - programs
        prog_seq = np.repeat(np.arange(batch.num_seqs), programs)
        prog_q_offset = (np.arange(int(programs.sum())) - first_program[prog_seq]) * block_q
        tables = batch.block_table[:, : int(batch.num_blocks.max())]
        # One host buffer, one copy to the device; the fields are views into it.
        parts = [tables.reshape(-1), batch.token_starts, q_lens, batch.starts, prog_seq]
        host = np.concatenate([*parts, prog_q_offset]).astype(np.int32)
        packed = torch.from_numpy(host).to(device, non_blocking=True)
        views = torch.split(packed, [len(p) for p in parts] + [len(prog_q_offset)])
        slot_mapping = torch.from_numpy(batch.slot_mapping).to(device, non_blocking=True)
        return TritonAttnMetadata(
            num_tokens=batch.num_tokens,
            slot_mapping=slot_mapping,
            block_tables=views[0].view(tables.shape),
            seq_q_starts=views[1],
            seq_q_lens=views[2],
            seq_start_pos=views[3],
            prog_seq=views[4],
            prog_q_offset=views[5],
            block_q=block_q,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: TritonAttnMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        value_dim: int | None = None,
    ) -> torch.Tensor:
        num_heads = q.shape[1]
        _, num_kv_heads, _, block_size, _ = kv_cache.shape
        assert num_heads == num_kv_heads * self.queries_per_kv, "not the model's head counts"
        assert q.stride(-1) == k.stride(-1) == 1, "head_dim must be contiguous"
        assert v is None or v.stride(-1) == 1, "head_dim must be contiguous"
        k_cache, v_cache = kv_cache[0], value_pool(kv_cache)
        _write_kv(k, v, k_cache, v_cache, meta.slot_mapping, block_size)
        extras = _LayerExtras(sliding_window, sinks, value_dim or q.shape[-1])
        return self._attend(q, k_cache, v_cache, meta, scale, extras)

    def _attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TritonAttnMetadata,
        scale: float,
        extras: _LayerExtras,
    ) -> torch.Tensor:
        """Each program: one KV head's query group over a span of one sequence's queries."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, _, block_size, _ = k_cache.shape
        v_dim, sinks = extras.value_dim, extras.sinks
        out = torch.empty(num_tokens, num_heads, v_dim, dtype=q.dtype, device=q.device)
        paged_attention_kernel[(len(meta.prog_seq), num_kv_heads)](
            out,
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_q_starts,
            meta.seq_q_lens,
            meta.seq_start_pos,
            meta.prog_seq,
            meta.prog_q_offset,
            out.stride(0),
            out.stride(1),
            q.stride(0),
            q.stride(1),
            *k_cache.stride()[:3],
            meta.block_tables.stride(0),
            scale * LOG2E,
            extras.sliding_window or 0,
            sinks if sinks is not None else q,  # never read without HAS_SINKS
            QUERIES_PER_KV=self.queries_per_kv,
            GROUP_PAD=self.group_pad,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
            V_DIM=v_dim,
            V_DIM_PAD=max(16, triton.next_power_of_2(v_dim)),
            HAS_SINKS=sinks is not None,
            BLOCK_SIZE=block_size,
            BLOCK_Q=meta.block_q,
            TILE_N=_TILE_N,
            # fp32 models get fp32 products (not TF32), as torch does by default.
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            DOT_IN_FP32=q.device.type == "cpu",
        )
        return out


@dataclass(frozen=True)
class _LayerExtras:
    """What a layer adds to plain causal attention (`AttentionBackend.forward`'s keywords)."""

    sliding_window: int | None
    sinks: torch.Tensor | None
    value_dim: int


def _write_kv(
    k: torch.Tensor,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> None:
    """The step's new K/V into the pool. Latent attention has no V to write: the kernel then
    writes K twice, to the same rows."""
    num_tokens, num_kv_heads, head_dim = k.shape
    v_new = k if v is None else v
    write_kv_kernel[(num_tokens,)](
        k,
        v_new,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        *k_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
    )
