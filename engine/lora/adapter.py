"""PEFT LoRA adapter folders: `adapter_config.json` (r, lora_alpha, target_modules) beside
`adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r] per adapted projection).

`check_adapter` reads the config and the safetensors header only (no tensor data, no torch) and
says, as an `AdapterError`, why an adapter cannot serve on a base: a missing or malformed file,
a rank over the engine's limit, a module the base cannot adapt, a shape that is not the
module's, a PEFT option shoal does not run. `read_adapter_weights` then reads the tensors.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": 0, ".lora_B.weight": 1}
# PEFT options that change the math: refused unless they hold these (default) values.
_PLAIN_OPTIONS: dict[str, Any] = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}


class AdapterError(ValueError):
    """An adapter cannot be served on this base; the request (or launch) that named it fails,
    nothing else."""


@dataclass(frozen=True)
class AdapterSpec:
    """What an adapter folder holds, checked against a base.

    Attributes:
        rank: r, the inner width of every A/B pair.
        scaling: what B·A is multiplied by (lora_alpha / r, or / sqrt(r) under rsLoRA).
        modules: the adapted projections, as the base's module names
            ("model.layers.0.self_attn.q_proj").
    """

    rank: int
    scaling: float
    modules: tuple[str, ...]


def check_adapter(path: str, targets: Mapping[str, tuple[int, int]], max_rank: int) -> AdapterSpec:
    """Reads an adapter folder's config and tensor header and checks it fits the base.

    Args:
        path: the PEFT folder.
        targets: the base's adaptable projections: module name → (out, in) features.
        max_rank: the engine's `max_lora_rank`.

    Raises:
        AdapterError: saying what does not fit.
    """
    spec, shapes = _inspect(path, max_rank)
    rank = spec.rank
    for module, (a_shape, b_shape) in shapes.items():
        if module not in targets:
            raise AdapterError(
                f"the adapter at {path!r} adapts {module!r}, which the base model cannot adapt "
                "(LoRA applies to the attention and dense MLP projections)"
            )
        out_features, in_features = targets[module]
        if a_shape != [rank, in_features] or b_shape != [out_features, rank]:
            raise AdapterError(
                f"the adapter at {path!r} has {module} A {a_shape} and B {b_shape}; the base "
                f"needs A [{rank}, {in_features}] and B [{out_features}, {rank}]"
            )
    return spec


def inspect_adapter(path: str, max_rank: int) -> AdapterSpec:
    """Checks an adapter folder on its own, without a base: its files, options and rank
    (what a front end can check at launch; `check_adapter` also checks the modules).

    Raises:
        AdapterError: saying what is wrong.
    """
    return _inspect(path, max_rank)[0]


def _inspect(
    path: str, max_rank: int
) -> tuple[AdapterSpec, dict[str, tuple[list[int], list[int]]]]:
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"LoRA adapter path {path!r} is not a directory")
    config = _read_config(folder / CONFIG_FILE)
    rank, scaling = _rank_and_scaling(config)
    if rank > max_rank:
        raise AdapterError(
            f"the adapter at {path!r} has rank {rank}, above --max-lora-rank {max_rank}"
        )
    shapes = _pairs(_read_header(folder / WEIGHTS_FILE))
    return AdapterSpec(rank, scaling, tuple(sorted(shapes))), shapes


def read_adapter_weights(path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter's (A [r, in], B [out, r]) per module name (after `check_adapter`)."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    pairs: dict[str, list[Any]] = {}
    for key, tensor in tensors.items():
        module, which = _split_key(key)
        pairs.setdefault(module, [None, None])[which] = tensor
    return {module: (a, b) for module, (a, b) in pairs.items()}


def _read_config(file: Path) -> dict[str, Any]:
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{file} is missing") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"{file} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{file}: peft_type {peft_type!r} is not LORA")
    for key, plain in _PLAIN_OPTIONS.items():
        value = config.get(key, plain)
        if value != plain and not (plain is None and not value):
            raise AdapterError(f"{file}: {key}={value!r} is not supported")
    return config


def _rank_and_scaling(config: dict[str, Any]) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter_config.json: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"adapter_config.json: lora_alpha must be a number, got {alpha!r}")
    divisor = math.sqrt(rank) if config.get("use_rslora") else rank
    return rank, float(alpha) / divisor


def _read_header(file: Path) -> dict[str, Any]:
    """The safetensors header: tensor name → {"shape", "dtype", "data_offsets"}."""
    try:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise AdapterError(f"{file}: a header of {size} bytes is not a safetensors file")
            header = json.loads(f.read(size))
    except FileNotFoundError:
        raise AdapterError(f"{file} is missing") from None
    except (OSError, ValueError, struct.error) as e:
        raise AdapterError(f"{file} is not a safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{file} is not a safetensors file")
    header.pop("__metadata__", None)
    return header


def _pairs(header: dict[str, Any]) -> dict[str, tuple[list[int], list[int]]]:
    """Module name → (A shape, B shape); every module needs both."""
    shapes: dict[str, list[Any]] = {}
    for key, info in header.items():
        module, which = _split_key(key)
        shapes.setdefault(module, [None, None])[which] = list(info.get("shape", []))
    if not shapes:
        raise AdapterError("the adapter holds no LoRA tensors")
    for module, (a, b) in shapes.items():
        if a is None or b is None:
            raise AdapterError(f"the adapter has only one of lora_A / lora_B for {module!r}")
    return {module: (a, b) for module, (a, b) in shapes.items()}


def _split_key(key: str) -> tuple[str, int]:
    """`base_model.model.<module>.lora_A.weight` → (module, 0); B → 1."""
    for suffix, which in _SUFFIXES.items():
        if key.startswith(_PREFIX) and key.endswith(suffix):
            return key[len(_PREFIX) : -len(suffix)], which
    raise AdapterError(f"tensor {key!r} is not a LoRA A/B weight shoal can serve")
