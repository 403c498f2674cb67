"""Gemma 3 (text): the Llama decoder with Gemma's differences — embeddings scaled by
sqrt(hidden), RMSNorms that scale by (1 + w), "sandwich" norms (after attention and after the
MLP as well as before each), q/k norms, a GELU-gated MLP, the softmax scaled by
query_pre_attn_scalar ** -0.5, and interleaved layers: sliding ones with their own rope base
(`rope_local_theta`), global ones with the model's (and its rope scaling).

The global layers read every position, so Gemma 3's KV blocks stay while a request lives (the
window frees blocks only when every layer slides). No attention or final logit soft-capping:
Gemma 3 has none, and a config that asks for it is refused at load.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.engine.model.attention import AttentionMetadata
from shoal.engine.model.layers import (
    FeedForward,
    GatedMLP,
    GemmaRMSNorm,
    RopeAngles,
    WeightMap,
    gelu_tanh_and_mul,
)
from shoal.engine.model.llama import LlamaForCausalLM
from shoal.engine.model.llama_layers import AttentionOptions, DecoderLayer, SelfAttention
from shoal.engine.model_arch import ModelArch


class SandwichDecoderLayer(DecoderLayer):
    """x + post_attn_norm(attn(norm(x))), then + post_mlp_norm(mlp(pre_mlp_norm(.))); the
    residual adds fused into the pre-norms as in `DecoderLayer`."""

    def __init__(
        self,
        arch: ModelArch,
        attn: SelfAttention,
        mlp: FeedForward,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__(arch, attn, mlp, norm=GemmaRMSNorm, dtype=dtype, device=device)
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.pre_feedforward_layernorm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, **kw)
        self.post_feedforward_layernorm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, **kw)

    def forward(
        self,
        rope: RopeAngles,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(rope, hidden, meta))[0]
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.post_feedforward_layernorm(self.mlp(hidden))[0]
        return hidden, residual

    def weight_map(self, prefix: str) -> WeightMap:
        wm = super().weight_map(prefix)
        wm.add(f"{prefix}.pre_feedforward_layernorm.weight", self.pre_feedforward_layernorm.weight)
        wm.add(
            f"{prefix}.post_feedforward_layernorm.weight", self.post_feedforward_layernorm.weight
        )
        return wm


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text decoder (`Gemma3ForCausalLM`, model_type gemma3_text)."""

    norm_class = GemmaRMSNorm

    def __init__(self, arch: ModelArch, **kwargs: Any):
        super().__init__(arch, **kwargs)
        self.embed_scale = arch.hidden_size**0.5

    def _attention_options(self, arch: ModelArch, layer: int) -> AttentionOptions:
        return AttentionOptions(
            qkv_bias=arch.attention_bias,
            o_bias=arch.attention_bias,
            qk_norm=GemmaRMSNorm,
            sliding_window=arch.window_of(layer),
            scale=arch.attention_scale,
        )

    def _make_mlp(
        self, arch: ModelArch, layer: int, *, dtype: torch.dtype, device: torch.device
    ) -> FeedForward:
        return GatedMLP(
            arch.hidden_size,
            arch.intermediate_size,
            tp=self.tp,
            activation=gelu_tanh_and_mul,
            dtype=dtype,
            device=device,
        )

    def _make_layer(
        self,
        arch: ModelArch,
        attn: SelfAttention,
        mlp: FeedForward,
        layer: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> DecoderLayer:
        return SandwichDecoderLayer(arch, attn, mlp, dtype=dtype, device=device)
