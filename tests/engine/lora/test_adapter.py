"""PEFT adapter folders read and checked against a base's projections: what fits, and each way
one does not, as an `AdapterError` that says why."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shoal.engine.lora.adapter import AdapterError, check_adapter, read_adapter_weights

TARGETS = {"model.layers.0.self_attn.q_proj": (8, 6), "model.layers.0.mlp.down_proj": (6, 10)}
Q = "base_model.model.model.layers.0.self_attn.q_proj"


def _adapter(path: Path, tensors: dict[str, torch.Tensor], **config: object) -> str:
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    fields = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    fields.update(config)
    (path / "adapter_config.json").write_text(json.dumps(fields))
    return str(path)


def _q(rank: int = 2) -> dict[str, torch.Tensor]:
    return {f"{Q}.lora_A.weight": torch.ones(rank, 6), f"{Q}.lora_B.weight": torch.ones(8, rank)}


def test_a_fitting_adapter_gives_its_rank_scaling_and_modules(tmp_path: Path) -> None:
    spec = check_adapter(_adapter(tmp_path / "ok", _q()), TARGETS, max_rank=4)
    assert (spec.rank, spec.scaling, spec.modules) == (2, 2.0, ("model.layers.0.self_attn.q_proj",))
    rs = check_adapter(_adapter(tmp_path / "rs", _q(), use_rslora=True), TARGETS, max_rank=4)
    assert rs.scaling == pytest.approx(4 / math.sqrt(2))
    a, b = read_adapter_weights(str(tmp_path / "ok"))["model.layers.0.self_attn.q_proj"]
    assert a.shape == (2, 6) and b.shape == (8, 2)


@pytest.mark.parametrize(
    ("tensors", "config", "message"),
    [
        (_q(), {"r": 8}, "rank 8, above --max-lora-rank 4"),
        ({f"{Q}.lora_A.weight": torch.ones(2, 6)}, {}, "only one of lora_A / lora_B"),
        ({**_q(), "base_model.model.lm_head.lora_A.weight": torch.ones(2, 6)}, {}, "lm_head"),
        ({f"{Q}.lora_A.weight": torch.ones(2, 5), f"{Q}.lora_B.weight": torch.ones(8, 2)}, {},
         r"needs A \[2, 6\]"),
        ({"base_model.model.x.weight": torch.ones(1)}, {}, "not a LoRA A/B weight"),
        (_q(), {"use_dora": True}, "use_dora=True is not supported"),
        (_q(), {"peft_type": "IA3"}, "is not LORA"),
        (_q(), {"r": "two"}, "r must be a positive integer"),
    ],
)  # fmt: skip
def test_what_does_not_fit_is_an_adapter_error(
    tmp_path: Path, tensors: dict[str, torch.Tensor], config: dict[str, object], message: str
) -> None:
    path = _adapter(tmp_path / "bad", tensors, **config)
    with pytest.raises(AdapterError, match=message):
        check_adapter(path, TARGETS, max_rank=4)


def test_missing_and_unreadable_files_are_adapter_errors(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="is not a directory"):
        check_adapter(str(tmp_path / "none"), TARGETS, max_rank=4)
    path = Path(_adapter(tmp_path / "broken", _q()))
    (path / "adapter_model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(AdapterError, match="is not a safetensors file"):
        check_adapter(str(path), TARGETS, max_rank=4)
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not readable JSON"):
        check_adapter(str(path), TARGETS, max_rank=4)
