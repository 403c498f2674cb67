"""Paged attention: the per-step metadata (slot mapping, block tables, masks) and the attention op
that writes new K/V into the block pool and reads each request's K/V back through its block table.

Decodes go to the C kernel on CPU when one is given (it reads the pool in place), else through
the torch path (gather + matmul). All prefill chunks of a step are attended by one call: the C
kernel on CPU (in place, causal, per chunk), else one padded SDPA over every chunk (gathered
from the pool, block-masked), which is the CUDA path; `PREFILL_LOOP` keeps one SDPA per chunk
(the CPU fallback when no kernel can be built). Token batch order (set by the model runner):
decode tokens first, sorted by context length descending, then one contiguous chunk per
prefilling request. Knows nothing about requests, scheduling or sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from shoal.engine.paged_attention_kernel import PagedDecodeKernel

# A decode group is split where the padding it would save exceeds this many tokens: below it,
# one more gather + matmul per layer costs more than attending over the padding.
_DECODE_SPLIT_TOKENS = 512
# Positions per kernel work item: longer contexts are split so a few long requests still spread
# over all threads, and merged afterwards.
_KERNEL_PARTITION_TOKENS = 512


@dataclass
class DecodeGroup:
    """Decode requests (one query token each) attended together, padded to `num_blocks` blocks."""

    token_start: int
    num_seqs: int
    num_blocks: int
    block_table: torch.Tensor  # [num_seqs * num_blocks] block ids, padding rows point at block 0
    mask: torch.Tensor  # [num_seqs, num_blocks * block_size] additive: 0 or -inf past the context


@dataclass
class KernelDecode:
    """The step's decodes (batch rows [0, num_seqs)), attended by the C kernel in place."""

    num_seqs: int
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks] (padding entries never read)
    context_lens: torch.Tensor  # int32 [num_seqs]: positions [0, len) are attended
    partition_blocks: int
    num_threads: int  # torch's intra-op thread count, applied to the kernel's OpenMP region
    kernel: PagedDecodeKernel


@dataclass
class PrefillChunk:
    """One request's chunk of `num_tokens` query tokens at positions [start_pos, start_pos + n)."""

    token_start: int
    num_tokens: int
    start_pos: int
    block_ids: torch.Tensor | None  # blocks covering [0, start_pos + n); None when start_pos == 0
    mask: torch.Tensor | None  # bool [n, start_pos + n], causal offset by start_pos


@dataclass
class KernelPrefill:
    """Every prefill chunk of the step, attended by the C kernel in place (CPU)."""

    block_tables: torch.Tensor  # int32 [P, max_blocks]
    q_starts: torch.Tensor  # int32 [P]: each chunk's first row in the token batch
    q_lens: torch.Tensor  # int32 [P]
    start_pos: torch.Tensor  # int32 [P]: position of each chunk's first token
    num_threads: int
    kernel: PagedDecodeKernel


@dataclass
class PaddedPrefill:
    """Every prefill chunk of the step as one padded batch [P, max_q] x [P, max_k] for SDPA."""

    num_seqs: int
    max_q: int
    max_k: int
    query_rows: torch.Tensor  # [P * max_q] token row of each padded query (a real row always)
    key_slots: torch.Tensor  # [P * max_k] pool slot of each padded key (slot 0 past the end)
    mask: torch.Tensor  # bool [P, 1, max_q, max_k]: causal within each sequence's context
    out_rows: torch.Tensor  # [Tp] token rows of the prefill tokens (contiguous, batch order)
    padded_index: torch.Tensor  # [Tp] their index in the flat padded [P * max_q]


PrefillMode = Literal["kernel", "padded", "loop"]
PREFILL_KERNEL: PrefillMode = "kernel"
PREFILL_PADDED: PrefillMode = "padded"
PREFILL_LOOP: PrefillMode = "loop"


@dataclass
class AttentionMetadata:
    """Everything the attention layers need for one step, shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] flat slot of each token's K/V in the pool
    decode_groups: list[DecodeGroup]  # the torch path's decodes; empty when the kernel has them
    prefills: list[PrefillChunk]  # PREFILL_LOOP only
    num_tokens: int
    kernel_decode: KernelDecode | None = None
    kernel_prefill: KernelPrefill | None = None
    padded_prefill: PaddedPrefill | None = None


def token_positions(
    starts: np.ndarray, num_new_tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(request index, position) of every token of the flat batch, requests in batch order."""
    num_tokens = int(num_new_tokens.sum())
    req_of_token = np.repeat(np.arange(len(starts)), num_new_tokens)
    token_starts = np.cumsum(num_new_tokens) - num_new_tokens
    positions = starts[req_of_token] + (np.arange(num_tokens) - token_starts[req_of_token])
    return req_of_token, positions


def build_attention_metadata(
    *,
    starts: np.ndarray,
    num_new_tokens: np.ndarray,
    req_of_token: np.ndarray,
    positions: np.ndarray,
    block_table: np.ndarray,
    num_decodes: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    decode_kernel: PagedDecodeKernel | None = None,
    prefill_mode: PrefillMode | None = None,
) -> AttentionMetadata:
    """Builds the step's metadata from per-request arrays, in token batch order.

    Args:
        starts: [R] tokens already in the cache per request (its first new position).
        num_new_tokens: [R] query tokens per request; the first `num_decodes` are 1.
        req_of_token: [T] request index of each token (from `token_positions`).
        positions: [T] position of each token (from `token_positions`).
        block_table: [R, max_blocks] int64 block ids per request (padding entries ignored).
        num_decodes: how many leading requests are decodes, sorted by context length descending.
        block_size: tokens per block.
        dtype: the model's activation dtype (for additive masks).
        device: where the tensors go.
        decode_kernel: when given (CPU), the decodes are attended by it instead of the torch
            path.
        prefill_mode: how the prefill chunks are attended; default: the kernel when one is
            given, else one padded SDPA.

    Returns:
        The metadata; `slot_mapping` has one entry per token of the batch.
    """
    slots = block_table[req_of_token, positions // block_size] * block_size + positions % block_size
    slot_mapping = torch.from_numpy(slots).to(device, non_blocking=True)
    token_starts = np.cumsum(num_new_tokens) - num_new_tokens
    context_lens = starts + num_new_tokens
    num_blocks = -(-context_lens // block_size)
    kernel_decode = None
    groups: list[DecodeGroup] = []
    if decode_kernel is not None and num_decodes > 0:
        kernel_decode = _kernel_decode(
            block_table, num_blocks, context_lens, num_decodes, block_size, decode_kernel
        )
    else:
        groups = [
            _decode_group(lo, hi, block_table, num_blocks, context_lens, block_size, dtype, device)
            for lo, hi in _split_decodes(num_blocks[:num_decodes], block_size)
        ]
    if prefill_mode is None:
        prefill_mode = default_prefill_mode(device, decode_kernel)
    meta = AttentionMetadata(slot_mapping, groups, [], len(positions), kernel_decode)
    if num_decodes == len(starts):
        return meta
    if prefill_mode == PREFILL_KERNEL:
        assert decode_kernel is not None, "the kernel prefill mode needs the kernel"
        meta.kernel_prefill = _kernel_prefill(
            block_table[num_decodes:],
            num_blocks[num_decodes:],
            token_starts[num_decodes:],
            num_new_tokens[num_decodes:],
            starts[num_decodes:],
            decode_kernel,
        )
    elif prefill_mode == PREFILL_PADDED:
        meta.padded_prefill = _padded_prefill(
            block_table[num_decodes:],
            token_starts[num_decodes:],
            num_new_tokens[num_decodes:],
            starts[num_decodes:],
            block_size,
            device,
        )
    else:
        meta.prefills = [
            _prefill_chunk(
                int(token_starts[i]),
                int(num_new_tokens[i]),
                int(starts[i]),
                block_table[i, : num_blocks[i]],
                device,
            )
            for i in range(num_decodes, len(starts))
        ]
    return meta


def default_prefill_mode(device: torch.device, kernel: PagedDecodeKernel | None) -> PrefillMode:
    """The C kernel when there is one; on CUDA one padded SDPA; else one SDPA per chunk (on CPU
    the padding would cost more attention work than the per-chunk calls cost in Python)."""
    if kernel is not None:
        return PREFILL_KERNEL
    return PREFILL_PADDED if device.type == "cuda" else PREFILL_LOOP


def _int32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))


def _kernel_prefill(
    block_table: np.ndarray,
    num_blocks: np.ndarray,
    token_starts: np.ndarray,
    num_new_tokens: np.ndarray,
    starts: np.ndarray,
    kernel: PagedDecodeKernel,
) -> KernelPrefill:
    return KernelPrefill(
        block_tables=_int32(block_table[:, : int(num_blocks.max())]),
        q_starts=_int32(token_starts),
        q_lens=_int32(num_new_tokens),
        start_pos=_int32(starts),
        num_threads=torch.get_num_threads(),
        kernel=kernel,
    )


def _padded_prefill(
    block_table: np.ndarray,
    token_starts: np.ndarray,
    num_new_tokens: np.ndarray,
    starts: np.ndarray,
    block_size: int,
    device: torch.device,
) -> PaddedPrefill:
    num_seqs = len(starts)
    max_q = int(num_new_tokens.max())
    context_lens = starts + num_new_tokens
    max_k = int(context_lens.max())
    q_idx = np.arange(max_q)[None, :]
    # Padded queries repeat their chunk's last row: their mask rows are never empty (no NaN).
    q_clamped = np.minimum(q_idx, num_new_tokens[:, None] - 1)
    query_rows = token_starts[:, None] + q_clamped
    k_idx = np.arange(max_k)[None, :]
    in_context = k_idx < context_lens[:, None]
    k_safe = np.where(in_context, k_idx, 0)
    rows = np.arange(num_seqs)[:, None]
    key_slots = block_table[rows, k_safe // block_size] * block_size + k_safe % block_size
    key_slots = np.where(in_context, key_slots, 0)
    q_pos = starts[:, None] + q_clamped
    mask = k_idx[:, None, :] <= q_pos[:, :, None]  # [P, max_q, max_k]; past-context keys too
    is_real = q_idx < num_new_tokens[:, None]
    padded_index = (rows * max_q + q_idx)[is_real]
    out_rows = query_rows[is_real]

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

    return PaddedPrefill(
        num_seqs=num_seqs,
        max_q=max_q,
        max_k=max_k,
        query_rows=dev(query_rows.reshape(-1)),
        key_slots=dev(key_slots.reshape(-1)),
        mask=dev(mask[:, None]),
        out_rows=dev(out_rows),
        padded_index=dev(padded_index),
    )


def _kernel_decode(
    block_table: np.ndarray,
    num_blocks: np.ndarray,
    context_lens: np.ndarray,
    num_decodes: int,
    block_size: int,
    kernel: PagedDecodeKernel,
) -> KernelDecode:
    width = int(num_blocks[:num_decodes].max())
    tables = np.ascontiguousarray(block_table[:num_decodes, :width], dtype=np.int32)
    lens = np.ascontiguousarray(context_lens[:num_decodes], dtype=np.int32)
    return KernelDecode(
        num_seqs=num_decodes,
        block_tables=torch.from_numpy(tables),
        context_lens=torch.from_numpy(lens),
        partition_blocks=max(1, _KERNEL_PARTITION_TOKENS // block_size),
        num_threads=torch.get_num_threads(),
        kernel=kernel,
    )


def _split_decodes(num_blocks: np.ndarray, block_size: int) -> list[tuple[int, int]]:
    """Cuts decodes (sorted by length descending) into groups where padding would be costly."""
    bounds: list[tuple[int, int]] = []
    lo = 0
    for i in range(1, len(num_blocks)):
        saved = (int(num_blocks[lo]) - int(num_blocks[i])) * (len(num_blocks) - i) * block_size
        if saved >= _DECODE_SPLIT_TOKENS:
            bounds.append((lo, i))
            lo = i
    if len(num_blocks):
        bounds.append((lo, len(num_blocks)))
    return bounds


def _decode_group(
    lo: int,
    hi: int,
    block_table: np.ndarray,
    num_blocks: np.ndarray,
    context_lens: np.ndarray,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> DecodeGroup:
    width = int(num_blocks[lo])
    table = block_table[lo:hi, :width].copy()
    table[np.arange(width)[None, :] >= num_blocks[lo:hi, None]] = 0
    lens = torch.from_numpy(context_lens[lo:hi]).to(device)
    past_end = torch.arange(width * block_size, device=device)[None, :] >= lens[:, None]
    mask = torch.zeros(past_end.shape, dtype=dtype, device=device).masked_fill_(
        past_end, float("-inf")
    )
    return DecodeGroup(lo, hi - lo, width, torch.from_numpy(table.reshape(-1)).to(device), mask)


def _prefill_chunk(
    token_start: int, num_tokens: int, start_pos: int, block_ids: np.ndarray, device: torch.device
) -> PrefillChunk:
    if start_pos == 0:
        return PrefillChunk(token_start, num_tokens, 0, None, None)
    query_pos = torch.arange(start_pos, start_pos + num_tokens, device=device)
    key_pos = torch.arange(start_pos + num_tokens, device=device)
    mask = key_pos[None, :] <= query_pos[:, None]
    ids = torch.from_numpy(np.ascontiguousarray(block_ids)).to(device)
    return PrefillChunk(token_start, num_tokens, start_pos, ids, mask)


class AttentionWorkspace:
    """A growable scratch buffer for K/V gathers, shared by all layers of one model (they run
    one after another), so a step does not allocate (and page-fault) a fresh buffer per layer."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._buf
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(
                max(numel, 2 * buf.numel() if buf is not None else 0), dtype=dtype, device=device
            )
            self._buf = buf
        return buf[:numel]


class PagedAttention(nn.Module):
    """Attention over the paged KV pool of one layer.

    The pool (`kv_cache`, bound by the model runner) has shape
    [2, num_kv_heads, num_blocks, block_size, head_dim]: K then V, head-major so that gathering a
    request's blocks yields [heads, tokens, head_dim] slabs without a transpose.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, workspace: AttentionWorkspace
    ):
        super().__init__()
        self.workspace = workspace
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.kv_cache: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Writes k/v into the pool and attends; q [T, H, D], k/v [T, KVH, D] -> [T, H * D]."""
        cache = self.kv_cache
        assert cache is not None, "the KV cache is not bound; call ModelRunner.initialize_kv_cache"
        flat = cache.view(2, self.num_kv_heads, -1, self.head_dim)
        with record_function("shoal::kv_write"):
            flat[0].index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
            flat[1].index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        out = torch.empty(
            meta.num_tokens, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device
        )
        with record_function("shoal::attn_decode"):
            if meta.kernel_decode is not None:
                self._decode_in_place(q, meta.kernel_decode, out)
            for group in meta.decode_groups:
                self._decode(q, group, out)
        with record_function("shoal::attn_prefill"):
            if meta.kernel_prefill is not None:
                self._prefill_in_place(q, meta.kernel_prefill, out)
            if meta.padded_prefill is not None:
                self._prefill_padded(q, meta.padded_prefill, out)
            for chunk in meta.prefills:
                self._prefill(q, k, v, chunk, out)
        return out.view(meta.num_tokens, -1)

    def _prefill_in_place(self, q: torch.Tensor, pre: KernelPrefill, out: torch.Tensor) -> None:
        cache = self.kv_cache
        assert cache is not None
        is_fp32 = q.dtype == torch.float32
        query, dest = q, out
        if not is_fp32 or query.stride(-1) != 1:
            query = query.float().contiguous()
        if not is_fp32:
            dest = torch.empty(query.shape, dtype=torch.float32)
        pre.kernel.prefill(
            dest,
            query,
            cache[0],
            cache[1],
            pre.block_tables,
            pre.q_starts,
            pre.q_lens,
            pre.start_pos,
            scale=self.scale,
            num_threads=pre.num_threads,
        )
        if not is_fp32:
            # Only the prefill rows: the decode rows of `out` are already written.
            lo = int(pre.q_starts[0])
            out[lo:].copy_(dest[lo:])

    def _prefill_padded(self, q: torch.Tensor, pre: PaddedPrefill, out: torch.Tensor) -> None:
        cache = self.kv_cache
        assert cache is not None
        p, kvh, d = pre.num_seqs, self.num_kv_heads, self.head_dim
        qp = q.index_select(0, pre.query_rows).view(p, pre.max_q, self.num_heads, d)
        flat = cache.view(2, kvh, -1, d)
        # One gather of K and V for every chunk: [2, KVH, P * max_k, D] -> [P, KVH, max_k, D].
        kv = flat.index_select(2, pre.key_slots).view(2, kvh, p, pre.max_k, d).transpose(1, 2)
        res = F.scaled_dot_product_attention(
            qp.transpose(1, 2), kv[0], kv[1], attn_mask=pre.mask, enable_gqa=True
        )
        flat_res = res.transpose(1, 2).reshape(p * pre.max_q, self.num_heads, d)
        out.index_copy_(0, pre.out_rows, flat_res.index_select(0, pre.padded_index))

    def _gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        """K and V of `block_ids`, as [2, KVH, len(block_ids) * block_size, D] in the workspace."""
        cache = self.kv_cache
        assert cache is not None
        kvh2, block_numel = 2 * self.num_kv_heads, cache.shape[3] * self.head_dim
        ws = self.workspace.get(kvh2 * len(block_ids) * block_numel, cache.dtype, cache.device)
        pool = cache.view(kvh2, -1, block_numel)
        torch.index_select(pool, 1, block_ids, out=ws.view(kvh2, len(block_ids), block_numel))
        return ws.view(2, self.num_kv_heads, -1, self.head_dim)

    def _decode_in_place(self, q: torch.Tensor, decode: KernelDecode, out: torch.Tensor) -> None:
        cache = self.kv_cache
        assert cache is not None
        n = decode.num_seqs
        query, dest = q[:n], out[:n]
        # The kernel computes in fp32; bf16 activations are converted (only n x H x D floats).
        is_fp32 = q.dtype == torch.float32
        if not is_fp32 or query.stride(-1) != 1:
            query = query.float().contiguous()
        if not is_fp32:
            dest = torch.empty(query.shape, dtype=torch.float32)
        decode.kernel.decode(
            dest,
            query,
            cache[0],
            cache[1],
            decode.block_tables,
            decode.context_lens,
            scale=self.scale,
            partition_blocks=decode.partition_blocks,
            num_threads=decode.num_threads,
        )
        if not is_fp32:
            out[:n].copy_(dest)

    def _decode(self, q: torch.Tensor, group: DecodeGroup, out: torch.Tensor) -> None:
        n, kvh, d = group.num_seqs, self.num_kv_heads, self.head_dim
        kv = self._gather(group.block_table).view(2, kvh, n, -1, d)
        # Each KV head is a batch row and each request a "head": the query heads sharing a KV
        # head become that row's queries, so GQA needs no repeat of K/V.
        rows = slice(group.token_start, group.token_start + n)
        # Scaling q (n x H x D) is cheaper than scaling the scores (n x H x context).
        qg = (q[rows] * self.scale).view(n, kvh, -1, d).transpose(0, 1)
        scores = torch.matmul(qg, kv[0].transpose(-1, -2))
        scores.add_(group.mask[None, :, None, :])
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[rows].view(n, kvh, -1, d).copy_(torch.matmul(probs, kv[1]).transpose(0, 1))

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        chunk: PrefillChunk,
        out: torch.Tensor,
    ) -> None:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        # 4-D inputs: the CPU flash kernel only takes the batched layout.
        qh = q[rows].transpose(0, 1).unsqueeze(0)
        if chunk.block_ids is None:
            kh = k[rows].transpose(0, 1).unsqueeze(0)
            vh = v[rows].transpose(0, 1).unsqueeze(0)
            res = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        else:
            num_keys = chunk.start_pos + chunk.num_tokens
            kv = self._gather(chunk.block_ids)[:, :, :num_keys].unsqueeze(1)
            res = F.scaled_dot_product_attention(
                qh, kv[0], kv[1], attn_mask=chunk.mask, enable_gqa=True
            )
        out[rows].copy_(res[0].transpose(0, 1))
