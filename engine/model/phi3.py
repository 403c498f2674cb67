"""Phi-3: the Llama decoder as its checkpoints store it — q/k/v in one `qkv_proj` and gate/up in
one `gate_up_proj` (gate first) — with a sliding window on every layer when the config sets
one. The engine fuses those projections anyway, so the only difference is how a tensor-parallel
worker narrows them: each part of the fused tensor to its own block.

Long-context variants (rope type "longrope") are refused at load.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.engine.model.attention import AttentionBackend
from shoal.engine.model.layers import BlockSlots, FeedForward, GatedMLP, WeightMap
from shoal.engine.model.llama import LlamaForCausalLM
from shoal.engine.model.llama_layers import AttentionOptions, LlamaAttention, SelfAttention
from shoal.engine.model_arch import ModelArch


class FusedQKVAttention(LlamaAttention):
    """`self_attn.qkv_proj.weight` [(H + 2 KVH) * D, hidden] as stored: rows q, then k, then v."""

    def weight_map(self, layer_prefix: str) -> WeightMap:
        prefix = f"{layer_prefix}.self_attn"
        full_q, full_kv, hidden = self.full_q_size, self.full_kv_size, self.o_proj.out_features
        q_rows, kv_rows = self.q_rows, self.kv_rows

        def narrow(t: torch.Tensor) -> torch.Tensor:
            k, v = t[full_q : full_q + full_kv], t[full_q + full_kv :]
            return torch.cat([q_rows.narrow(t[:full_q]), kv_rows.narrow(k), kv_rows.narrow(v)])

        wm = WeightMap()
        shape = (full_q + 2 * full_kv, hidden)
        wm.add(f"{prefix}.qkv_proj.weight", self.qkv_proj.weight, shape=shape, select=narrow)
        self._add_common(wm, prefix)
        return wm

    def block_slots(self, layer_prefix: str) -> BlockSlots:
        if self.tp.size > 1:
            return {}
        prefix = f"{layer_prefix}.self_attn"
        return {
            f"{prefix}.qkv_proj.weight": (self.qkv_proj, 0, 1),
            f"{prefix}.o_proj.weight": (self.o_proj, 0, 1),
        }


class FusedGatedMLP(GatedMLP):
    """`mlp.gate_up_proj.weight` [2I, hidden] as stored: gate rows, then up rows."""

    def weight_map(self, layer_prefix: str) -> WeightMap:
        prefix = f"{layer_prefix}.{self.module_name}"
        hidden, full = self.down_proj.out_features, self.full_intermediate_size
        shard = self.width_shard

        def narrow(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([shard.narrow(t[:full]), shard.narrow(t[full:])])

        wm = WeightMap()
        wm.add(
            f"{prefix}.gate_up_proj.weight",
            self.gate_up_proj.weight,
            shape=(2 * full, hidden),
            select=narrow,
        )
        down = self.down_proj.weight
        wm.add(f"{prefix}.down_proj.weight", down, shape=(hidden, full), block=(1, shard))
        return wm

    def block_slots(self, layer_prefix: str) -> BlockSlots:
        if self.tp.size > 1:
            return {}
        prefix = f"{layer_prefix}.{self.module_name}"
        return {
            f"{prefix}.gate_up_proj.weight": (self.gate_up_proj, 0, 1),
            f"{prefix}.down_proj.weight": (self.down_proj, 0, 1),
        }


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 (mini, medium): Llama with fused qkv and gate/up tensors in the checkpoint."""

    def _make_attention(
        self,
        arch: ModelArch,
        layer: int,
        backend: AttentionBackend[Any],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> SelfAttention:
        options = AttentionOptions(sliding_window=arch.window_of(layer))
        return FusedQKVAttention(arch, backend, options, tp=self.tp, dtype=dtype, device=device)

    def _make_mlp(
        self, arch: ModelArch, layer: int, *, dtype: torch.dtype, device: torch.device
    ) -> FeedForward:
        return FusedGatedMLP(
            arch.hidden_size, arch.intermediate_size, tp=self.tp, dtype=dtype, device=device
        )
