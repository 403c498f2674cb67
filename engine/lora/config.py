"""`LoRAConfig`: whether an engine serves LoRA adapters, and how many and how large (vLLM's
`--enable-lora`, `--max-loras`, `--max-lora-rank`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRAConfig:
    """The engine's LoRA limits; the adapters themselves arrive with the requests."""

    enable_lora: bool = field(
        default=False,
        metadata={"help": "serve LoRA adapters (PEFT folders) on the base model's projections"},
    )
    max_loras: int = field(
        default=1,
        metadata={"help": "adapters live at once on a rank: the most distinct ones in a step"},
    )
    max_lora_rank: int = field(
        default=16, metadata={"help": "the largest adapter rank r served; larger ones are refused"}
    )
    max_cpu_loras: int | None = field(
        default=None,
        metadata={
            "help": "adapters kept in CPU memory per rank (the live ones included), least "
            "recently used out; one that returns to a slot from there is not read from disk "
            "again; default: max_loras"
        },
    )

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})"
            )
