"""Model registry: HF architecture name -> the model class that serves it.

Every class takes `(arch, *, max_position, dtype, device)`, loads HF-named tensors with
`load_weights`, runs `forward(input_ids, positions, attn_metadata)` over a flat token batch and
`compute_logits(hidden)` on the rows that sample.
"""

from __future__ import annotations

from shoal.engine.errors import ModelLoadError
from shoal.engine.model.llama import LlamaForCausalLM, Qwen2ForCausalLM
from shoal.engine.model.mixtral import MixtralForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class for an HF architecture name.

    Raises:
        ModelLoadError: when no model here serves that architecture.
    """
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(MODEL_REGISTRY)
        raise ModelLoadError(
            f"unsupported architecture {architecture!r}; supported: {supported}"
        ) from None


__all__ = [
    "MODEL_REGISTRY",
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "get_model_class",
]
