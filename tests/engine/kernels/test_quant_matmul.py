"""The CPU kernel that computes few-row steps from a GGUF checkpoint's blocks: against a
float64 matmul over the dequantized weights within the reordering bound (plus, on its integer
path, the activations' rounding to 16 bits), and a model that uses it gives HF's tokens."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from shoal import LLM, SamplingParams
from shoal.engine.kernels.paged_attention import (
    ISA_CFLAGS,
    ISA_ENV,
    KernelBuildError,
    build_kernel,
)
from shoal.engine.kernels.quant_matmul import (
    SOURCE_PATH,
    QuantizedWeight,
    QuantMatmulKernel,
    load_quant_kernel,
)
from shoal.engine.loader import load_blocks, load_weights
from shoal.engine.model.layers import Linear
from tests.factories import hf_reference, make_tiny_checkpoint, make_tiny_gguf
from tests.reference import assert_greedy_matches, hf_greedy
from tests.tolerances import activation_rounding_bound, reordering_gamma

# quant_dot.h's ACT_LEVELS: a block of x becomes integers in [-32767, 32767].
ACT_LEVELS = 32767


@pytest.fixture(scope="module")
def native_kernel() -> QuantMatmulKernel:
    loaded = load_quant_kernel()
    assert loaded is not None, "the kernel must build where the tests run (cc and OpenMP)"
    return loaded


@pytest.fixture(scope="module", params=["native", "avx2", "avx"])
def kernel(
    request: pytest.FixtureRequest,
    native_kernel: QuantMatmulKernel,
    tmp_path_factory: pytest.TempPathFactory,
) -> QuantMatmulKernel:
    """The build for this CPU, one without AVX-512 (16-bit activations, integer dot products)
    and one without AVX2 either (float, 128-bit integer widening), on any x86 CPU."""
    if request.param == "native":
        return native_kernel
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the narrower builds are x86 only")
    cache = tmp_path_factory.mktemp("kernels")
    flags = ISA_CFLAGS[request.param]
    return QuantMatmulKernel(build_kernel(cache, extra_cflags=flags, source_path=SOURCE_PATH))


def _blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    dense = torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float64))
    weight = QuantizedWeight(qtype.value, torch.from_numpy(raw.copy()).view(torch.uint8), cols)
    return weight, dense


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
# Both paths of an AVX-512 build (rows below and from 4), every tile remainder, past max_rows.
@pytest.mark.parametrize("num_rows", [1, 3, 4, 7, 8, 9, 12, 17, 66])
def test_the_kernel_equals_a_float64_matmul_over_the_dequantized_weights(
    kernel: QuantMatmulKernel, qtype: GGMLQuantizationType, num_rows: int
) -> None:
    weight, dense = _blocks(qtype, rows=70, cols=96)
    # A row stride wider than K: x is a view of a wider buffer, as a slice of a fused output.
    generator = torch.Generator().manual_seed(num_rows)
    wide = torch.randn(num_rows, 128, generator=generator)
    x = wide[:, 16:112]
    bias = torch.randn(70, generator=generator)
    got = kernel.linear(x, weight, bias)
    want = x.double() @ dense.T + bias.double()
    assert got.shape == (num_rows, 70) and got.dtype == torch.float32
    # fp32 sums of 96 products (and the bias) in the kernel's order against float64: within
    # the reordering bound of tests/tolerances.py, elementwise (sum of |terms| per output).
    terms = x.double().abs() @ dense.abs().T + bias.double().abs()
    tolerance = reordering_gamma(torch.float32, 97) * terms
    if num_rows <= kernel.int_rows:
        # The integer path first rounds x to 16-bit blocks (steps of max|x| / 32767 a block of
        # 32): plus how far that can move each output (half a step per value, times its
        # weight; tests/tolerances.py).
        tolerance = tolerance + activation_rounding_bound(x, dense, levels=ACT_LEVELS)
    error = (got.double() - want).abs()
    assert bool((error <= tolerance).all()), (
        f"worst error / tolerance {float((error / tolerance).max())}"
    )


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
@pytest.mark.parametrize("num_rows", [1, 2, 9])
def test_the_integer_path_is_exact_for_the_activations_it_rounds(
    kernel: QuantMatmulKernel, qtype: GGMLQuantizationType, num_rows: int
) -> None:
    """Integer dot products add the quants' products exactly: the integer path's result is a
    float64 matmul of the rounded activations (the rule of quant_dot.h, redone in numpy) with
    the dequantized weights, up to the float32 reordering bound alone."""
    if num_rows > kernel.int_rows:
        pytest.skip("this build computes these rows in float")
    weight, dense = _blocks(qtype, rows=70, cols=96, seed=1)
    x = torch.randn(num_rows, 96, generator=torch.Generator().manual_seed(num_rows))
    got = kernel.linear(x, weight, None).double()
    blocks = x.numpy().reshape(num_rows, 3, 32)
    max_abs = np.abs(blocks).max(-1, keepdims=True)
    step = max_abs / np.float32(ACT_LEVELS)
    inverse = np.float32(ACT_LEVELS) / max_abs
    quants = np.rint(blocks * inverse)  # float32 products, rounded to nearest even as cvtps
    assert np.abs(quants).max() <= ACT_LEVELS
    rounded = torch.from_numpy((step.astype(np.float64) * quants).reshape(num_rows, 96))
    want = rounded @ dense.T
    tolerance = reordering_gamma(torch.float32, 96) * (rounded.abs() @ dense.abs().T)
    assert bool(((got - want).abs() <= tolerance).all())


def test_each_build_says_up_to_how_many_rows_it_serves(kernel: QuantMatmulKernel) -> None:
    assert kernel.max_rows in (12, 64)
    # AVX2 without AVX-512: every step; AVX-512 (float forms) and AVX only: none.
    assert kernel.int_rows in (0, 1 << 30)


def test_the_isa_switch_narrows_every_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SHOAL_CPU_ISA=avx2 builds what a CPU without AVX-512 runs (12-row tiles, 16-bit
    activations), avx what one without AVX2 runs (float only), whatever this CPU has; an
    unknown value is refused by name."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the narrower builds are x86 only")
    monkeypatch.setenv(ISA_ENV, "avx2")
    narrowed = QuantMatmulKernel(build_kernel(tmp_path, source_path=SOURCE_PATH))
    assert narrowed.max_rows == 12
    assert narrowed.int_rows == 1 << 30  # integer dot products at every step size
    monkeypatch.setenv(ISA_ENV, "avx")
    float_only = QuantMatmulKernel(build_kernel(tmp_path, source_path=SOURCE_PATH))
    assert float_only.int_rows == 0  # no AVX2: the float path
    monkeypatch.setenv(ISA_ENV, "avx9")
    with pytest.raises(KernelBuildError, match="SHOAL_CPU_ISA='avx9'"):
        build_kernel(tmp_path, source_path=SOURCE_PATH)


def test_blocks_are_checked_when_made() -> None:
    weight, _ = _blocks(GGMLQuantizationType.Q4_1, rows=4, cols=64)
    with pytest.raises(ValueError, match="blocks must be uint8"):
        QuantizedWeight(weight.ggml_type, weight.blocks[:, :-1].contiguous(), 64)
    with pytest.raises(ValueError, match="no kernel"):
        QuantizedWeight(GGMLQuantizationType.Q4_0.value, weight.blocks, 64)
    with pytest.raises(ValueError, match="no kernel"):
        QuantizedWeight(weight.ggml_type, weight.blocks, 48)  # not whole blocks
    other, _ = _blocks(GGMLQuantizationType.Q8_0, rows=4, cols=64)
    with pytest.raises(ValueError, match="share"):
        QuantizedWeight.concat([weight, other])
    fused = QuantizedWeight.concat([weight, weight])
    assert fused.out_features == 8 and fused.in_features == 64


def _projections(llm: LLM) -> list[Linear]:
    executor = llm._driver.engine_core.executor  # type: ignore[union-attr]
    model = executor.worker.model_runner.model  # type: ignore[attr-defined]
    return [m for m in model.modules() if isinstance(m, Linear)]


@pytest.mark.parametrize("tied", [False, True])
def test_a_q4_1_model_gives_hfs_tokens_from_its_blocks_alone_and_batched(
    tmp_path: Path, tied: bool
) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "ckpt", "llama", tie_word_embeddings=tied)
    path = make_tiny_gguf(tmp_path / "tiny.gguf", checkpoint, qtype="Q4_1")
    hf = hf_reference(path)
    prompts = [[5, 6, 7, 8, 9], [11, 3, 40, 2], [7] * 12, [20, 21]]
    references = [hf_greedy(hf, p, 24) for p in prompts]
    llm = LLM(path, dtype="float32", max_model_len=256)
    projections = _projections(llm)
    # Every projection computes from blocks: q/k/v and gate/up fused, o, down, the LM head.
    assert all(p.quantized is not None for p in projections)
    assert len(projections) == 2 * 4 + 1
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, (out, reference) in enumerate(zip(batched, references, strict=True)):
        assert_greedy_matches(list(out.outputs[0].token_ids), reference, label=f"batched {i}")
        alone = llm.generate([{"prompt_token_ids": prompts[i]}], params)[0]
        assert_greedy_matches(list(alone.outputs[0].token_ids), reference, label=f"alone {i}")


def test_without_the_kernel_the_dense_weights_give_the_same_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    path = make_tiny_gguf(tmp_path / "tiny.gguf", checkpoint, qtype="Q4_1")
    reference = hf_greedy(hf_reference(path), [5, 6, 7, 8], 16)
    monkeypatch.setenv("SHOAL_DISABLE_CPU_KERNEL", "1")
    llm = LLM(path, dtype="float32", max_model_len=256)
    assert all(p.quantized is None for p in _projections(llm))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params)[0]
    assert_greedy_matches(list(out.outputs[0].token_ids), reference)


def test_only_gguf_checkpoints_have_blocks_and_q_k_rows_are_in_hf_order(tmp_path: Path) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    assert load_blocks(checkpoint) is None
    path = make_tiny_gguf(tmp_path / "tiny.gguf", checkpoint, qtype="Q8_0")
    blocks = dict(load_blocks(path) or [])
    weights = dict(load_weights(path))
    # The blocks' rows dequantize to the loader's (un-permuted) dense rows.
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ):
        weight = blocks[name]
        raw = weight.blocks.numpy()
        dense = dequantize(raw, GGMLQuantizationType(weight.ggml_type))
        assert torch.equal(torch.from_numpy(np.array(dense, dtype=np.float32)), weights[name])
