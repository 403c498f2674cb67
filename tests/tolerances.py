"""How far apart two correct float computations of the same values may be.

Two implementations that add up the same terms in different orders (another matmul blocking,
another SIMD width, a layer split across expert-parallel ranks and summed after the exchange)
are both right and still differ. Summing n terms in floating point is off the exact sum by at
most gamma_n * sum(|terms|), where gamma_n = n*u / (1 - n*u) and u = eps / 2 is the unit
roundoff (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 3.1); two
orders are therefore within 2 * gamma_n * sum(|terms|) of each other. Chained reductions (a
matmul feeding another) add their lengths to first order.

So a comparison between two orders takes its tolerance from the dtype, the reduction length
and the magnitude it works at, never from what one CPU happened to produce: AVX-512 and AVX2
kernels, oneDNN and ATen, each pick their own order. Where both sides run the same code on the
same inputs the results are bit-equal and tests compare exactly (greedy tokens, copied weights,
blocks that dequantize to the same values).
"""

from __future__ import annotations

import torch


def reordering_gamma(dtype: torch.dtype, length: int) -> float:
    """2 * gamma_length for `dtype`: the relative gap two summation orders of `length` terms
    can open, as a fraction of the sum of the terms' magnitudes."""
    u = torch.finfo(dtype).eps / 2
    assert length * u < 0.5, "reduction too long for a first-order bound"
    return 2 * length * u / (1 - length * u)


def reordering_tolerance(dtype: torch.dtype, length: int, scale: float) -> dict[str, float]:
    """`torch.testing.assert_close` keywords for two orders of reductions `length` long whose
    terms' magnitudes add up to at most `scale` (per element; the largest |value| compared, for
    layers of random weights whose terms do not cancel much).

    Args:
        dtype: the dtype both sides computed in.
        length: the reduction length, summed over chained reductions.
        scale: the magnitude the sums work at.
    """
    gamma = reordering_gamma(dtype, length)
    return {"atol": gamma * scale, "rtol": gamma}


def assert_reordered_close(
    actual: torch.Tensor, expected: torch.Tensor, *, length: int, scale: float | None = None
) -> None:
    """`actual` equals `expected` up to the order of their sums (see the module docstring);
    `scale` defaults to the largest |expected|."""
    if scale is None:
        scale = float(expected.abs().max()) if expected.numel() else 0.0
    tolerance = reordering_tolerance(expected.dtype, length, scale)
    torch.testing.assert_close(actual, expected, **tolerance)


def decoder_reduction_length(
    *, hidden: int, intermediate: int, head_dim: int, num_layers: int, context: int
) -> int:
    """The chained reduction length behind a decoder's logits: per layer two RMSNorms and the
    q/k/v projections over `hidden`, attention scores over `head_dim` and their weighted sum over
    `context`, o_proj and gate/up over `hidden`, down over `intermediate`; then the final norm
    and the LM head over `hidden`. (RMSNorm rescales, so what carries from layer to layer is
    the relative error: the lengths add.)"""
    per_layer = 3 * hidden + head_dim + context + 2 * hidden + intermediate
    return num_layers * per_layer + 2 * hidden


def activation_rounding_bound(
    x: torch.Tensor, weight: torch.Tensor, *, block: int = 32, levels: int
) -> torch.Tensor:
    """How far x @ weight.T can move, per element, when each row of x is first rounded to
    integer steps a block at a time, as the integer path of the GGUF-block kernel does: a block
    of `block` values takes the step d = max|x over the block| / levels and each value becomes
    d * round(x / d), so it moves by at most d / 2, and output n by at most
    sum_k |w[n, k]| * d(k) / 2. The kernel computes d and x / d in float32; those two
    roundings stretch the half step by under 4 float32 units, covered by the 1e-4 below.

    Args:
        x: [M, K], K a multiple of `block`.
        weight: [N, K].
        block: values sharing one step.
        levels: steps each side of zero (127 for int8, 32767 for int16).

    Returns:
        float64 [M, N]: the bound, to add to the reordering tolerance of the sums.
    """
    rows, length = x.shape
    blocks = x.double().abs().reshape(rows, length // block, block)
    half_step = blocks.amax(-1) / (2 * levels) * (1 + 1e-4)
    return half_step.repeat_interleave(block, dim=1) @ weight.double().abs().T
