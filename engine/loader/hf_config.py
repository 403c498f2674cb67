"""`config.json` (transformers 4.x or 5.x style) -> `ModelArch`.

Reads only the JSON files of a Hugging Face checkpoint directory (config.json, and
generation_config.json for extra EOS ids); never the weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shoal.engine.errors import ModelLoadError
from shoal.engine.loader.hf_arch import arch_fields
from shoal.engine.model_arch import (
    FULL_ATTENTION,
    ROPE_TYPES,
    SUPPORTED_ARCHITECTURES,
    ModelArch,
)

_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# The transformers class defaults, used when config.json omits the key.
_DEFAULT_RMS_NORM_EPS = {
    "LlamaForCausalLM": 1e-6,
    "Qwen2ForCausalLM": 1e-6,
    "MixtralForCausalLM": 1e-5,
    "Qwen3ForCausalLM": 1e-6,
    "MistralForCausalLM": 1e-6,
    "Qwen3MoeForCausalLM": 1e-6,
    "Gemma3ForCausalLM": 1e-6,
    "Phi3ForCausalLM": 1e-5,
    "GptOssForCausalLM": 1e-5,
    "DeepseekV3ForCausalLM": 1e-6,
}
_DEFAULT_ROPE_THETA = {
    "LlamaForCausalLM": 10000.0,
    "Qwen2ForCausalLM": 10000.0,
    "MixtralForCausalLM": 1e6,
    "Qwen3ForCausalLM": 10000.0,
    "MistralForCausalLM": 10000.0,
    "Qwen3MoeForCausalLM": 10000.0,
    "Gemma3ForCausalLM": 1e6,
    "Phi3ForCausalLM": 10000.0,
    "GptOssForCausalLM": 150000.0,
    "DeepseekV3ForCausalLM": 10000.0,
}


def read_json(path: Path) -> dict[str, Any]:
    """Reads a JSON object from a checkpoint file.

    Raises:
        ModelLoadError: the file is missing, not JSON, or not an object.
    """
    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def model_arch_from_hf_dir(model_dir: Path) -> ModelArch:
    """Parses `config.json` in a Hugging Face checkpoint directory.

    Args:
        model_dir: the directory holding config.json.

    Returns:
        The checkpoint's architecture facts.

    Raises:
        ModelLoadError: config.json is missing or malformed, or the architecture is unsupported.
    """
    config_path = model_dir / "config.json"
    config = read_json(config_path)
    architecture = _architecture(config, config_path)

    def required(key: str) -> Any:
        value = config.get(key)
        if value is None:
            raise ModelLoadError(f"{config_path}: missing required key {key!r}")
        return value

    _reject_unsupported_features(config, architecture, config_path)
    hidden_size = int(required("hidden_size"))
    num_heads = int(required("num_attention_heads"))
    head_dim = config.get("head_dim") or hidden_size // num_heads
    if architecture == "DeepseekV3ForCausalLM":
        head_dim = required("qk_rope_head_dim")  # the rotary part; see ModelArch's MLA fields
    rope_theta, rope_scaling = _rope(config, architecture)
    if rope_scaling is not None and rope_scaling["rope_type"] not in ROPE_TYPES:
        raise ModelLoadError(
            f"{config_path}: rope_scaling type {rope_scaling['rope_type']!r} is not supported "
            f"(only {', '.join(ROPE_TYPES)})"
        )
    return ModelArch(
        architecture=architecture,
        vocab_size=int(required("vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=int(required("intermediate_size")),
        num_hidden_layers=int(required("num_hidden_layers")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(config.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS[architecture])),
        rope_theta=rope_theta,
        max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Qwen2 always carries q/k/v biases; its config has no switch for them.
        attention_bias=architecture == "Qwen2ForCausalLM" or bool(config.get("attention_bias")),
        torch_dtype=_dtype_name(config.get("dtype") or config.get("torch_dtype")),
        bos_token_id=next(iter(_as_id_tuple(config.get("bos_token_id"))), None),
        eos_token_ids=_eos_token_ids(config, model_dir),
        rope_scaling=rope_scaling,
        **arch_fields(config, architecture, config_path),
    )


def _architecture(config: dict[str, Any], config_path: Path) -> str:
    declared = config.get("architectures") or []
    for name in declared:
        if name in SUPPORTED_ARCHITECTURES:
            return str(name)
    if not declared and config.get("model_type") in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[config["model_type"]]
    found = declared or config.get("model_type")
    raise ModelLoadError(
        f"{config_path}: unsupported architecture {found!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _reject_unsupported_features(config: dict[str, Any], architecture: str, path: Path) -> None:
    """Fails loudly on switches the engine's models do not implement, rather than run wrong."""
    if config.get("mlp_bias"):
        raise ModelLoadError(f"{path}: mlp_bias=true is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: hidden_act {config['hidden_act']!r} is not supported")


def _rope(config: dict[str, Any], architecture: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config style.

    transformers 4.x writes `rope_theta` at the top level and `rope_scaling` as a dict or null;
    5.x writes one `rope_parameters` dict holding rope_theta, rope_type and any scaling keys.
    """
    parameters = config.get("rope_parameters")
    if isinstance(parameters, dict) and isinstance(parameters.get(FULL_ATTENTION), dict):
        parameters = parameters[FULL_ATTENTION]  # per layer type (Gemma 3): the global layers'
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        theta = float(parameters["rope_theta"])
    elif config.get("rope_theta") is not None:
        theta = float(config["rope_theta"])
    else:
        theta = _DEFAULT_ROPE_THETA[architecture]
    scaling = config.get("rope_scaling")
    if not isinstance(scaling, dict) and isinstance(parameters, dict):
        scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        # Older 4.x configs spell the key "type".
        rope_type = scaling.pop("type", None)
        scaling.setdefault("rope_type", rope_type or "default")
        if scaling["rope_type"] == "default":
            return theta, None
        return theta, scaling
    return theta, None


def _dtype_name(value: Any) -> str:
    if value is None:
        return "float32"
    name = str(value).removeprefix("torch.")
    return {"float": "float32", "half": "float16", "bf16": "bfloat16"}.get(name, name)


def _eos_token_ids(config: dict[str, Any], model_dir: Path) -> tuple[int, ...]:
    """EOS ids of config.json, then any extra ones generation_config.json lists (Llama 3 does)."""
    ids = _as_id_tuple(config.get("eos_token_id"))
    generation_path = model_dir / "generation_config.json"
    if generation_path.is_file():
        try:
            extra = _as_id_tuple(read_json(generation_path).get("eos_token_id"))
        except ModelLoadError:
            extra = ()  # generation_config.json is advisory; a broken one must not block loading
        ids += tuple(i for i in extra if i not in ids)
    return ids


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
