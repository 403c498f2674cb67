"""Tiny PEFT-format LoRA adapters with random non-zero A and B, written as PEFT saves them
(`adapter_model.safetensors` + `adapter_config.json`), and the HF reference with an adapter
merged into the base by hand: W + B·A·alpha/r."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tests.factories import hf_reference

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
ALL_MODULES = ATTENTION_MODULES + MLP_MODULES


def make_lora_adapter(
    path_dir: str | Path,
    base_path: str | Path,
    *,
    target_modules: Sequence[str] = ALL_MODULES,
    rank: int = 4,
    alpha: float = 8.0,
    seed: int = 0,
    scale: float = 0.2,
    layers: Sequence[int] | None = None,
) -> str:
    """Writes an adapter for the base checkpoint at `base_path` (every layer unless `layers`).

    Returns:
        `path_dir` as a string.
    """
    base = hf_reference(base_path)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        short = name.rsplit(".", 1)[-1]
        if short not in target_modules or not isinstance(module, torch.nn.Linear):
            continue
        if layers is not None and int(name.split(".")[2]) not in layers:
            continue
        out_features, in_features = module.weight.shape
        a = torch.randn(rank, in_features, generator=generator) * scale
        b = torch.randn(out_features, rank, generator=generator) * scale
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    directory = Path(path_dir)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    write_adapter_config(directory, r=rank, lora_alpha=alpha, target_modules=list(target_modules))
    return str(directory)


def write_adapter_config(directory: str | Path, **fields: Any) -> None:
    """`adapter_config.json` as PEFT writes it, with `fields` over its defaults."""
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 8,
        "lora_alpha": 8,
        "target_modules": list(ALL_MODULES),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    config.update(fields)
    (Path(directory) / "adapter_config.json").write_text(json.dumps(config))


def merged_reference(base_path: str | Path, adapter_path: str | Path) -> Any:
    """The HF model of `base_path` with the adapter merged into its weights by hand."""
    model = hf_reference(base_path)
    from safetensors.torch import load_file

    config = json.loads((Path(adapter_path) / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    tensors = load_file(str(Path(adapter_path) / "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = tensors[key.replace("lora_A", "lora_B")]
            modules[name].weight += (b @ a) * scaling
    return model
