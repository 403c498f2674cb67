"""Model registry: HF architecture name -> the model class that serves it.

Every class takes `(arch, *, max_position, dtype, device)`, loads HF-named tensors with
`load_weights`, runs `forward(input_ids, positions, attn_metadata)` over a flat token batch and
`compute_logits(hidden)` on the rows that sample.
"""

from __future__ import annotations

from shoal.engine.errors import ModelLoadError
from shoal.engine.model.deepseek_v3 import DeepseekV3ForCausalLM
from shoal.engine.model.gemma3 import Gemma3ForCausalLM
from shoal.engine.model.gpt_oss import GptOssForCausalLM
from shoal.engine.model.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from shoal.engine.model.mixtral import MixtralForCausalLM, Qwen3MoeForCausalLM
from shoal.engine.model.phi3 import Phi3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
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
