"""GGUF tensors -> dequantized float32 weights under transformers names.

Undoes what llama.cpp's converter does to a Hugging Face checkpoint: renames tensors, quantizes
them, interleaves the rotary halves of each q / k head (llama only), adds 1 to Gemma's norm
weights, and stacks an MoE layer's experts into one tensor per projection (split back here into
the per-expert names a saved checkpoint has). Metadata is read by `gguf_arch` and
`gguf_tokenizer`, not here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from shoal.engine.errors import ModelLoadError
from shoal.engine.kernels.quant_matmul import QuantizedWeight, is_quantizable
from shoal.engine.loader.gguf_arch import gguf_arch_name, model_arch_from_gguf
from shoal.engine.loader.gguf_file import GGUFFile, read_gguf
from shoal.engine.model_arch import ModelArch

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
}
# Where an architecture's converter names a tensor otherwise.
_ARCH_LAYER_NAMES: dict[str, dict[str, str]] = {
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gpt-oss": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.router",
        "attn_sinks": "self_attn.sinks",
    },
}
# Stacked experts [num_experts, rows, columns] -> the per-expert projection names.
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_LAYER_PATTERN = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_PATTERN = re.compile(r"^(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The transformers state_dict name of a GGUF tensor, or None for one with no counterpart.
    Stacked experts map to `model.layers.{i}.mlp.experts.{{}}.{proj}.weight`, a template."""
    match = _LAYER_PATTERN.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
        if part in names:
            if part == "attn_sinks":
                return f"model.layers.{layer}.{names[part]}"  # a bare parameter in HF
            return f"model.layers.{layer}.{names[part]}.{kind}"
        if part in _EXPERT_NAMES and arch == "gpt-oss":
            return f"model.layers.{layer}.mlp.experts.{_EXPERT_NAMES[part]}.{kind}"  # stacked
        if part in _EXPERT_NAMES and kind == "weight":
            return f"model.layers.{layer}.mlp.experts.{{}}.{_EXPERT_NAMES[part]}.weight"
        return None
    match = _GLOBAL_PATTERN.match(gguf_name)
    if match and match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    return None


def iter_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantizes every tensor to float32 and yields it under its transformers name.

    q_proj / k_proj rows are put back in Hugging Face order (llama.cpp interleaves the two
    rotary halves of each head). Tied checkpoints yield no lm_head.weight.

    Raises:
        ModelLoadError: as `model_arch_from_gguf`, or a tensor with no transformers counterpart
            or a quantization type `gguf` cannot dequantize.
    """
    header = read_gguf(path)
    arch = model_arch_from_gguf(path, header)  # validates before the first tensor is read
    tensors = _iter_tensors(header, arch)
    if gguf_arch_name(path, header) == "gpt-oss":
        return fuse_gpt_oss_experts(tensors)
    return tensors


def _iter_tensors(header: GGUFFile, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    path = header.path
    gguf_arch = gguf_arch_name(path, header)
    for gguf_name, info in header.tensors.items():
        name = hf_tensor_name(gguf_name, gguf_arch)
        if name is None:
            raise ModelLoadError(
                f"{path}: tensor {gguf_name!r} has no {arch.architecture} counterpart"
            )
        try:
            values = dequantize(header.raw_tensor(gguf_name), GGMLQuantizationType(info.ggml_type))
        except NotImplementedError as exc:
            raise ModelLoadError(f"{path}: tensor {gguf_name}: {exc}") from exc
        tensor = torch.from_numpy(np.array(values, dtype=np.float32))
        if tensor.shape != info.torch_shape:
            raise ModelLoadError(
                f"{path}: tensor {gguf_name} dequantized to {tuple(tensor.shape)}, "
                f"expected {info.torch_shape}"
            )
        if gguf_arch == "llama" and ".attn_q." in gguf_name:
            tensor = unpermute_rotary_rows(tensor, arch.num_attention_heads)
        elif gguf_arch == "llama" and ".attn_k." in gguf_name:
            tensor = unpermute_rotary_rows(tensor, arch.num_key_value_heads)
        elif gguf_arch == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor - 1.0  # llama.cpp stores Gemma's (1 + w)
        if "{}" in name:  # stacked experts
            for expert, part in enumerate(tensor):
                yield name.format(expert), part
        else:
            yield name, tensor


def iter_gguf_blocks(path: str) -> Iterator[tuple[str, QuantizedWeight]]:
    """The quantized 2-D tensors the CPU kernel computes with, as blocks, under their
    transformers names; q_proj / k_proj rows in Hugging Face order, as `iter_gguf_weights`.
    Tensors of other types (F32, F16, types the kernel lacks) are not yielded.

    Raises:
        ModelLoadError: as `model_arch_from_gguf`.
    """
    header = read_gguf(path)
    arch = model_arch_from_gguf(path, header)
    gguf_arch = gguf_arch_name(path, header)
    for gguf_name, info in header.tensors.items():
        name = hf_tensor_name(gguf_name, gguf_arch)
        if name is None or len(info.torch_shape) != 2:
            continue
        rows, in_features = info.torch_shape
        if not is_quantizable(info.ggml_type, in_features):
            continue
        raw = np.ascontiguousarray(header.raw_tensor(gguf_name)).reshape(rows, -1)
        blocks = torch.from_numpy(raw.copy()).view(torch.uint8)
        if gguf_arch == "llama" and ".attn_q." in gguf_name:
            blocks = unpermute_rotary_rows(blocks, arch.num_attention_heads)
        elif gguf_arch == "llama" and ".attn_k." in gguf_name:
            blocks = unpermute_rotary_rows(blocks, arch.num_key_value_heads)
        yield name, QuantizedWeight(info.ggml_type, blocks, in_features)


def fuse_gpt_oss_experts(
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Puts gpt-oss's experts back as its checkpoints hold them: llama.cpp splits the fused,
    transposed, gate/up-interleaved `gate_up_proj` [E, hidden, 2I] into gate and up stacks
    [E, I, hidden] (biases [E, I]) and transposes `down_proj` [E, I, hidden] to
    [E, hidden, I]. A gate waits here for its up."""
    halves: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        prefix, _, rest = name.partition(".mlp.experts.")
        if not rest:
            yield name, tensor
            continue
        proj, kind = rest.split(".")
        fused = f"{prefix}.mlp.experts"
        if proj == "down_proj":
            yield (
                (f"{fused}.down_proj", tensor.transpose(1, 2).contiguous())
                if kind == "weight"
                else (
                    f"{fused}.down_proj_bias",
                    tensor,
                )
            )
            continue
        halves[f"{proj}.{kind}"] = tensor
        other = halves.pop(f"{'up_proj' if proj == 'gate_proj' else 'gate_proj'}.{kind}", None)
        if other is None:
            continue
        del halves[f"{proj}.{kind}"]
        gate, up = (tensor, other) if proj == "gate_proj" else (other, tensor)
        # Interleave: rows gate0, up0, gate1, up1, ... (dim 1 of [E, I, ...]).
        rows = torch.stack([gate, up], dim=2).flatten(1, 2)
        if kind == "weight":
            yield f"{fused}.gate_up_proj", rows.transpose(1, 2).contiguous()
        else:
            yield f"{fused}.gate_up_proj_bias", rows
    if halves:
        raise ModelLoadError(f"gpt-oss experts without their other half: {sorted(halves)}")


def unpermute_rotary_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation.

    The converter turns each head's rows [first half | second half] (HF's rotate_half layout)
    into interleaved pairs (r0, r_half, r1, r_half+1, ...): it views the rows as
    (heads, 2, head_dim / 2) and swaps the last two axes. Swapping them back restores HF order.
    Works for a weight (rows, in_features) and for a bias (rows,).
    """
    rows = tensor.shape[0]
    head_dim = rows // num_heads
    assert head_dim * num_heads == rows and head_dim % 2 == 0, (rows, num_heads)
    rest = tensor.shape[1:]
    unpermuted = tensor.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2)
    return unpermuted.reshape(tensor.shape).contiguous()
