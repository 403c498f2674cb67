"""The Triton kernels of TRITON_ATTN. One source serves NVIDIA and AMD GPUs and, under Triton's
interpreter (TRITON_INTERPRET=1 before triton is imported), CPU tensors, where the tests step
through it.

`write_kv_kernel` stores the step's new K/V in the pool; `paged_attention_kernel` then attends
every query token of a mixed batch (prefill chunks and decodes) in one launch, reading K/V
straight from the pool through the block table.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_cache_h,
    stride_cache_b,
    stride_cache_t,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Program t copies token t's K and V rows [NUM_KV_HEADS, HEAD_DIM] to pool slot
    slot[t] = block * BLOCK_SIZE + offset."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    dst = (
        heads[:, None].to(tl.int64) * stride_cache_h
        + block * stride_cache_b
        + offset * stride_cache_t
        + dims[None, :]
    )
    row = t.to(tl.int64)
    k = tl.load(k_ptr + row * stride_k_t + heads[:, None] * stride_k_h + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + row * stride_v_t + heads[:, None] * stride_v_h + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _mask_scores(scores, k_pos, q_pos, k_valid, window):
    """-inf where a row may not see a key: past its position, or (window > 0) before it."""
    visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
    if window > 0:
        visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
    return tl.where(visible, scores, float("-inf"))


@triton.jit
def _softmax_update(m, l, scores):  # noqa: E741
    """One tile of the online softmax (base 2): (new running max, the factor rescaling the
    old state, the tile's weights, new normaliser). A row that has seen no key yet (its
    window starts in a later tile) keeps m = -inf and is shifted by 0 instead, so its factor
    and weights are 0, not NaN."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    return m_new, alpha, p, l * alpha + tl.sum(p, axis=1)


@triton.jit
def _fold_sinks(m, l, acc, sinks_ptr, head, row_valid):  # noqa: E741
    """Each row's sink as one more softmax term: exp(sink) in the normaliser, nothing in acc
    (base 2, as the running max `m` is)."""
    sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * LOG2E
    m_final = tl.maximum(m, sink)
    kept = tl.exp2(m - m_final)
    return l * kept + tl.exp2(sink - m_final), acc * kept[:, None]


@triton.jit
def paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_q_starts_ptr,
    seq_q_lens_ptr,
    seq_start_pos_ptr,
    prog_seq_ptr,
    prog_q_offset_ptr,
    stride_out_t,
    stride_out_h,
    stride_q_t,
    stride_q_h,
    stride_cache_h,
    stride_cache_b,
    stride_cache_t,
    stride_tables,
    qk_scale,
    window,
    sinks_ptr,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    V_DIM: tl.constexpr,
    V_DIM_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """Causal attention over the paged pool for one tile of queries and one KV head.

    Grid: (programs, num_kv_heads). Program p serves sequence prog_seq[p], its chunk's queries
    [prog_q_offset[p], + BLOCK_Q), and for each of them the QUERIES_PER_KV query heads that
    share KV head program_id(1): BLOCK_Q * GROUP_PAD rows, so a GQA group reads each K/V tile
    once. Sequence s owns batch rows [seq_q_starts[s], + seq_q_lens[s]) at positions from
    seq_start_pos[s] (the tokens already cached before the chunk; a decode is a chunk of one).
    A query at position i sees positions [0, i]: the cached prefix in full, its chunk causally;
    with a sliding `window` > 0 only (i - window, i], and the walk starts at the tile holding the
    program's first query's window start (earlier blocks may be freed). Values are the first
    V_DIM entries of the V pool's rows (latent attention passes the K pool as the V pool). With
    HAS_SINKS, each head's softmax has one more term, exp(sinks[head]), that carries no value.

    The keys are walked in tiles of TILE_N positions with an online softmax (running max `m`
    and normaliser `l`, base 2; `qk_scale` carries log2(e)). A program's key range is
    [0, its last query's position]; a split-KV variant would give each program a slice of that
    range and merge the partial (m, l, acc) triples in a second pass.

    DOT_IN_FP32 widens the (exactly representable) bf16/fp16 operands of both products to fp32,
    for the interpreter, whose bf16 `tl.dot` is wrong; the probabilities are still rounded to
    the V dtype first, as the GPU's half-precision product rounds them.
    """
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(prog_seq_ptr + pid)
    q_offset = tl.load(prog_q_offset_ptr + pid)
    q_start = tl.load(seq_q_starts_ptr + seq)
    q_len = tl.load(seq_q_lens_ptr + seq)
    start_pos = tl.load(seq_start_pos_ptr + seq)

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_idx = q_offset + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_valid = (q_idx < q_len) & (head_in_group < QUERIES_PER_KV)
    head = kv_head * QUERIES_PER_KV + head_in_group
    # Padding rows pretend to sit at position 0 (a window may hide it from them: their
    # results are never stored).
    q_pos = tl.where(row_valid, start_pos + q_idx, 0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    token_row = (q_start + q_idx).to(tl.int64)
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(
        q_ptr + token_row[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
        mask=q_mask,
        other=0.0,
    )
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)  # noqa: E741
    v_dims = tl.arange(0, V_DIM_PAD)
    v_dim_valid = v_dims < V_DIM
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, V_DIM_PAD], dtype=tl.float32)
    num_keys = start_pos + tl.minimum(q_offset + BLOCK_Q, q_len)
    first_key = 0
    if window > 0:
        first_key = tl.maximum(start_pos + q_offset + 1 - window, 0)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_tables
    head_base = kv_head.to(tl.int64) * stride_cache_h
    for tile_start in range(first_key // TILE_N * TILE_N, num_keys, TILE_N):
        k_pos = tile_start + tl.arange(0, TILE_N)
        # Keys before the window are not even loaded: their blocks may be freed and reused.
        k_valid = (k_pos < num_keys) & (k_pos >= first_key)
        block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        kv_offset = head_base + block * stride_cache_b + (k_pos % BLOCK_SIZE) * stride_cache_t
        kv_mask = k_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + kv_offset[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        scores = _mask_scores(scores, k_pos, q_pos, k_valid, window)
        m, alpha, p, l = _softmax_update(m, l, scores)  # noqa: E741
        v_mask = k_valid[:, None] & v_dim_valid[None, :]
        v = tl.load(v_cache_ptr + kv_offset[:, None] + v_dims[None, :], mask=v_mask, other=0.0)
        p_v = p.to(v.dtype)
        if DOT_IN_FP32:
            p_v, v = p_v.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=DOT_PRECISION)

    if HAS_SINKS:
        l, acc = _fold_sinks(m, l, acc, sinks_ptr, head, row_valid)  # noqa: E741
    # Padding rows a window hides everything from have l = 0; they are never stored.
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    rows_out = out_ptr + token_row[:, None] * stride_out_t + head[:, None] * stride_out_h
    out_mask = row_valid[:, None] & v_dim_valid[None, :]
    tl.store(rows_out + v_dims[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)
