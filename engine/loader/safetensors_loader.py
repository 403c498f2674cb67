"""Weights of a Hugging Face checkpoint directory: one model.safetensors or indexed shards.

Finds and validates the weight files, then streams `(name, tensor)` pairs under the names the
checkpoint stores, in its stored dtype. It does not know which model consumes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from shoal.engine.errors import ModelLoadError
from shoal.engine.loader.hf_config import read_json

if TYPE_CHECKING:
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint directory, every one checked to exist.

    Args:
        model_dir: a Hugging Face checkpoint directory.

    Returns:
        (files, weight_map): the files in load order, and the index's name -> file map for a
        sharded checkpoint (None for a single file).

    Raises:
        ModelLoadError: no weights, a malformed index, or a shard the index names is missing.
    """
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path}: has no 'weight_map' entries")
        shard_names = sorted(set(weight_map.values()))
        missing = [name for name in shard_names if not (model_dir / name).is_file()]
        if missing:
            raise ModelLoadError(
                f"{index_path}: shard(s) {', '.join(missing)} listed in the index are missing "
                f"from {model_dir}"
            )
        return [model_dir / name for name in shard_names], weight_map
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single], None
    raise ModelLoadError(
        f"{model_dir}: no weights found (expected {SINGLE_FILE} or {INDEX_FILE}; "
        ".bin / .pt checkpoints are not supported)"
    )


def iter_safetensors_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Streams every tensor of the checkpoint, shard by shard.

    Raises:
        ModelLoadError: a file is corrupt or truncated, or a shard lacks a tensor its index names.
    """
    files, weight_map = weight_files(model_dir)
    for file in files:
        expected = None
        if weight_map is not None:
            expected = {name for name, shard in weight_map.items() if shard == file.name}
        yield from _iter_file(file, expected)


def _iter_file(file: Path, expected: set[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        with safe_open(str(file), framework="pt") as handle:
            names = list(handle.keys())
            if expected is not None and not expected <= set(names):
                absent = sorted(expected - set(names))
                raise ModelLoadError(
                    f"{file}: the index places {', '.join(absent[:5])} here, but the file "
                    "does not hold them"
                )
            for name in names:
                yield name, handle.get_tensor(name)
    except SafetensorError as exc:
        raise ModelLoadError(f"{file}: corrupt or truncated safetensors file ({exc})") from exc
    except OSError as exc:
        raise ModelLoadError(f"{file}: cannot read ({exc})") from exc
