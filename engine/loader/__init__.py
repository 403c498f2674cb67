"""Checkpoint loading: a Hugging Face directory (config.json + safetensors) or a llama GGUF file.

`load_model_arch` reads only metadata and, like the tokenizer, never imports torch;
`load_weights` streams tensors under transformers names for a model to copy in by name, and
`SafetensorsReader` reads chosen ones (re-staging experts). How a model shards or fuses them is
the model's business.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.engine.errors import ModelLoadError
from shoal.engine.loader.builtin import smollm2_gguf_path
from shoal.engine.loader.gguf_arch import model_arch_from_gguf
from shoal.engine.loader.hf_config import model_arch_from_hf_dir
from shoal.engine.loader.safetensors_loader import (
    LazyTensor,
    SafetensorsReader,
    iter_lazy_safetensors_weights,
    iter_safetensors_weights,
    weight_files,
)
from shoal.engine.model_arch import ModelArch

if TYPE_CHECKING:
    import torch

    from shoal.engine.kernels.quant_matmul import QuantizedWeight

__all__ = [
    "LazyTensor",
    "SafetensorsReader",
    "is_gguf_path",
    "load_blocks",
    "load_lazy_weights",
    "load_model_arch",
    "load_weights",
    "num_weights",
    "smollm2_gguf_path",
]


def is_gguf_path(path: str) -> bool:
    """True for a GGUF file (by extension, or by magic bytes for a file named otherwise)."""
    file = Path(path)
    if not file.is_file():
        return False
    if file.suffix == ".gguf":
        return True
    with file.open("rb") as handle:
        return handle.read(4) == b"GGUF"


def load_model_arch(path: str) -> ModelArch:
    """The architecture of a checkpoint, from its metadata only.

    For a Hugging Face directory it also checks that the weight files are present, so a broken
    checkpoint fails here rather than halfway through loading.

    Args:
        path: a Hugging Face checkpoint directory or a .gguf file.

    Returns:
        The checkpoint's ModelArch.

    Raises:
        ModelLoadError: missing path, missing config.json or weights, unsupported architecture.
    """
    if is_gguf_path(path):
        return model_arch_from_gguf(path)
    model_dir = _checkpoint_dir(path)
    arch = model_arch_from_hf_dir(model_dir)
    weight_files(model_dir)
    return arch


def load_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Streams a checkpoint's tensors as (transformers name, tensor), on the CPU.

    Safetensors tensors keep their stored dtype; GGUF tensors are dequantized to float32. A
    checkpoint with tied embeddings yields no lm_head.weight.

    Names are those the checkpoint stores. For Mixtral that is the per-expert layout, which
    transformers 5.x also writes (its in-memory modules fuse the experts; `save_pretrained`
    splits them back):
        model.layers.{i}.block_sparse_moe.gate.weight            (num_experts, hidden)
        model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight  (intermediate, hidden)  gate
        model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight  (intermediate, hidden)  up
        model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight  (hidden, intermediate)  down
    transformers' in-memory equivalents: mlp.gate.weight, mlp.experts.gate_up_proj
    (num_experts, 2 * intermediate, hidden) = cat(w1, w3) per expert, mlp.experts.down_proj
    (num_experts, hidden, intermediate) = w2 per expert.

    Args:
        path: a Hugging Face checkpoint directory or a .gguf file.

    Returns:
        An iterator; errors in later shards surface while iterating.

    Raises:
        ModelLoadError: missing or corrupt files (naming the file), unsupported GGUF content.
    """
    if is_gguf_path(path):
        # Imported here so that metadata and tokenizer users never pay for importing torch.
        from shoal.engine.loader.gguf_loader import iter_gguf_weights

        return iter_gguf_weights(path)
    model_dir = _checkpoint_dir(path)
    weight_files(model_dir)  # fail before the first tensor, not after some were consumed
    return iter_safetensors_weights(model_dir)


def load_lazy_weights(path: str) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """As `load_weights`, but a safetensors checkpoint's tensors come unread (`LazyTensor`):
    a consumer reads only the block it holds, or nothing. GGUF tensors come dequantized.

    Raises:
        ModelLoadError: as `load_weights`.
    """
    if is_gguf_path(path):
        return load_weights(path)
    model_dir = _checkpoint_dir(path)
    weight_files(model_dir)
    return iter_lazy_safetensors_weights(model_dir)


def num_weights(path: str) -> int:
    """How many tensors the checkpoint stores (what `load_weights` yields at most), from its
    headers only; 0 when they cannot be read (the load itself then says why).

    Args:
        path: a Hugging Face checkpoint directory or a .gguf file.
    """
    try:
        if is_gguf_path(path):
            with open(path, "rb") as handle:  # magic, version, then the tensor count
                return int(struct.unpack("<4sIQ", handle.read(16))[2])
        files, weight_map = weight_files(_checkpoint_dir(path))
        if weight_map is not None:
            return len(weight_map)
        with files[0].open("rb") as handle:  # a little-endian header size, then its JSON
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        return len([name for name in header if name != "__metadata__"])
    except (ModelLoadError, OSError, ValueError, struct.error):
        return 0


def load_blocks(path: str) -> Iterator[tuple[str, QuantizedWeight]] | None:
    """A GGUF checkpoint's quantized projections as blocks (`iter_gguf_blocks`), for the CPU
    kernel that computes decode steps from them; None for other checkpoints.

    Raises:
        ModelLoadError: as `load_weights`.
    """
    if not is_gguf_path(path):
        return None
    from shoal.engine.loader.gguf_loader import iter_gguf_blocks

    return iter_gguf_blocks(path)


def _checkpoint_dir(path: str) -> Path:
    model_dir = Path(path)
    if not model_dir.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if not model_dir.is_dir():
        raise ModelLoadError(f"{path}: not a checkpoint directory or a .gguf file")
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{path}: no config.json in the checkpoint directory")
    return model_dir
