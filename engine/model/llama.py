"""Llama and Qwen2 decoder models over a flat token batch and the paged KV cache.

Inputs are one [num_tokens] batch of mixed prefill and decode tokens (no padding); attention
reads the cache through `AttentionMetadata`. Weights arrive under HF state_dict names and are
fused on load (q/k/v into one projection, gate/up into one). Qwen2 is Llama with q/k/v biases.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.kernels.quant_matmul import QuantizedWeight, QuantMatmulKernel
from shoal.engine.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    PagedAttention,
    select_attention_backend,
)
from shoal.engine.model.layers import (
    BlockSlots,
    FeedForward,
    GatedMLP,
    Linear,
    Packable,
    RMSNorm,
    RopeAngles,
    RotaryEmbedding,
    WeightMap,
    assign_blocks,
    empty_param,
)
from shoal.engine.model_arch import ModelArch


class LlamaAttention(nn.Module):
    """Fused qkv projection, rotary embedding, paged attention and the output projection."""

    def __init__(
        self,
        arch: ModelArch,
        backend: AttentionBackend[Any],
        *,
        qkv_bias: bool,
        o_bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_size = self.q_size + 2 * self.kv_size
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.qkv_proj = Linear(arch.hidden_size, qkv_size, bias=qkv_bias, **kw)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=o_bias, **kw)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, backend)

    def forward(self, rope: RopeAngles, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        num_tokens, qk_size = x.shape[0], self.q_size + self.kv_size
        # q and k sit side by side in qkv: one rotation, in place, covers both.
        qk = rope.rotate_(qkv[:, :qk_size].view(num_tokens, -1, self.head_dim))
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, meta))

    def block_slots(self, layer_prefix: str) -> BlockSlots:
        prefix = f"{layer_prefix}.self_attn"
        slots: BlockSlots = {
            f"{prefix}.{name}_proj.weight": (self.qkv_proj, i, 3) for i, name in enumerate("qkv")
        }
        slots[f"{prefix}.o_proj.weight"] = (self.o_proj, 0, 1)
        return slots

    def weight_map(self, layer_prefix: str) -> WeightMap:
        """HF names under `{layer_prefix}.self_attn`."""
        prefix = f"{layer_prefix}.self_attn"
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        bounds = {"q": (0, q_end), "k": (q_end, k_end), "v": (k_end, k_end + self.kv_size)}
        qkv, o = self.qkv_proj, self.o_proj
        wm = WeightMap()
        for name, (lo, hi) in bounds.items():
            wm.add(f"{prefix}.{name}_proj.weight", qkv.weight[lo:hi])
            if qkv.bias is not None:
                wm.add(f"{prefix}.{name}_proj.bias", qkv.bias[lo:hi])
        wm.add(f"{prefix}.o_proj.weight", o.weight)
        if o.bias is not None:
            wm.add(f"{prefix}.o_proj.bias", o.bias)
        return wm


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)), residual adds fused into norms."""

    def __init__(
        self,
        arch: ModelArch,
        attn: LlamaAttention,
        mlp: FeedForward,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, **kw)

    def forward(
        self,
        rope: RopeAngles,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def weight_map(self, prefix: str) -> WeightMap:
        wm = self.self_attn.weight_map(prefix)
        wm.update(self.mlp.weight_map(prefix))
        wm.add(f"{prefix}.input_layernorm.weight", self.input_layernorm.weight)
        wm.add(f"{prefix}.post_attention_layernorm.weight", self.post_attention_layernorm.weight)
        return wm


class LlamaForCausalLM(nn.Module):
    """Llama decoder; subclasses swap the MLP (Mixtral) or add q/k/v biases (Qwen2).

    Args:
        arch: the checkpoint's architecture facts.
        max_position: positions the rotary table covers (the engine's max_model_len).
        dtype: parameter and activation dtype.
        device: where parameters live.
        attention_backend: the paged attention every layer runs (the model runner's choice);
            default: the device's default backend.
    """

    def __init__(
        self,
        arch: ModelArch,
        *,
        max_position: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attention_backend: AttentionBackend[Any] | None = None,
    ):
        super().__init__()
        device = torch.device(device)
        self.arch = arch
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.embed_tokens = empty_param(arch.vocab_size, arch.hidden_size, **kw)
        self.rotary = RotaryEmbedding(
            arch.head_dim,
            max_position or arch.max_position_embeddings,
            arch.rope_theta,
            arch.rope_scaling,
            **kw,
        )
        if attention_backend is None:
            attention_backend = select_attention_backend(
                None,
                device=device,
                dtype=dtype,
                num_heads=arch.num_attention_heads,
                num_kv_heads=arch.num_key_value_heads,
                head_dim=arch.head_dim,
            )
        self.attention_backend = attention_backend
        qkv_bias, o_bias = self._attention_biases(arch)
        self.layers = nn.ModuleList(
            DecoderLayer(
                arch,
                LlamaAttention(arch, attention_backend, qkv_bias=qkv_bias, o_bias=o_bias, **kw),
                self._make_mlp(arch, dtype=dtype, device=device),
                **kw,
            )
            for _ in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, **kw)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, **kw)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens

    @staticmethod
    def _attention_biases(arch: ModelArch) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias): HF Llama's attention_bias covers all four projections."""
        return arch.attention_bias, arch.attention_bias

    def _make_mlp(
        self, arch: ModelArch, *, dtype: torch.dtype, device: torch.device
    ) -> FeedForward:
        return GatedMLP(arch.hidden_size, arch.intermediate_size, dtype=dtype, device=device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm, for a flat token batch."""
        hidden = F.embedding(input_ids, self.embed_tokens)
        residual: torch.Tensor | None = None
        rope = self.rotary(positions)
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, meta)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] for the given rows of hidden states only."""
        return self.lm_head(hidden)

    def bind_kv_cache(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Gives each layer its slice of the KV pool ([2, KVH, blocks, block_size, D] each)."""
        assert len(kv_caches) == len(self.layers), "one KV cache per layer"
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            cast(DecoderLayer, layer).self_attn.attn.kv_cache = cache

    def weight_map(self) -> WeightMap:
        wm = WeightMap()
        wm.add("model.embed_tokens.weight", self.embed_tokens)
        for i, layer in enumerate(self.layers):
            wm.update(cast(DecoderLayer, layer).weight_map(f"model.layers.{i}"))
        wm.add("model.norm.weight", self.norm.weight)
        if not self.arch.tie_word_embeddings:
            wm.add("lm_head.weight", self.lm_head.weight)
        return wm

    def block_slots(self) -> BlockSlots:
        """Where a GGUF checkpoint's blocks can serve (`Linear.use_blocks`): the attention and
        dense MLP projections, and the LM head (the embedding's blocks when tied)."""
        slots: BlockSlots = {}
        for i, layer in enumerate(self.layers):
            decoder = cast(DecoderLayer, layer)
            slots.update(decoder.self_attn.block_slots(f"model.layers.{i}"))
            slots.update(decoder.mlp.block_slots(f"model.layers.{i}"))
        head = "model.embed_tokens.weight" if self.arch.tie_word_embeddings else "lm_head.weight"
        slots[head] = (self.lm_head, 0, 1)
        return slots

    def load_blocks(
        self, blocks: Iterable[tuple[str, QuantizedWeight]], kernel: QuantMatmulKernel
    ) -> int:
        """Gives the projections their GGUF blocks for few-row steps (after `load_weights`);
        returns how many took them.

        Raises:
            ModelLoadError: blocks whose shape is not their projection's.
        """
        return assign_blocks(self.block_slots(), blocks, kernel)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads HF-named tensors (any dtype; cast on copy).

        Raises:
            ModelLoadError: for an unknown name, a shape mismatch or a missing tensor.
        """
        # A tied checkpoint may still list lm_head.weight (HF's state_dict does): same data.
        skip = {"lm_head.weight"} if self.arch.tie_word_embeddings else set()
        self.weight_map().load(weights, skip=skip)

    def pack_weights(self) -> None:
        """Swaps every projection's dense weight for a oneDNN-packed copy (after loading; CPU,
        see `can_pack_weights`). Further `load_weights` calls are not possible afterwards."""
        for module in self.modules():
            if isinstance(module, Packable):
                module.pack()


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on the q/k/v projections (never on o_proj)."""

    @staticmethod
    def _attention_biases(arch: ModelArch) -> tuple[bool, bool]:
        return True, False
