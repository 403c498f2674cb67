"""TORCH_SDPA, the reference the other backends are held to, against a float64 dense
softmax(QK^T)V computed token by token: mixed batches, GQA, blocks that straddle tiles, and the
layer extras (sliding windows, sinks, latent attention)."""

from __future__ import annotations

import pytest
import torch

from shoal.engine.model.attention.torch_sdpa import TorchSDPABackend
from tests.engine.model.attention.cases import LONG_CHUNKS, MIXED_CHUNKS, VARIANTS, PagedStep
from tests.tolerances import assert_reordered_close


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [5, 16])
def test_matches_the_dense_reference(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    step = PagedStep(
        MIXED_CHUNKS,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        block_size=block_size,
    )
    out, pool = step.run(TorchSDPABackend())
    expected, expected_pool = step.dense_reference()
    assert torch.equal(pool, expected_pool)
    max_context = max(s + n for s, n in MIXED_CHUNKS)
    assert_reordered_close(out, expected.float(), length=2 * max_context + 32)


def test_prefill_only_and_decode_only_steps() -> None:
    for chunks in ([(0, 7), (3, 4)], [(9, 1), (0, 1)]):
        step = PagedStep(chunks, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
        out, _ = step.run(TorchSDPABackend())
        assert_reordered_close(out, step.dense_reference()[0].float(), length=64)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("block_size", [5, 16])
def test_layer_extras_match_the_dense_reference(variant: str, block_size: int) -> None:
    step = PagedStep(
        LONG_CHUNKS,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        block_size=block_size,
        **VARIANTS[variant],
    )
    out, pool = step.run(TorchSDPABackend())
    expected, expected_pool = step.dense_reference()
    torch.testing.assert_close(pool, expected_pool, rtol=0, atol=0, equal_nan=True)
    assert not out.isnan().any(), "read a block that lies wholly before the window"
    max_context = max(s + n for s, n in LONG_CHUNKS)
    assert_reordered_close(out, expected.float(), length=2 * max_context + 32)
