"""Llama-family decoder models over a flat token batch and the paged KV cache: Llama itself, and
the models that differ from it in options (`AttentionOptions`) only — Qwen2 (q/k/v biases),
Qwen3 (q/k norms), Mistral (a sliding window). `LlamaForCausalLM` is also the base the other
architectures (Mixtral, Qwen3-MoE, Gemma 3, Phi-3, gpt-oss, DeepSeek-V3) build on, through its
`_make_attention` / `_make_mlp` / `_make_layer` hooks.

Inputs are one [num_tokens] batch of mixed prefill and decode tokens (no padding); attention
reads the cache through `AttentionMetadata`. Weights arrive under HF state_dict names and are
fused on load (q/k/v into one projection, gate/up into one).

Under tensor parallelism (`shoal.engine.parallel.tensor_parallel`) each worker builds the model
at its own shard's sizes (its query and KV heads, its MLP width, its vocabulary block) and the
weight maps narrow every checkpoint tensor to that shard as it is copied in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.kernels.quant_matmul import QuantizedWeight, QuantMatmulKernel
from shoal.engine.loader import LazyTensor
from shoal.engine.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    PagedAttention,
    select_attention_backend,
)
from shoal.engine.model.layers import (
    MAX_DUAL_LAYOUT_BYTES,
    BlockSlots,
    FeedForward,
    GatedMLP,
    Linear,
    LoRATargets,
    Packable,
    RMSNorm,
    RotaryEmbedding,
    WeightMap,
    assign_blocks,
    empty_param,
    is_worth_packing,
)
from shoal.engine.model.llama_layers import (
    AttentionOptions,
    DecoderLayer,
    LlamaAttention,
    SelfAttention,
)
from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.tensor_parallel import SINGLE, TensorParallel


class LlamaForCausalLM(nn.Module):
    """Llama decoder; subclasses change the attention options, the MLP or the layer.

    Args:
        arch: the checkpoint's architecture facts.
        max_position: positions the rotary table covers (the engine's max_model_len).
        dtype: parameter and activation dtype.
        device: where parameters live.
        attention_backend: the paged attention every layer runs (the model runner's choice);
            default: the device's default backend.
        tensor_parallel: this worker's place in its rank's TP group; default: the whole model.
    """

    # The RMSNorm of the layers and the final norm (Gemma's adds 1 to its weights).
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(
        self,
        arch: ModelArch,
        *,
        max_position: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attention_backend: AttentionBackend[Any] | None = None,
        tensor_parallel: TensorParallel | None = None,
    ):
        super().__init__()
        device = torch.device(device)
        self.arch = arch
        self.tp = tp = tensor_parallel or SINGLE
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        # Vocabulary-parallel: this worker's block of rows, padded rows zero (never looked up).
        self.vocab_rows, padded_vocab = tp.vocab_shard(arch.vocab_size)
        self.embed_tokens = empty_param(padded_vocab, arch.hidden_size, **kw)
        self.embed_tokens.data[self.vocab_rows.size :].zero_()
        self.embed_scale: float | None = None  # multiplies the embeddings (Gemma)
        self.rotaries = self._make_rotaries(arch, max_position or arch.max_position_embeddings, kw)
        if attention_backend is None:
            attention_backend = select_attention_backend(
                None,
                device=device,
                dtype=dtype,
                num_heads=arch.num_attention_heads // tp.size,
                num_kv_heads=tp.kv_head_shard(arch.num_kv_cache_heads).size,
                head_dim=arch.kv_cache_head_dim,
            )
        self.attention_backend = attention_backend
        self.layers = nn.ModuleList(
            self._make_layer(
                arch,
                self._make_attention(arch, i, attention_backend, dtype=dtype, device=device),
                self._make_mlp(arch, i, dtype=dtype, device=device),
                i,
                dtype=dtype,
                device=device,
            )
            for i in range(arch.num_hidden_layers)
        )
        self.norm = self.norm_class(arch.hidden_size, arch.rms_norm_eps, **kw)
        self.lm_head = Linear(arch.hidden_size, padded_vocab, **kw)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens
        else:
            self.lm_head.weight.data[self.vocab_rows.size :].zero_()

    def _make_rotaries(
        self, arch: ModelArch, max_position: int, kw: dict[str, Any]
    ) -> nn.ModuleList:
        """The rope tables: the model's, then the sliding layers' own where their base differs."""
        rotaries = [
            RotaryEmbedding(arch.head_dim, max_position, arch.rope_theta, arch.rope_scaling, **kw)
        ]
        if arch.rope_local_theta is not None:
            rotaries.append(
                RotaryEmbedding(arch.head_dim, max_position, arch.rope_local_theta, None, **kw)
            )
        return nn.ModuleList(rotaries)

    def rope_index(self, layer: int) -> int:
        """Which of `rotaries` layer `layer` rotates with."""
        return 1 if len(self.rotaries) > 1 and self.arch.is_sliding(layer) else 0

    def _attention_options(self, arch: ModelArch, layer: int) -> AttentionOptions:
        """HF Llama's attention_bias covers all four projections; Mistral's window applies."""
        return AttentionOptions(
            qkv_bias=arch.attention_bias,
            o_bias=arch.attention_bias,
            sliding_window=arch.window_of(layer),
        )

    def _make_attention(
        self,
        arch: ModelArch,
        layer: int,
        backend: AttentionBackend[Any],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> SelfAttention:
        options = self._attention_options(arch, layer)
        return LlamaAttention(arch, backend, options, tp=self.tp, dtype=dtype, device=device)

    def _make_mlp(
        self, arch: ModelArch, layer: int, *, dtype: torch.dtype, device: torch.device
    ) -> FeedForward:
        return GatedMLP(
            arch.hidden_size, arch.intermediate_size, tp=self.tp, dtype=dtype, device=device
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
        return DecoderLayer(arch, attn, mlp, norm=self.norm_class, dtype=dtype, device=device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm, for a flat token batch."""
        hidden = self._embed(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        residual: torch.Tensor | None = None
        ropes = [rotary(positions) for rotary in self.rotaries]
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(ropes[self.rope_index(i)], hidden, residual, meta)
        return self.norm(hidden, residual)[0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed_tokens)
        local = input_ids - self.vocab_rows.start
        is_held = (local >= 0) & (local < self.vocab_rows.size)
        hidden = F.embedding(torch.where(is_held, local, 0), self.embed_tokens)
        return self.tp.all_reduce(hidden.masked_fill_(~is_held[:, None], 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] for the given rows of hidden states only (every worker of a TP
        group calls it: the vocabulary blocks are gathered)."""
        logits = self.lm_head(hidden)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last(logits)[:, : self.arch.vocab_size]

    def bind_kv_cache(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Gives each layer its slice of the KV pool ([2, KVH, blocks, block_size, D] each, or
        [1, 1, ...] for latent attention)."""
        assert len(kv_caches) == len(self.layers), "one KV cache per layer"
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            cast(PagedAttention, layer.get_submodule("self_attn.attn")).kv_cache = cache

    def weight_map(self) -> WeightMap:
        wm = WeightMap()
        rows, held = self.vocab_rows, self.vocab_rows.size
        shape = (self.arch.vocab_size, self.arch.hidden_size)
        wm.add("model.embed_tokens.weight", self.embed_tokens[:held], shape=shape, block=(0, rows))
        for i, layer in enumerate(self.layers):
            wm.update(cast(DecoderLayer, layer).weight_map(f"model.layers.{i}"))
        wm.add("model.norm.weight", self.norm.weight)
        if not self.arch.tie_word_embeddings:
            wm.add("lm_head.weight", self.lm_head.weight[:held], shape=shape, block=(0, rows))
        return wm

    def block_slots(self) -> BlockSlots:
        """Where a GGUF checkpoint's blocks can serve (`Linear.use_blocks`): the attention and
        dense MLP projections, and the LM head (the embedding's blocks when tied)."""
        slots: BlockSlots = {}
        if self.tp.size > 1:  # GGUF blocks are whole rows of the full weight: dense shards only
            return slots
        for i, layer in enumerate(self.layers):
            decoder = cast(DecoderLayer, layer)
            slots.update(decoder.self_attn.block_slots(f"model.layers.{i}"))
            slots.update(decoder.mlp.block_slots(f"model.layers.{i}"))
        head = "model.embed_tokens.weight" if self.arch.tie_word_embeddings else "lm_head.weight"
        slots[head] = (self.lm_head, 0, 1)
        return slots

    def lora_targets(self) -> LoRATargets:
        """The projections LoRA adapters may adapt: each layer's attention and dense MLP ones."""
        targets: LoRATargets = {}
        for i, layer in enumerate(self.layers):
            decoder = cast(DecoderLayer, layer)
            targets.update(decoder.self_attn.lora_targets(f"model.layers.{i}"))
            targets.update(decoder.mlp.lora_targets(f"model.layers.{i}"))
        return targets

    def load_blocks(
        self, blocks: Iterable[tuple[str, QuantizedWeight]], kernel: QuantMatmulKernel
    ) -> int:
        """Gives the projections their GGUF blocks for few-row steps (after `load_weights`);
        returns how many took them.

        Raises:
            ModelLoadError: blocks whose shape is not their projection's.
        """
        return assign_blocks(self.block_slots(), blocks, kernel)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]]) -> None:
        """Loads HF-named tensors (any dtype; cast on copy), reading only this worker's shard
        of unread ones.

        Raises:
            ModelLoadError: for an unknown name, a shape mismatch or a missing tensor.
        """
        # A tied checkpoint may still list lm_head.weight (HF's state_dict does): same data.
        skip = {"lm_head.weight"} if self.arch.tie_word_embeddings else set()
        self.weight_map().load(weights, skip=skip)

    def pack_weights(self) -> None:
        """Gives every projection a oneDNN-packed copy of its dense weight (after loading; CPU,
        see `can_pack_weights`). The dense weights stay for steps of few rows while they hold
        at most `MAX_DUAL_LAYOUT_BYTES`, and go otherwise. Further `load_weights` calls are
        not possible afterwards."""
        packable = [m for m in self.modules() if isinstance(m, Packable)]
        weights = [m.weight for m in self.modules() if isinstance(m, Linear)]
        dense_bytes = sum(w.numel() * w.element_size() for w in weights if is_worth_packing(w))
        keep_dense = dense_bytes <= MAX_DUAL_LAYOUT_BYTES
        for module in packable:
            module.pack(keep_dense)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on the q/k/v projections (never on o_proj)."""

    def _attention_options(self, arch: ModelArch, layer: int) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, sliding_window=arch.window_of(layer))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with an RMSNorm over each head of q and k before the rotation."""

    def _attention_options(self, arch: ModelArch, layer: int) -> AttentionOptions:
        return AttentionOptions(
            qkv_bias=arch.attention_bias,
            o_bias=arch.attention_bias,
            qk_norm=RMSNorm,
            sliding_window=arch.window_of(layer),
        )


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama whose every layer attends within the sliding window (when it has one)."""
