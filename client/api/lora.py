"""LoRA adapters in the Python API: vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`,
which `LLM.generate` and `AsyncLLM.generate` take as `lora_request=` (the engines need
`enable_lora`), and how one adapter, or one per prompt, is spread over the prompts."""

from __future__ import annotations

from collections.abc import Sequence

from shoal.engine.protocol import LoRARequest

__all__ = ["LoRARequest", "broadcast_loras"]


def broadcast_loras(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt.

    Raises:
        ValueError: a list whose length is not the number of prompts.
    """
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"{len(loras)} LoRA requests for {num_prompts} prompts")
    return loras
