"""Rotary position embeddings: the inverse frequencies of each rope type a supported checkpoint
names (default, linear, llama3, yarn), the cos/sin table, and the rotation itself (rotate-half;
interleaved checkpoints are de-interleaved by their model first).

Knows nothing about attention, requests or the KV cache.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from shoal.engine.errors import ModelLoadError
from shoal.engine.model_arch import ROPE_TYPES


def rope_type(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies (float32) for default, linear, llama3 and yarn rope scaling.

    Raises:
        ModelLoadError: for a rope scaling type not in ROPE_TYPES.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(rope_scaling)
    if kind == "default":
        return inv_freq
    assert rope_scaling is not None
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, rope_scaling)
    raise ModelLoadError(f"unsupported rope_scaling type {kind!r}; supported: {ROPE_TYPES}")


def rope_attention_factor(rope_scaling: dict[str, Any] | None) -> float:
    """What yarn multiplies cos and sin by (1 for the other types)."""
    if rope_type(rope_scaling) != "yarn":
        return 1.0
    assert rope_scaling is not None
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = float(rope_scaling["factor"])
    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between the
    dimensions that turn `beta_fast` and `beta_slow` times over the original context."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:
        return head_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding over a precomputed cos/sin table indexed by position."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        rope_scaling: dict[str, Any] | None,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, rope_scaling)
        # float32 angles, then cast: the same rounding as HF's per-call computation.
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        factor = rope_attention_factor(rope_scaling)
        cos, sin = freqs.cos(), freqs.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", sin.to(device=device, dtype=dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> RopeAngles:
        """cos / sin rows [T, 1, D/2] for the step's positions, looked up once for all layers."""
        return RopeAngles(
            self.cos.index_select(0, positions).unsqueeze(1),
            self.sin.index_select(0, positions).unsqueeze(1),
        )


class RopeAngles(NamedTuple):
    cos: torch.Tensor
    sin: torch.Tensor

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate-half rotation of x [T, heads, D]; returns a new tensor."""
        return _rotate(x, self.cos, self.sin)

    def rotate_(self, x: torch.Tensor) -> torch.Tensor:
        """The same rotation written over x (a view, e.g. into a fused qkv), rounded the same
        way as `rotate`; returns x."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        x2_sin, x1_sin = x2 * self.sin, x1 * self.sin
        x1.mul_(self.cos).sub_(x2_sin)
        x2.mul_(self.cos).add_(x1_sin)
        return x


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
