"""GGUF (llama architecture) tensors -> dequantized float32 weights under transformers names.

Undoes what llama.cpp's converter does to a Hugging Face Llama: renames tensors, quantizes them,
and interleaves the rotary halves of each q / k head. Metadata is read by `gguf_arch` and
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
from shoal.engine.loader.gguf_arch import model_arch_from_gguf
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
}
_LAYER_PATTERN = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_PATTERN = re.compile(r"^(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The transformers state_dict name of a GGUF tensor, or None for one with no counterpart."""
    match = _LAYER_PATTERN.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
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
    return _iter_tensors(header, arch)


def _iter_tensors(header: GGUFFile, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    path = header.path
    for gguf_name, info in header.tensors.items():
        name = hf_tensor_name(gguf_name)
        if name is None:
            raise ModelLoadError(f"{path}: tensor {gguf_name!r} has no Llama counterpart")
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
        if ".attn_q." in gguf_name:
            tensor = unpermute_rotary_rows(tensor, arch.num_attention_heads)
        elif ".attn_k." in gguf_name:
            tensor = unpermute_rotary_rows(tensor, arch.num_key_value_heads)
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
    for gguf_name, info in header.tensors.items():
        name = hf_tensor_name(gguf_name)
        if name is None or len(info.torch_shape) != 2:
            continue
        rows, in_features = info.torch_shape
        if not is_quantizable(info.ggml_type, in_features):
            continue
        raw = np.ascontiguousarray(header.raw_tensor(gguf_name)).reshape(rows, -1)
        blocks = torch.from_numpy(raw.copy()).view(torch.uint8)
        if ".attn_q." in gguf_name:
            blocks = unpermute_rotary_rows(blocks, arch.num_attention_heads)
        elif ".attn_k." in gguf_name:
            blocks = unpermute_rotary_rows(blocks, arch.num_key_value_heads)
        yield name, QuantizedWeight(info.ggml_type, blocks, in_features)


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
