"""`ModelArch`: the architecture facts of a checkpoint, as the models and the engine need them.

Discovered by `shoal.engine.loader` from `config.json` or GGUF metadata and held by the engine core;
never a user setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True)
class ModelArch:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width, or each expert's width for MoE
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    num_local_experts: int = 0  # MoE only
    num_experts_per_tok: int = 0  # MoE only
    torch_dtype: str = "float32"  # the checkpoint's own dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes
