"""CPU_ATTN (the C kernels behind the seam) against the torch reference on mixed batches, in
fp32 and with a bf16 pool; its metadata holds only the kernels' fields."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shoal.engine.kernels.paged_attention import load_decode_kernel
from shoal.engine.model.attention.cpu_attn import CpuAttnBackend
from shoal.engine.model.attention.torch_sdpa import TorchSDPABackend
from tests.engine.model.attention.cases import LONG_CHUNKS, MIXED_CHUNKS, VARIANTS, PagedStep
from tests.tolerances import assert_reordered_close


@pytest.fixture(scope="module")
def backend() -> CpuAttnBackend:
    kernel = load_decode_kernel()
    assert kernel is not None, "the kernel must build where the tests run (cc and OpenMP)"
    return CpuAttnBackend(kernel)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (16, 2)])
def test_matches_the_torch_reference(backend, num_heads: int, num_kv_heads: int) -> None:
    step = PagedStep(
        MIXED_CHUNKS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64, block_size=16
    )
    out, pool = step.run(backend)
    ref, ref_pool = step.run(TorchSDPABackend())
    assert torch.equal(pool, ref_pool)
    max_context = max(s + n for s, n in MIXED_CHUNKS)
    assert_reordered_close(out, ref, length=2 * max_context + 64)


def test_bf16_within_bf16_rounding(backend) -> None:
    step = PagedStep(
        MIXED_CHUNKS, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16
    )
    out, _ = step.run(backend)
    assert out.dtype == torch.bfloat16
    expected = step.dense_reference()[0]
    # Both read the same bf16 K/V and compute in fp32; only the output's rounding remains.
    eps = torch.finfo(torch.bfloat16).eps
    assert (out.double() - expected).abs().max() <= 2 * eps * expected.abs().max()


def test_metadata_holds_only_the_kernels_fields(backend) -> None:
    step = PagedStep(MIXED_CHUNKS, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    meta = backend.build_metadata(step.batch, torch.device("cpu"))
    names = {f.name for f in dataclasses.fields(meta)}
    assert names == {"num_tokens", "slot_mapping", "decode", "prefill", "num_threads"}
    assert meta.decode is not None and meta.decode.num_seqs == 3
    assert meta.prefill is not None and meta.prefill.q_lens.tolist() == [21, 9, 2]
    decodes_only = PagedStep([(4, 1)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    assert backend.build_metadata(decodes_only.batch, torch.device("cpu")).prefill is None


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 64), (5, 40)])
def test_layer_extras_match_the_dense_reference(
    backend, variant: str, block_size: int, head_dim: int
) -> None:
    step = PagedStep(
        LONG_CHUNKS,
        num_heads=8,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        **VARIANTS[variant],
    )
    out, pool = step.run(backend)
    expected, expected_pool = step.dense_reference()
    torch.testing.assert_close(pool, expected_pool, rtol=0, atol=0, equal_nan=True)
    assert not out.isnan().any(), "read a block that lies wholly before the window"
    max_context = max(s + n for s, n in LONG_CHUNKS)
    assert_reordered_close(out, expected.float(), length=2 * max_context + head_dim)


def test_deepseek_v3s_latent_width_and_a_wide_group(backend) -> None:
    """576-wide latent rows (512 values), 32 query heads on the one latent head."""
    step = PagedStep(
        [(40, 1), (0, 1), (0, 19), (16, 7)],
        num_heads=32,
        num_kv_heads=1,
        head_dim=576,
        block_size=16,
        value_dim=512,
    )
    out, _ = step.run(backend)
    expected, _ = step.dense_reference()
    assert out.shape == (28, 32, 512)
    assert_reordered_close(out, expected.float(), length=2 * 47 + 576)
