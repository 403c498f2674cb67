"""Picks the attention backend once, at start-up: the one asked for by `--attention-backend`
(vLLM's spellings), else the default for the device: the C kernels on CPU, Triton on CUDA, and
the torch reference where neither can serve. A backend asked for by name that cannot serve this
model is an error, never a silent substitute."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch

from shoal.engine.config import ATTENTION_BACKENDS
from shoal.engine.kernels.paged_attention import load_decode_kernel
from shoal.engine.model.attention.backend import AttentionBackend
from shoal.engine.model.attention.cpu_attn import CpuAttnBackend
from shoal.engine.model.attention.torch_sdpa import TorchSDPABackend

logger = logging.getLogger(__name__)

CPU_ATTN, TORCH_SDPA, TRITON_ATTN = ATTENTION_BACKENDS
INTERPRET_ENV = "TRITON_INTERPRET"


def select_attention_backend(
    name: str | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> AttentionBackend[Any]:
    """The backend `name` (None: the device's default) for this model's attention shape.

    Raises:
        ValueError: an unknown name, or a backend that cannot run this device, dtype or shape.
    """
    if name is not None and name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; use one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if name == TORCH_SDPA:
        return TorchSDPABackend()
    if name == TRITON_ATTN or (name is None and device.type == "cuda"):
        try:
            return _triton(device, num_heads, num_kv_heads)
        except ImportError as e:
            if name is not None:
                raise ValueError(f"{TRITON_ATTN} needs the triton package: {e}") from e
            logger.warning("triton is unavailable (%s); attention uses %s", e, TORCH_SDPA)
            return TorchSDPABackend()
    if device.type != "cpu":
        raise ValueError(f"{CPU_ATTN} runs on CPU only, not {device.type}")
    kernel = None
    if CpuAttnBackend.supports(num_heads, num_kv_heads, head_dim, dtype):
        kernel = load_decode_kernel()
    if kernel is not None:
        return CpuAttnBackend(kernel)
    if name == CPU_ATTN:
        raise ValueError(
            f"{CPU_ATTN} cannot serve {num_heads} heads / {num_kv_heads} KV heads of "
            f"{head_dim} dims in {dtype}, or its kernel could not be built (see the log)"
        )
    return TorchSDPABackend()


def _triton(device: torch.device, num_heads: int, num_kv_heads: int) -> AttentionBackend[Any]:
    if device.type == "cpu":
        _enable_interpreter()
    # Imported here: triton is needed only by those who pick it.
    from shoal.engine.model.attention.triton_attn import TritonAttnBackend

    return TritonAttnBackend(num_heads, num_kv_heads)


def _enable_interpreter() -> None:
    """Triton reaches CPU tensors only through its interpreter, which must be chosen before
    triton is first imported: its own helper kernels are made then.

    Switched on here where nothing else could use triton (no CUDA device, triton not yet
    imported); otherwise the user sets TRITON_INTERPRET=1 for the whole process.

    Raises:
        ValueError: the interpreter is off and cannot be switched on for this process alone.
    """
    if os.environ.get(INTERPRET_ENV) == "1":
        return
    if "triton" in sys.modules or torch.cuda.is_available():
        raise ValueError(
            f"{TRITON_ATTN} on CPU runs under Triton's interpreter: start the process with "
            f"{INTERPRET_ENV}=1"
        )
    os.environ[INTERPRET_ENV] = "1"
    logger.info("%s on CPU: Triton's interpreter is on (%s=1)", TRITON_ATTN, INTERPRET_ENV)
