"""GGUF metadata -> `ModelArch`; reads the header only, never tensor data.

Knows llama.cpp's metadata key names (`{arch}.block_count`, ...) for the architectures its
converter writes and the engine serves (`GGUF_ARCHITECTURES`), and what llama.cpp fixes in code
rather than metadata (Gemma 3's local/global pattern and local rope base, gpt-oss's alternating
windows). Tensor conversion lives in `gguf_loader`, tokenizer metadata in `gguf_tokenizer`.
"""

from __future__ import annotations

from typing import Any

from shoal.engine.errors import ModelLoadError
from shoal.engine.loader.gguf_file import GGUFFile, read_gguf
from shoal.engine.model_arch import FULL_ATTENTION, ROPE_TYPES, SLIDING_ATTENTION, ModelArch

# general.architecture -> the HF architecture the engine serves it as.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
# llama.cpp's fixed local/global patterns: layer i slides unless (i + 1) % n == 0.
_SWA_PATTERNS = {"gemma3": 6, "gpt-oss": 2}


class _Meta:
    """One GGUF's metadata under its architecture's prefix."""

    def __init__(self, path: str, meta: dict[str, Any], arch: str) -> None:
        self.path, self.meta, self.arch = path, meta, arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)

    def required(self, key: str) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.meta:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks {full!r}")
        return self.meta[full]


def gguf_arch_name(path: str, header: GGUFFile) -> str:
    """The file's llama.cpp architecture, checked to be one the engine serves.

    Raises:
        ModelLoadError: another architecture.
    """
    arch = header.metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(repr(a) for a in GGUF_ARCHITECTURES)
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported (only {supported})"
        )
    return str(arch)


def model_arch_from_gguf(path: str, gguf_file: GGUFFile | None = None) -> ModelArch:
    """Reads a GGUF file's metadata (not its tensor data).

    Args:
        path: the .gguf file.
        gguf_file: its already-parsed header, if the caller has one.

    Returns:
        The architecture facts; the dtype is float32 because weights are dequantized to it.

    Raises:
        ModelLoadError: unreadable file, an architecture not in GGUF_ARCHITECTURES, or a
            feature the engine's model of it does not implement (llama MoE, rope frequency
            factors, partial rotary embeddings).
    """
    header = gguf_file or read_gguf(path)
    name = gguf_arch_name(path, header)
    meta = _Meta(path, header.metadata, name)
    if name == "llama" and int(meta.get("expert_count", 0)) > 0:
        raise ModelLoadError(f"{path}: mixture-of-experts llama GGUF files are not supported")
    for factors in ("rope_freqs.weight", "rope_factors_long.weight"):
        if factors in header.tensors:
            raise ModelLoadError(f"{path}: rope frequency factors ({factors}) are not supported")
    hidden_size = int(meta.required("embedding_length"))
    num_heads = int(meta.required("attention.head_count"))
    head_dim = int(meta.get("attention.key_length", hidden_size // num_heads))
    rope_dims = int(meta.get("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(
            f"{path}: partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported"
        )
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    vocab_size = meta.get("vocab_size", len(tokens) if tokens else None)
    if vocab_size is None:
        raise ModelLoadError(f"{path}: GGUF metadata gives no vocabulary size")
    eos_ids = [
        header.metadata[k]
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if k in header.metadata
    ]
    return ModelArch(
        architecture=GGUF_ARCHITECTURES[name],
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(meta.required("feed_forward_length")),
        num_hidden_layers=int(meta.required("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(meta.get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta.required("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.required("context_length")),
        tie_word_embeddings="output.weight" not in header.tensors,
        attention_bias="blk.0.attn_q.bias" in header.tensors,
        torch_dtype="float32",
        bos_token_id=header.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids)),
        rope_scaling=_rope_scaling(meta),
        **_arch_fields(meta, header),
    )


def _arch_fields(meta: _Meta, header: GGUFFile) -> dict[str, Any]:
    """What the architecture adds: experts, windows, Gemma 3's scale and local rope base."""
    fields: dict[str, Any] = {}
    if int(meta.get("expert_count", 0)) > 0:
        fields["num_local_experts"] = int(meta.required("expert_count"))
        fields["num_experts_per_tok"] = int(meta.required("expert_used_count"))
        width = meta.get("expert_feed_forward_length")
        if width is not None and meta.arch != "gpt-oss":
            fields["moe_intermediate_size"] = int(width)
        # llama.cpp renormalises Qwen3-MoE's top-k weights whatever the checkpoint said.
        fields["norm_topk_prob"] = bool(meta.get("expert_weights_norm", True))
    window = meta.get("attention.sliding_window")
    if window:
        fields["sliding_window"] = int(window)
        pattern = _SWA_PATTERNS.get(meta.arch)
        if pattern is not None:
            num_layers = int(meta.required("block_count"))
            fields["layer_types"] = tuple(
                FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION
                for i in range(num_layers)
            )
    if meta.arch == "gemma3":
        head_dim = int(meta.get("attention.key_length", 256))
        # llama.cpp's Gemma 3: scores scaled by key_length ** -0.5, except the 27B (62
        # layers), whose query_pre_attn_scalar is hidden / heads; sliding layers use base 1e4.
        scalar = head_dim
        if int(meta.required("block_count")) == 62:
            scalar = int(meta.required("embedding_length")) // int(
                meta.required("attention.head_count")
            )
        fields["attention_scale"] = scalar**-0.5
        fields["rope_local_theta"] = 10000.0
    if meta.arch == "gpt-oss":
        fields["swiglu_limit"] = 7.0  # llama.cpp's, fixed for gpt-oss
    return fields


def _rope_scaling(meta: _Meta) -> dict[str, Any] | None:
    kind = meta.get("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"{meta.path}: rope scaling {kind!r} is not supported")
    scaling: dict[str, Any] = {
        "rope_type": kind,
        "factor": float(meta.required("rope.scaling.factor")),
    }
    original = meta.get("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    if kind == "yarn":
        scaling["truncate"] = False  # llama.cpp's yarn ramp is not truncated
    return scaling
