"""Tiny GGUF files written as llama.cpp's converter writes them, from tiny checkpoints: its tensor
names (the `gguf` package's own name map, for every architecture but llama's hand-kept table),
its metadata keys, its q/k interleaving (llama), Gemma's norm offset, stacked experts, and the
tokenizer as tokenizer.ggml.* metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.factories import CHATML_TEMPLATE, EOS_TOKEN_ID

# The checkpoint's model_type -> llama.cpp's general.architecture.
GGUF_ARCH_OF = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "gpt_oss": "gpt-oss",
}

_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def write_tiny_gguf(
    path_file: str | Path,
    checkpoint_dir: str | Path,
    *,
    qtype: str = "F32",
    architecture: str | None = None,
    tokenizer_pre: str = "gpt2",
) -> str:
    """Converts a tiny checkpoint to GGUF the way llama.cpp's converter does.

    Renames tensors, interleaves the rotary halves of q / k rows (llama), quantizes the
    matrices to `qtype` (norms and stacked experts stay F32), and stores the tokenizer as
    tokenizer.ggml.* metadata.

    Args:
        path_file: the .gguf file to write.
        checkpoint_dir: a `make_tiny_checkpoint` directory of an architecture in GGUF_ARCH_OF.
        qtype: a GGMLQuantizationType name for matrices ("F32", "F16", "Q8_0", "Q4_1", ...).
        architecture: general.architecture to declare; default the checkpoint's (another value
            makes an unsupported file).
        tokenizer_pre: tokenizer.ggml.pre to declare.

    Returns:
        `path_file` as a string.
    """
    import gguf

    checkpoint = Path(checkpoint_dir)
    config = json.loads((checkpoint / "config.json").read_text())
    native = GGUF_ARCH_OF[config["model_type"]]
    writer = gguf.GGUFWriter(str(path_file), architecture or native)
    _add_metadata(writer, config, native)
    _add_gguf_tokenizer(writer, checkpoint, tokenizer_pre)
    quant = gguf.GGMLQuantizationType[qtype]
    for name, data in _gguf_tensors(checkpoint, config, native):
        if data.ndim == 2 and "_exps." not in name:
            writer.add_tensor(name, gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path_file)


def _add_metadata(writer: Any, config: dict[str, Any], arch: str) -> None:
    """The `{arch}.*` keys llama.cpp's converter writes for these checkpoints."""
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    rope = config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)}
    rope = rope.get("full_attention", rope)  # per layer type (Gemma 3): the global layers'
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(head_dim)
    if arch != "llama":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if config.get("sliding_window") and arch in ("gemma3", "phi3", "gpt-oss"):
        writer.add_sliding_window(config["sliding_window"])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        width = config.get("moe_intermediate_size") or config["intermediate_size"]
        writer.add_expert_feed_forward_length(width)
    if rope.get("rope_type", "default") == "yarn":
        writer.add_rope_scaling_type(gguf_rope_type("yarn"))
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def gguf_rope_type(name: str) -> Any:
    import gguf

    return gguf.RopeScalingType(name)


def _gguf_tensors(checkpoint: Path, config: dict[str, Any], arch: str) -> list[tuple[str, Any]]:
    """(GGUF name, float32 array) of every tensor, as llama.cpp's converter names them."""
    import gguf
    from safetensors.torch import load_file

    weights = load_file(str(checkpoint / "model.safetensors"))
    if arch == "llama":
        return [
            (_gguf_name(n), _permuted(n, t.float().numpy(), config)) for n, t in weights.items()
        ]
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    out = []
    if arch == "gpt-oss":
        weights = _split_gpt_oss_experts(weights)
    for name, tensor in _stack_experts(weights).items():
        if name.endswith(".self_attn.sinks"):
            out.append((f"{names.get_name(name)}.weight", tensor.float().numpy()))
            continue
        stem, _, kind = name.rpartition(".")
        mapped = names.get_name(stem)
        assert mapped is not None, f"gguf has no name for {name}"
        data = tensor.float()
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp stores Gemma's (1 + w)
        out.append((f"{mapped}.{kind}", data.numpy()))
    return out


def _stack_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert `mlp.experts.{e}.{proj}.weight` tensors stacked as llama.cpp stacks them
    (named `mlp.experts.{proj}.weight`); the other tensors unchanged."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in weights.items():
        parts = name.split(".")
        if len(parts) > 5 and parts[3:5] == ["mlp", "experts"] and parts[5].isdigit():
            stacked = ".".join(parts[:5] + parts[6:])
            stacks.setdefault(stacked, {})[int(parts[5])] = tensor
        else:
            out[name] = tensor
    for name, by_expert in stacks.items():
        out[name] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def _split_gpt_oss_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """As llama.cpp's converter: gpt-oss's fused, transposed, interleaved gate_up_proj
    [E, hidden, 2I] into gate and up stacks [E, I, hidden] (biases [E, I]), down_proj
    [E, I, hidden] transposed to [E, hidden, I]."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        base, _, proj = name.rpartition(".")
        if proj == "gate_up_proj":
            rows = tensor.transpose(1, 2)
            out[f"{base}.gate_proj.weight"], out[f"{base}.up_proj.weight"] = (
                rows[:, 0::2],
                rows[:, 1::2],
            )
        elif proj == "gate_up_proj_bias":
            out[f"{base}.gate_proj.bias"], out[f"{base}.up_proj.bias"] = (
                tensor[:, 0::2],
                tensor[:, 1::2],
            )
        elif proj == "down_proj":
            out[f"{base}.down_proj.weight"] = tensor.transpose(1, 2)
        elif proj == "down_proj_bias":
            out[f"{base}.down_proj.bias"] = tensor
        else:
            out[name] = tensor
    return out


def _permuted(name: str, data: Any, config: dict[str, Any]) -> Any:
    if ".q_proj." in name:
        return _llama_cpp_permute(data, config["num_attention_heads"])
    if ".k_proj." in name:
        return _llama_cpp_permute(data, config["num_key_value_heads"])
    return data


def _add_gguf_tokenizer(writer: Any, checkpoint: Path, tokenizer_pre: str) -> None:
    spec = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(EOS_TOKEN_ID)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def _llama_cpp_permute(data: Any, num_heads: int) -> Any:
    """llama.cpp's converter: each head's rows [half A | half B] become pairs (a0, b0, a1, ...)."""
    rows = data.shape[0]
    return (
        data.reshape(num_heads, 2, rows // num_heads // 2, *data.shape[1:])
        .swapaxes(1, 2)
        .reshape(data.shape)
    )


def _gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"
