"""`ModelArch`: the architecture facts of a checkpoint, as the models and the engine need them.

Discovered by `shoal.engine.loader` from `config.json` or GGUF metadata and held by the engine core;
never a user setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV3ForCausalLM",
)
# What each architecture is served with beyond prefix caching and chunked prefill (which all
# have), as `shoal serve --help` and the README list it. TP needs heads (and widths) the size
# divides; EP needs an MoE model; GGUF names llama.cpp's general.architecture.
ARCHITECTURE_SUPPORT = {
    "LlamaForCausalLM": "TP, GGUF llama",
    "Qwen2ForCausalLM": "TP, GGUF qwen2, sliding layers",
    "Qwen3ForCausalLM": "TP, GGUF qwen3, sliding layers",
    "MistralForCausalLM": "TP, sliding window (KV freed behind it), GGUF as llama",
    "MixtralForCausalLM": "TP, EP",
    "Qwen3MoeForCausalLM": "TP, EP, GGUF qwen3moe",
    "Gemma3ForCausalLM": "TP, GGUF gemma3, local/global layers",
    "Phi3ForCausalLM": "TP, GGUF phi3, sliding window (KV freed behind it)",
    "GptOssForCausalLM": "TP, EP, GGUF gpt-oss, sinks, alternating windows",
    "DeepseekV3ForCausalLM": "TP, EP, latent KV cache",
}
# The rope scaling types the engine computes (`shoal.engine.model.rotary`).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"


def describe_architectures() -> str:
    """One line: every supported architecture and what it is served with."""
    return "; ".join(f"{name} ({ARCHITECTURE_SUPPORT[name]})" for name in SUPPORTED_ARCHITECTURES)


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
    # Attention pattern: a sliding layer's query at position i sees keys (i - sliding_window, i].
    sliding_window: int | None = None
    layer_types: tuple[
        str, ...
    ] = ()  # per layer FULL_ATTENTION or SLIDING_ATTENTION; () = all full
    rope_local_theta: float | None = None  # the sliding layers' own rope base (Gemma 3)
    attention_scale: float | None = None  # the softmax scale when not head_dim ** -0.5
    # Mixture of experts beyond Mixtral's.
    moe_intermediate_size: int = 0  # each expert's width where it differs from intermediate_size
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    mlp_only_layers: tuple[int, ...] = ()  # layers of an MoE model whose MLP is dense
    num_shared_experts: int = 0  # experts every token goes through (DeepSeek-V3)
    n_group: int = 1  # DeepSeek-V3's expert groups, of which topk_group are routed to
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    swiglu_limit: float = 0.0  # gpt-oss's clamp on its experts' gate and up
    # Multi-head latent attention (DeepSeek-V3): the cache holds kv_lora_rank + qk_rope_head_dim.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rotary dims come in (even, odd) pairs (DeepSeek-V3)

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def expert_intermediate_size(self) -> int:
        """Each routed expert's width."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends within the sliding window only."""
        if self.sliding_window is None:
            return False
        if not self.layer_types:
            return True  # Mistral, Phi-3: one window for every layer
        return self.layer_types[layer] == SLIDING_ATTENTION

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer) else None

    @property
    def kv_window(self) -> int | None:
        """The window when every layer slides (so KV older than it is never read again)."""
        if self.sliding_window is None:
            return None
        if all(self.is_sliding(i) for i in range(self.num_hidden_layers)):
            return self.sliding_window
        return None

    @property
    def num_kv_cache_parts(self) -> int:
        """2 (K and V), or 1 for latent attention: its values are read from the latent."""
        return 1 if self.is_mla else 2

    @property
    def num_kv_cache_heads(self) -> int:
        return 1 if self.is_mla else self.num_key_value_heads

    @property
    def kv_cache_head_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of the KV cache for one token across all layers."""
        per_layer = self.num_kv_cache_parts * self.num_kv_cache_heads * self.kv_cache_head_dim
        return self.num_hidden_layers * per_layer * dtype_bytes
