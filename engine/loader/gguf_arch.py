"""GGUF metadata (llama architecture) -> `ModelArch`; reads the header only, never tensor data.

Knows llama.cpp's metadata key names and which llama features the engine's models implement.
Tensor conversion lives in `gguf_loader`, tokenizer metadata in `gguf_tokenizer`.
"""

from __future__ import annotations

from typing import Any

from shoal.engine.errors import ModelLoadError
from shoal.engine.loader.gguf_file import GGUFFile, read_gguf
from shoal.engine.model_arch import ModelArch


def model_arch_from_gguf(path: str, gguf_file: GGUFFile | None = None) -> ModelArch:
    """Reads a llama-architecture GGUF file's metadata (not its tensor data).

    Args:
        path: the .gguf file.
        gguf_file: its already-parsed header, if the caller has one.

    Returns:
        The architecture facts; the dtype is float32 because weights are dequantized to it.

    Raises:
        ModelLoadError: unreadable file, an architecture other than llama, or a feature the
            engine's Llama does not implement (MoE, llama3 rope frequency factors).
    """
    header = gguf_file or read_gguf(path)
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    if int(meta.get("llama.expert_count", 0)) > 0:
        raise ModelLoadError(f"{path}: mixture-of-experts GGUF files are not supported")
    if "rope_freqs.weight" in header.tensors:
        raise ModelLoadError(f"{path}: rope frequency factors (rope_freqs) are not supported")

    def required(key: str) -> Any:
        if key not in meta:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {key!r}")
        return meta[key]

    hidden_size = int(required("llama.embedding_length"))
    num_heads = int(required("llama.attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length", hidden_size // num_heads))
    rope_dims = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(
            f"{path}: partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = meta.get("llama.vocab_size", len(tokens) if tokens else None)
    if vocab_size is None:
        raise ModelLoadError(f"{path}: GGUF metadata gives no vocabulary size")
    eos_ids = [
        meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta
    ]
    return ModelArch(
        architecture="LlamaForCausalLM",
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(required("llama.feed_forward_length")),
        num_hidden_layers=int(required("llama.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(meta.get("llama.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(required("llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(required("llama.context_length")),
        tie_word_embeddings="output.weight" not in header.tensors,
        attention_bias="blk.0.attn_q.bias" in header.tensors,
        torch_dtype="float32",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids)),
        rope_scaling=_rope_scaling(meta),
    )


def _rope_scaling(meta: dict[str, Any]) -> dict[str, Any] | None:
    kind = meta.get("llama.rope.scaling.type", "none")
    if kind == "none":
        return None
    scaling: dict[str, Any] = {
        "rope_type": kind,
        "factor": float(meta["llama.rope.scaling.factor"]),
    }
    if "llama.rope.scaling.original_context_length" in meta:
        original = int(meta["llama.rope.scaling.original_context_length"])
        scaling["original_max_position_embeddings"] = original
    return scaling
