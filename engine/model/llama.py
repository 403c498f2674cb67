"""Llama and Qwen2 decoder models over a flat token batch and the paged KV cache.

Inputs are one [num_tokens] batch of mixed prefill and decode tokens (no padding); attention
reads the cache through `AttentionMetadata`. Weights arrive under HF state_dict names and are
fused on load (q/k/v into one projection, gate/up into one). Qwen2 is Llama with q/k/v biases.

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
    Packable,
    RMSNorm,
    RopeAngles,
    RotaryEmbedding,
    WeightMap,
    assign_blocks,
    empty_param,
    is_worth_packing,
)
from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.tensor_parallel import SINGLE, Shard, TensorParallel


class LlamaAttention(nn.Module):
    """Fused qkv projection, rotary embedding, paged attention and the output projection.

    Under tensor parallelism qkv is column-parallel (this worker's query heads and KV heads) and
    o_proj row-parallel, summed by an all-reduce; an o_proj bias is added by worker 0 only.
    """

    def __init__(
        self,
        arch: ModelArch,
        backend: AttentionBackend[Any],
        *,
        tp: TensorParallel = SINGLE,
        qkv_bias: bool,
        o_bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.tp = tp
        self.head_dim = arch.head_dim
        self.q_rows = tp.shard(arch.num_attention_heads * self.head_dim)
        kv_heads = tp.kv_head_shard(arch.num_key_value_heads)
        self.kv_rows = Shard(kv_heads.start * self.head_dim, kv_heads.size * self.head_dim)
        self.full_q_size = arch.num_attention_heads * self.head_dim
        self.full_kv_size = arch.num_key_value_heads * self.head_dim
        self.num_heads = arch.num_attention_heads // tp.size
        self.num_kv_heads = kv_heads.size
        self.q_size = self.q_rows.size
        self.kv_size = self.kv_rows.size
        self.has_o_bias = o_bias
        qkv_size = self.q_size + 2 * self.kv_size
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.qkv_proj = Linear(arch.hidden_size, qkv_size, bias=qkv_bias, **kw)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=o_bias and tp.is_driver, **kw)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, backend)

    def forward(self, rope: RopeAngles, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        num_tokens, qk_size = x.shape[0], self.q_size + self.kv_size
        # q and k sit side by side in qkv: one rotation, in place, covers both.
        qk = rope.rotate_(qkv[:, :qk_size].view(num_tokens, -1, self.head_dim))
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.tp.all_reduce(self.o_proj(self.attn(q, k, v, meta)))

    def block_slots(self, layer_prefix: str) -> BlockSlots:
        if self.tp.size > 1:  # GGUF blocks are whole rows of the full weight: dense shards only
            return {}
        prefix = f"{layer_prefix}.self_attn"
        slots: BlockSlots = {
            f"{prefix}.{name}_proj.weight": (self.qkv_proj, i, 3) for i, name in enumerate("qkv")
        }
        slots[f"{prefix}.o_proj.weight"] = (self.o_proj, 0, 1)
        return slots

    def weight_map(self, layer_prefix: str) -> WeightMap:
        """HF names under `{layer_prefix}.self_attn`, each narrowed to this worker's heads."""
        prefix = f"{layer_prefix}.self_attn"
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        q, kv, full_q, full_kv = self.q_rows, self.kv_rows, self.full_q_size, self.full_kv_size
        parts = {
            "q": (0, q_end, q, full_q),
            "k": (q_end, k_end, kv, full_kv),
            "v": (k_end, k_end + self.kv_size, kv, full_kv),
        }
        qkv, o = self.qkv_proj, self.o_proj
        hidden = o.out_features
        wm = WeightMap()
        for name, (lo, hi, rows, full) in parts.items():
            weight = f"{prefix}.{name}_proj.weight"
            wm.add(weight, qkv.weight[lo:hi], shape=(full, hidden), block=(0, rows))
            if qkv.bias is not None:
                wm.add(
                    f"{prefix}.{name}_proj.bias", qkv.bias[lo:hi], shape=(full,), block=(0, rows)
                )
        wm.add(f"{prefix}.o_proj.weight", o.weight, shape=(hidden, full_q), block=(1, q))
        if self.has_o_bias:  # summed once: held by worker 0, accepted and dropped by the others
            wm.add(f"{prefix}.o_proj.bias", o.bias, shape=(hidden,))
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
        tensor_parallel: this worker's place in its rank's TP group; default: the whole model.
    """

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
                num_heads=arch.num_attention_heads // tp.size,
                num_kv_heads=tp.kv_head_shard(arch.num_key_value_heads).size,
                head_dim=arch.head_dim,
            )
        self.attention_backend = attention_backend
        qkv_bias, o_bias = self._attention_biases(arch)
        self.layers = nn.ModuleList(
            DecoderLayer(
                arch,
                LlamaAttention(
                    arch, attention_backend, tp=tp, qkv_bias=qkv_bias, o_bias=o_bias, **kw
                ),
                self._make_mlp(arch, dtype=dtype, device=device),
                **kw,
            )
            for _ in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, **kw)
        self.lm_head = Linear(arch.hidden_size, padded_vocab, **kw)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens
        else:
            self.lm_head.weight.data[self.vocab_rows.size :].zero_()

    @staticmethod
    def _attention_biases(arch: ModelArch) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias): HF Llama's attention_bias covers all four projections."""
        return arch.attention_bias, arch.attention_bias

    def _make_mlp(
        self, arch: ModelArch, *, dtype: torch.dtype, device: torch.device
    ) -> FeedForward:
        return GatedMLP(
            arch.hidden_size, arch.intermediate_size, tp=self.tp, dtype=dtype, device=device
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm, for a flat token batch."""
        hidden = self._embed(input_ids)
        residual: torch.Tensor | None = None
        rope = self.rotary(positions)
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, meta)
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
        """Gives each layer its slice of the KV pool ([2, KVH, blocks, block_size, D] each)."""
        assert len(kv_caches) == len(self.layers), "one KV cache per layer"
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            cast(DecoderLayer, layer).self_attn.attn.kv_cache = cache

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

    @staticmethod
    def _attention_biases(arch: ModelArch) -> tuple[bool, bool]:
        return True, False
