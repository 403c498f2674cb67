"""TRITON_ATTN against the torch reference: mixed batches of decodes and prefill chunks (with and
without a cached prefix, ending mid-block, one token), block sizes 16 and 32, head sizes 64 and
128, GQA groups of 1, 4 and 8, fp32 and half precision; and greedy tokens equal to HF's.

Without CUDA the kernels run under Triton's interpreter, which tests/conftest.py chooses before
anything imports triton (in a process without CUDA nothing else runs Triton, so no other test
sees it). With CUDA the same cases run compiled on the GPU (`gpu`) and the interpreter's are
skipped: the interpreter is chosen per process.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shoal.engine.model.attention import select_attention_backend
from shoal.engine.model.attention.backend import AttentionBackend
from shoal.engine.model.attention.torch_sdpa import TorchSDPABackend
from tests.engine.model.attention.cases import LONG_CHUNKS, MIXED_CHUNKS, VARIANTS, PagedStep
from tests.engine.model_utils import (
    assert_runner_matches_hf,
    make_hf_model,
    make_runner,
    random_prompts,
)
from tests.tolerances import assert_reordered_close

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            torch.cuda.is_available(), reason="with CUDA, Triton runs compiled, not interpreted"
        ),
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def _triton(device: str, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    return select_attention_backend(
        "TRITON_ATTN",
        device=torch.device(device),
        dtype=torch.float32,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )


def _compare_with_reference(step: PagedStep, backend: AttentionBackend) -> None:
    out, pool = step.run(backend)
    ref, ref_pool = step.run(TorchSDPABackend())
    assert torch.equal(pool, ref_pool), "new K/V landed in other slots"
    max_context = int(step.batch.context_lens.max())
    head_dim = step.q.shape[-1]
    assert_reordered_close(out, ref, length=2 * max_context + head_dim)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_matches_the_reference(
    device: str, group: int, head_dim: int, block_size: int
) -> None:
    step = PagedStep(
        MIXED_CHUNKS,
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        device=device,
        seed=group + head_dim + block_size,
    )
    _compare_with_reference(step, _triton(device, 2 * group, 2, head_dim))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layer_extras_match_the_dense_reference(device: str, variant: str) -> None:
    step = PagedStep(
        LONG_CHUNKS,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        device=device,
        **VARIANTS[variant],
    )
    num_kv_heads = step.pool.shape[1]
    out, pool = step.run(_triton(device, 8, num_kv_heads, 64))
    expected, expected_pool = step.dense_reference()
    torch.testing.assert_close(pool, expected_pool, rtol=0, atol=0, equal_nan=True)
    assert not out.isnan().any(), "read a block that lies wholly before the window"
    max_context = max(s + n for s, n in LONG_CHUNKS)
    assert_reordered_close(out, expected.float(), length=2 * max_context + 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "chunks",
    [
        [(0, 1)],  # a one-token prompt, alone
        [(0, 32), (32, 1)],  # a prompt of exactly two blocks, a decode starting a block
        [(0, 70)],  # more queries than one program holds
        [(40, 1), (3, 1), (100, 1)],  # decodes only
    ],
    ids=["one-token", "block-edges", "long-chunk", "decodes"],
)
def test_edge_batches_match_the_reference(device: str, chunks: list[tuple[int, int]]) -> None:
    step = PagedStep(chunks, num_heads=4, num_kv_heads=4, head_dim=64, block_size=16, device=device)
    _compare_with_reference(step, _triton(device, 4, 4, 64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 8])
def test_half_precision_within_rounding(device: str, dtype: torch.dtype, group: int) -> None:
    step = PagedStep(
        MIXED_CHUNKS,
        num_heads=2 * group,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        device=device,
    )
    out, _ = step.run(_triton(device, 2 * group, 2, 64))
    assert out.dtype == dtype
    expected, _ = step.dense_reference()
    # Products of half-precision inputs are exact in fp32; what is left is the probabilities
    # rounded to `dtype` before the V product and the output's own rounding.
    eps = torch.finfo(dtype).eps
    bound = 2 * eps * float(step.pool[1].abs().max())
    assert float((out.double() - expected).abs().max()) <= bound


@pytest.mark.parametrize("device", DEVICES)
def test_metadata_tiles_each_chunk_without_padding(device: str) -> None:
    step = PagedStep(MIXED_CHUNKS, num_heads=8, num_kv_heads=2, head_dim=16, block_size=16)
    meta = _triton(device, 8, 2, 16).build_metadata(step.batch, torch.device(device))
    own = {f.name for f in dataclasses.fields(meta)} - {"num_tokens", "slot_mapping"}
    assert own == {
        "block_tables",
        "seq_q_starts",
        "seq_q_lens",
        "seq_start_pos",
        "prog_seq",
        "prog_q_offset",
        "block_q",
    }
    # Groups of 4 query heads: 16 query tokens per program; each chunk gets only its own tiles.
    assert meta.block_q == 16
    assert meta.prog_seq.tolist() == [0, 1, 2, 3, 3, 4, 5]
    assert meta.prog_q_offset.tolist() == [0, 0, 0, 0, 16, 0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tokens_equal_hfs(device: str) -> None:
    hf_model = make_hf_model("LlamaForCausalLM", seed=4)
    runner = make_runner(hf_model, device=device, attention_backend="TRITON_ATTN")
    assert runner.attention_backend.name == "TRITON_ATTN"
    assert_runner_matches_hf(hf_model, runner, random_prompts([7, 19, 1]), max_new_tokens=4)
