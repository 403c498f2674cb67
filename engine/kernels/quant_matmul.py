"""Decode-step matmuls straight from GGUF blocks (engine/kernels/csrc/quant_matmul.c).

A GGUF checkpoint's projections are stored quantized (Q4_1, Q8_0). The engine dequantizes
them to fp32 for the dense path, and on CPU also keeps the blocks themselves: a step of a few
rows (decode) reads every weight once and is bound by memory, so reading 5 or 8.5 bits a weight
instead of 32 is faster; a step of many rows (prefill) stays on the dense weights and oneDNN.
The kernel computes with the blocks' exact values, so the two differ only in how the sums
round. Knows tensors and blocks, not models.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shoal.engine.kernels.paged_attention import DISABLE_ENV, load_cpu_kernel

SOURCE_PATH = Path(__file__).parent / "csrc" / "quant_matmul.c"

# GGUF type id → (the kernel's code, bytes per block of 32 weights).
QUANT_TYPES: dict[int, tuple[int, int]] = {3: (0, 20), 8: (1, 34)}  # Q4_1, Q8_0
BLOCK_SIZE = 32
_ERRORS = {-1: "bad argument", -2: "out of memory"}

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[Any] = [
    *(_ptr, _i64, _ptr, _i64),  # y, its row stride, x, its row stride
    *(_ptr, _i64, ctypes.c_int, _ptr),  # blocks, bytes per row, type code, bias
    *(_i64, _i64, _i64, ctypes.c_int),  # M, N, K, threads
]


@dataclass(frozen=True)
class QuantizedWeight:
    """A [out_features, in_features] weight as GGUF blocks: row n is `blocks[n]`.

    Args:
        ggml_type: the GGUF quantization type id (a key of QUANT_TYPES).
        blocks: uint8 [out_features, in_features / 32 * bytes per block], contiguous.
        in_features: K.
    """

    ggml_type: int
    blocks: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        if not is_quantizable(self.ggml_type, self.in_features):
            raise ValueError(f"no kernel for GGUF type {self.ggml_type} at K={self.in_features}")
        row_bytes = self.in_features // BLOCK_SIZE * QUANT_TYPES[self.ggml_type][1]
        blocks = self.blocks
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes:
            raise ValueError(f"blocks must be uint8 [rows, {row_bytes}], got {blocks.shape}")
        if not blocks.is_contiguous():
            raise ValueError("blocks must be contiguous")

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @staticmethod
    def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The rows of `parts` stacked (a fused projection); they must share type and K.

        Raises:
            ValueError: the parts differ in type or in_features.
        """
        first = parts[0]
        if any(p.ggml_type != first.ggml_type or p.in_features != first.in_features for p in parts):
            raise ValueError("fused parts must share quantization type and in_features")
        if len(parts) == 1:
            return first  # an unfused projection: its blocks as they are, no copy
        return QuantizedWeight(
            first.ggml_type, torch.cat([p.blocks for p in parts]).contiguous(), first.in_features
        )


def is_quantizable(ggml_type: int, in_features: int) -> bool:
    """Whether the kernel computes with blocks of this type for rows of this length."""
    return ggml_type in QUANT_TYPES and in_features % BLOCK_SIZE == 0


class QuantMatmulKernel:
    """The loaded kernel.

    Raises:
        OSError: the shared object cannot be loaded.
    """

    def __init__(self, library_path: Path) -> None:
        lib = ctypes.CDLL(str(library_path))
        self._fn = lib.shoal_quant_matmul
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int
        lib.shoal_quant_max_rows.restype = ctypes.c_int
        # Steps of at most this many rows use the blocks, larger ones (prefill) the dense
        # weights: where this build stops beating oneDNN (AVX-512 or not).
        self.max_rows: int = lib.shoal_quant_max_rows()
        lib.shoal_quant_int_rows.restype = ctypes.c_int
        # Steps of at most this many rows round x to 16-bit blocks and multiply with integer
        # dot products (AVX2 without AVX-512); 0 in other builds, whose steps stay in float.
        self.int_rows: int = lib.shoal_quant_int_rows()

    def linear(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K] fp32 (last dim contiguous) → [M, N] = x W^T (+ bias).

        Raises:
            RuntimeError: the kernel rejected its arguments.
        """
        assert x.dtype == torch.float32 and x.dim() == 2, "x: fp32 [M, K]"
        if x.stride(1) != 1:
            x = x.contiguous()
        assert x.shape[1] == weight.in_features, f"x has {x.shape[1]} features"
        assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
        num_rows, out_features = x.shape[0], weight.out_features
        y = torch.empty(num_rows, out_features, dtype=torch.float32)
        code = QUANT_TYPES[weight.ggml_type][0]
        with torch.profiler.record_function("shoal::quant_matmul"):
            rc = self._fn(
                *(y.data_ptr(), out_features, x.data_ptr(), x.stride(0)),
                *(weight.blocks.data_ptr(), weight.blocks.shape[1], code),
                bias.data_ptr() if bias is not None else None,
                *(num_rows, out_features, weight.in_features, torch.get_num_threads()),
            )
        if rc != 0:
            raise RuntimeError(f"quantized matmul kernel failed ({rc}: {_ERRORS.get(rc, '?')})")
        return y


def load_quant_kernel() -> QuantMatmulKernel | None:
    """The kernel, built on first use; None when disabled by SHOAL_DISABLE_CPU_KERNEL=1 or when
    it cannot be built or loaded (logged once per process): the dense weights serve then."""
    if os.environ.get(DISABLE_ENV, "") == "1":
        return None
    return _load_once()


@functools.cache
def _load_once() -> QuantMatmulKernel | None:
    return load_cpu_kernel(QuantMatmulKernel, SOURCE_PATH, "quantized matmul", "dense weights")
