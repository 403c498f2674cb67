"""The architecture-specific parts of a `config.json`: attention patterns (sliding windows,
interleaved local and global layers), mixture-of-experts routing and latent attention, as
`ModelArch` keyword arguments. `hf_config` reads the parts every architecture shares.

Reads both transformers 4.x and 5.x spellings; refuses (ModelLoadError) a switch the engine's
model for that architecture does not implement, rather than run it wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shoal.engine.errors import ModelLoadError
from shoal.engine.model_arch import FULL_ATTENTION, SLIDING_ATTENTION

Config = dict[str, Any]

# Architectures whose every layer uses `sliding_window` when the config sets one.
_WINDOW_EVERYWHERE = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
# Architectures whose MLP (in every layer, or in the routed layers) is a mixture of experts.
MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV3ForCausalLM",
)


def arch_fields(config: Config, architecture: str, path: Path) -> dict[str, Any]:
    """The `ModelArch` fields particular to `architecture`, from its config.

    Raises:
        ModelLoadError: a switch the engine does not implement for it.
    """
    fields = attention_pattern(config, architecture, path)
    if architecture in MOE_ARCHITECTURES:
        fields.update(_moe_fields(config, architecture, path))
    if architecture == "Gemma3ForCausalLM":
        fields.update(_gemma3_fields(config, path))
    if architecture == "DeepseekV3ForCausalLM":
        fields.update(_mla_fields(config, path))
    quantization = config.get("quantization_config") or {}
    if quantization:
        method = quantization.get("quant_method", "?")
        raise ModelLoadError(
            f"{path}: quantized safetensors ({method}) are not supported; use a float or GGUF "
            "checkpoint"
        )
    if architecture == "GptOssForCausalLM":
        fields["swiglu_limit"] = float(config.get("swiglu_limit", 7.0))
        if float(config.get("swiglu_alpha", 1.702)) != 1.702:
            raise ModelLoadError(f"{path}: swiglu_alpha other than 1.702 is not supported")
    if architecture == "Phi3ForCausalLM":
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        factors = (rope.get("partial_rotary_factor"), config.get("partial_rotary_factor"))
        if any(f is not None and float(f) != 1.0 for f in factors):
            raise ModelLoadError(f"{path}: partial rotary embeddings are not supported")
    return fields


def attention_pattern(config: Config, architecture: str, path: Path) -> dict[str, Any]:
    """`sliding_window` and `layer_types`: which layers slide (None / () when none does)."""
    window = config.get("sliding_window")
    num_layers = int(config["num_hidden_layers"])
    if architecture in _WINDOW_EVERYWHERE or not window:
        return {"sliding_window": int(window) if window else None, "layer_types": ()}
    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = _layer_types_v4(config, architecture, num_layers)
    if len(layer_types) != num_layers or set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ModelLoadError(f"{path}: layer_types {layer_types!r} is not one known type per layer")
    if SLIDING_ATTENTION not in layer_types:
        return {"sliding_window": None, "layer_types": ()}
    return {"sliding_window": int(window), "layer_types": tuple(layer_types)}


def _layer_types_v4(config: Config, architecture: str, num_layers: int) -> list[str]:
    """transformers 4.x configs before `layer_types`: Qwen's switch, Gemma 3's pattern."""
    if architecture == "Gemma3ForCausalLM":
        pattern = int(config.get("sliding_window_pattern") or 6)
        return [
            FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION
            for i in range(num_layers)
        ]
    if architecture == "GptOssForCausalLM":
        return [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)]
    if not config.get("use_sliding_window"):
        return [FULL_ATTENTION] * num_layers
    first = int(config.get("max_window_layers") or 0)
    return [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)]


def _moe_fields(config: Config, architecture: str, path: Path) -> dict[str, Any]:
    def required(key: str, *others: str) -> int:
        for name in (key, *others):
            if config.get(name) is not None:
                return int(config[name])
        raise ModelLoadError(f"{path}: missing required key {key!r}")

    fields: dict[str, Any] = {
        "num_local_experts": required("num_local_experts", "num_experts", "n_routed_experts"),
        "num_experts_per_tok": required("num_experts_per_tok"),
    }
    if architecture == "Qwen3MoeForCausalLM":
        fields["moe_intermediate_size"] = required("moe_intermediate_size")
        fields["norm_topk_prob"] = bool(config.get("norm_topk_prob", False))
        step = int(config.get("decoder_sparse_step") or 1)
        only = set(config.get("mlp_only_layers") or ())
        num_layers = int(config["num_hidden_layers"])
        fields["mlp_only_layers"] = tuple(
            i for i in range(num_layers) if i in only or (i + 1) % step != 0
        )
    if architecture == "DeepseekV3ForCausalLM":
        fields["moe_intermediate_size"] = required("moe_intermediate_size")
        fields["norm_topk_prob"] = bool(config.get("norm_topk_prob", True))
        fields["num_shared_experts"] = int(config.get("n_shared_experts") or 0)
        fields["n_group"] = int(config.get("n_group") or 1)
        fields["topk_group"] = int(config.get("topk_group") or 1)
        fields["routed_scaling_factor"] = float(config.get("routed_scaling_factor", 1.0))
        fields["mlp_only_layers"] = tuple(range(int(config.get("first_k_dense_replace") or 0)))
        if int(config.get("moe_layer_freq") or 1) != 1:
            raise ModelLoadError(f"{path}: moe_layer_freq other than 1 is not supported")
    return fields


def _gemma3_fields(config: Config, path: Path) -> dict[str, Any]:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key) is not None:
            raise ModelLoadError(f"{path}: {key} is not supported")
    if config.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{path}: bidirectional attention is not supported")
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{path}: hidden_activation {act!r} is not supported")
    scalar = float(config.get("query_pre_attn_scalar") or 256)
    parameters = config.get("rope_parameters")
    local = None
    if isinstance(parameters, dict) and isinstance(parameters.get(SLIDING_ATTENTION), dict):
        local = parameters[SLIDING_ATTENTION].get("rope_theta")
    local = local or config.get("rope_local_base_freq") or 10000.0
    return {"attention_scale": scalar**-0.5, "rope_local_theta": float(local)}


def _mla_fields(config: Config, path: Path) -> dict[str, Any]:
    if config.get("attention_bias"):
        raise ModelLoadError(f"{path}: attention_bias is not supported with latent attention")
    q_lora = config.get("q_lora_rank")
    return {
        "q_lora_rank": int(q_lora) if q_lora else None,
        "kv_lora_rank": int(config["kv_lora_rank"]),
        "qk_nope_head_dim": int(config["qk_nope_head_dim"]),
        "qk_rope_head_dim": int(config["qk_rope_head_dim"]),
        "v_head_dim": int(config["v_head_dim"]),
        "rope_interleave": bool(config.get("rope_interleave", True)),
    }
