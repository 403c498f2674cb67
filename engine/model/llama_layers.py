"""The Llama-family decoder layer and its attention: a fused qkv projection, optional q/k norms
(Qwen3, Gemma 3), rotary embedding, paged attention (optionally windowed, with sinks) and the
output projection; a pre-norm block around it and the MLP.

`AttentionOptions` says how one layer's attention differs from Llama's, so the models of the
family (Qwen2/3, Mistral, Gemma 3, Phi-3, gpt-oss) differ in options, not in code paths. Under
tensor parallelism qkv is column-parallel (this worker's query and KV heads) and o_proj
row-parallel, summed by an all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shoal.engine.model.attention import AttentionBackend, AttentionMetadata, PagedAttention
from shoal.engine.model.layers import (
    BlockSlots,
    FeedForward,
    Linear,
    LoRATarget,
    LoRATargets,
    RMSNorm,
    RopeAngles,
    WeightMap,
    empty_param,
)
from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.tensor_parallel import SINGLE, Shard, TensorParallel


@dataclass(frozen=True)
class AttentionOptions:
    """How one layer's attention differs from Llama's.

    Attributes:
        qkv_bias, o_bias: the projections carry biases.
        qk_norm: the RMSNorm class applied over head_dim to q and k before the rotation
            (`q_norm` / `k_norm` weights), or None.
        sliding_window: this layer's window, or None.
        sinks: the layer has per-head sink logits (`sinks`, gpt-oss).
        scale: the softmax scale; None: head_dim ** -0.5.
    """

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: type[RMSNorm] | None = None
    sliding_window: int | None = None
    sinks: bool = False
    scale: float | None = None


class SelfAttention(nn.Module):
    """A decoder layer's attention: (rope angles, hidden, metadata) -> hidden, its HF names and
    the projections GGUF blocks can serve. Holds its `PagedAttention` as `attn`."""

    attn: PagedAttention

    def forward(self, rope: RopeAngles, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError

    def weight_map(self, layer_prefix: str) -> WeightMap:
        raise NotImplementedError

    def block_slots(self, layer_prefix: str) -> BlockSlots:
        return {}

    def lora_targets(self, layer_prefix: str) -> LoRATargets:
        """The projections a LoRA adapter may adapt (none unless the attention says)."""
        return {}


class LlamaAttention(SelfAttention):
    """Fused qkv projection, rotary embedding, paged attention and the output projection.

    Under tensor parallelism qkv is column-parallel (this worker's query heads and KV heads) and
    o_proj row-parallel, summed by an all-reduce; an o_proj bias is added by worker 0 only.
    """

    def __init__(
        self,
        arch: ModelArch,
        backend: AttentionBackend[Any],
        options: AttentionOptions,
        *,
        tp: TensorParallel = SINGLE,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.tp = tp
        self.options = options
        self.head_dim = arch.head_dim
        self.q_rows = tp.shard(arch.num_attention_heads * self.head_dim)
        self.head_shard = tp.shard(arch.num_attention_heads)
        kv_heads = tp.kv_head_shard(arch.num_key_value_heads)
        self.kv_rows = Shard(kv_heads.start * self.head_dim, kv_heads.size * self.head_dim)
        self.full_q_size = arch.num_attention_heads * self.head_dim
        self.full_kv_size = arch.num_key_value_heads * self.head_dim
        self.num_heads = arch.num_attention_heads // tp.size
        self.num_kv_heads = kv_heads.size
        self.q_size = self.q_rows.size
        self.kv_size = self.kv_rows.size
        self.has_o_bias = options.o_bias
        qkv_size = self.q_size + 2 * self.kv_size
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.qkv_proj = Linear(arch.hidden_size, qkv_size, bias=options.qkv_bias, **kw)
        self.o_proj = Linear(
            self.q_size, arch.hidden_size, bias=options.o_bias and tp.is_driver, **kw
        )
        self.q_norm = self.k_norm = None
        if options.qk_norm is not None:
            self.q_norm = options.qk_norm(self.head_dim, arch.rms_norm_eps, **kw)
            self.k_norm = options.qk_norm(self.head_dim, arch.rms_norm_eps, **kw)
        # Sink logits stay float32 whatever the model's dtype: the kernels read them so.
        self.sinks = (
            empty_param(self.num_heads, dtype=torch.float32, device=device)
            if options.sinks
            else None
        )
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            backend,
            scale=options.scale,
            sliding_window=options.sliding_window,
            sinks=self.sinks,
        )

    def forward(self, rope: RopeAngles, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        num_tokens, qk_size = x.shape[0], self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is None or self.k_norm is None:
            # q and k sit side by side in qkv: one rotation, in place, covers both.
            qk = rope.rotate_(qkv[:, :qk_size].view(num_tokens, -1, self.head_dim))
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : qk_size].view(num_tokens, self.num_kv_heads, self.head_dim)
            q, k = rope.rotate(self.q_norm(q)[0]), rope.rotate(self.k_norm(k)[0])
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

    def lora_targets(self, layer_prefix: str) -> LoRATargets:
        """q/k/v: column-parallel parts of qkv_proj; o_proj: row-parallel over the heads."""
        prefix, hidden = f"{layer_prefix}.self_attn", self.o_proj.out_features
        q, kv, full_q, full_kv = self.q_rows, self.kv_rows, self.full_q_size, self.full_kv_size
        qkv, q_size, kv_size = self.qkv_proj, self.q_size, self.kv_size
        return {
            f"{prefix}.q_proj": LoRATarget(qkv, 0, 3, 0, q, None, (full_q, hidden)),
            f"{prefix}.k_proj": LoRATarget(qkv, 1, 3, q_size, kv, None, (full_kv, hidden)),
            f"{prefix}.v_proj": LoRATarget(
                qkv, 2, 3, q_size + kv_size, kv, None, (full_kv, hidden)
            ),
            f"{prefix}.o_proj": LoRATarget(
                self.o_proj, 0, 1, 0, Shard(0, hidden), q, (hidden, full_q)
            ),
        }

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
        qkv = self.qkv_proj
        hidden = self.o_proj.out_features
        wm = WeightMap()
        for name, (lo, hi, rows, full) in parts.items():
            weight = f"{prefix}.{name}_proj.weight"
            wm.add(weight, qkv.weight[lo:hi], shape=(full, hidden), block=(0, rows))
            if qkv.bias is not None:
                wm.add(
                    f"{prefix}.{name}_proj.bias", qkv.bias[lo:hi], shape=(full,), block=(0, rows)
                )
        self._add_common(wm, prefix)
        return wm

    def _add_common(self, wm: WeightMap, prefix: str) -> None:
        """o_proj, the q/k norms and the sinks: the tensors every spelling of qkv shares."""
        o, hidden = self.o_proj, self.o_proj.out_features
        wm.add(
            f"{prefix}.o_proj.weight",
            o.weight,
            shape=(hidden, self.full_q_size),
            block=(1, self.q_rows),
        )
        if self.has_o_bias:  # summed once: held by worker 0, accepted and dropped by the others
            wm.add(f"{prefix}.o_proj.bias", o.bias, shape=(hidden,))
        if self.q_norm is not None and self.k_norm is not None:
            wm.add(f"{prefix}.q_norm.weight", self.q_norm.weight)
            wm.add(f"{prefix}.k_norm.weight", self.k_norm.weight)
        if self.sinks is not None:
            full = (self.head_shard.size * self.tp.size,)
            wm.add(f"{prefix}.sinks", self.sinks, shape=full, block=(0, self.head_shard))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)), residual adds fused into norms."""

    def __init__(
        self,
        arch: ModelArch,
        attn: SelfAttention,
        mlp: FeedForward,
        *,
        norm: type[RMSNorm] = RMSNorm,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.input_layernorm = norm(arch.hidden_size, arch.rms_norm_eps, **kw)
        self.post_attention_layernorm = norm(arch.hidden_size, arch.rms_norm_eps, **kw)

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
