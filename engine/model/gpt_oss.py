"""gpt-oss: a mixture-of-experts decoder whose layers alternate between a sliding window and
full attention, each head with a learnt sink logit (an extra softmax term that takes a share of
the attention and gives nothing back), biases on every projection, a top-k-then-softmax router,
and experts whose gated activation is clamped: (clamp(up, ±limit) + 1) * g * sigmoid(1.702 g),
g = min(gate, limit).

Checkpoints hold the experts fused and transposed, gate and up interleaved:
`mlp.experts.gate_up_proj` [E, hidden, 2I] (columns gate0, up0, gate1, ...), its bias [E, 2I],
`down_proj` [E, I, hidden] and its bias; they are de-interleaved into the engine's layout at
load. MXFP4-quantized checkpoints (`*_blocks` / `*_scales`) are refused: dequantize first.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.engine.loader import SafetensorsReader
from shoal.engine.model.experts import FUSED_EXPERTS, RoutedExperts, checked
from shoal.engine.model.layers import WeightMap
from shoal.engine.model.llama_layers import AttentionOptions
from shoal.engine.model.mixtral import MoEForCausalLM
from shoal.engine.model.moe import SparseMoE, TopKSoftmaxRouter, expert_kwargs
from shoal.engine.model_arch import ModelArch

SWIGLU_ALPHA = 1.702


def clamped_swiglu(limit: float) -> Any:
    """gpt-oss's gated activation over [gate | up] (gate first, as the engine stores it)."""

    def activation(gate_up: torch.Tensor, size: int) -> torch.Tensor:
        gate = gate_up[..., :size].clamp(max=limit)
        up = gate_up[..., size:].clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))

    return activation


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I, X] with rows gate0, up0, gate1, ... -> rows gate0..gateI-1, up0..upI-1."""
    return torch.cat([t[..., 0::2, :], t[..., 1::2, :]], dim=-2)


class GptOssExperts(RoutedExperts):
    """`RoutedExperts` with biases, loaded from gpt-oss's fused, interleaved tensors."""

    def weight_map(self, prefix: str) -> WeightMap:
        size, hidden, shard = self.full_intermediate_size, self.hidden_size, self.width_shard
        held = torch.tensor(self.expert_ids)
        fused, num = f"{prefix}.{FUSED_EXPERTS}", self.num_experts

        def gate_up(t: torch.Tensor) -> torch.Tensor:  # [E, H, 2I] -> held [n, 2 * shard, H]
            rows = deinterleave(t.index_select(0, held.to(t.device)).transpose(1, 2))
            return torch.cat([shard.narrow(rows[:, :size], 1), shard.narrow(rows[:, size:], 1)], 1)

        def gate_up_bias(t: torch.Tensor) -> torch.Tensor:  # [E, 2I] -> [n, 2 * shard]
            return gate_up(t.unsqueeze(1)).squeeze(2)

        def down(t: torch.Tensor) -> torch.Tensor:  # [E, I, H] -> held [n, H, shard]
            return shard.narrow(t.index_select(0, held.to(t.device)).transpose(1, 2), 2)

        def held_rows(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, held.to(t.device))

        assert self.w13_bias is not None and self.w2_bias is not None
        wm = WeightMap()
        wm.add(f"{fused}.gate_up_proj", self.w13, shape=(num, hidden, 2 * size), select=gate_up)
        wm.add(f"{fused}.down_proj", self.w2, shape=(num, size, hidden), select=down)
        wm.add(
            f"{fused}.gate_up_proj_bias",
            self.w13_bias,
            shape=(num, 2 * size),
            select=gate_up_bias,
        )
        wm.add(f"{fused}.down_proj_bias", self.w2_bias, shape=(num, hidden), select=held_rows)
        return wm

    def read_expert(
        self, expert: int, prefix: str, reader: SafetensorsReader
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size, hidden, fused = (
            self.full_intermediate_size,
            self.hidden_size,
            f"{prefix}.{FUSED_EXPERTS}",
        )
        gate_up = deinterleave(
            checked(reader, f"{fused}.gate_up_proj", (hidden, 2 * size), expert).T
        )
        down = checked(reader, f"{fused}.down_proj", (size, hidden), expert).T
        return self._shard_pair(gate_up[:size], gate_up[size:], down)

    def read_expert_biases(
        self, expert: int, prefix: str, reader: SafetensorsReader
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size, hidden, fused = (
            self.full_intermediate_size,
            self.hidden_size,
            f"{prefix}.{FUSED_EXPERTS}",
        )
        bias = checked(reader, f"{fused}.gate_up_proj_bias", (2 * size,), expert)
        gate, up = bias[0::2], bias[1::2]
        shard = self.width_shard
        kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        down = checked(reader, f"{fused}.down_proj_bias", (hidden,), expert)
        return torch.cat([shard.narrow(gate), shard.narrow(up)]).to(**kw), down.to(**kw)


class GptOssForCausalLM(MoEForCausalLM):
    """gpt-oss (20b, 120b) in float weights."""

    def _attention_options(self, arch: ModelArch, layer: int) -> AttentionOptions:
        return AttentionOptions(
            qkv_bias=True, o_bias=True, sinks=True, sliding_window=arch.window_of(layer)
        )

    def _make_moe(self, arch: ModelArch, *, dtype: torch.dtype, device: torch.device) -> SparseMoE:
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        router = TopKSoftmaxRouter(
            arch.hidden_size, arch.num_local_experts, arch.num_experts_per_tok, bias=True, **kw
        )
        tp = self.moe_tp
        experts = GptOssExperts(
            arch.num_local_experts,
            arch.hidden_size,
            arch.expert_intermediate_size,
            biases=True,
            add_down_bias=tp is None or tp.is_driver,
            activation=clamped_swiglu(arch.swiglu_limit),
            **expert_kwargs(arch, self.expert_parallel, tp),
            **kw,
        )
        return SparseMoE(
            router,
            experts,
            router_name="mlp.router",
            expert_parallel=self.expert_parallel,
            tp=tp,
        )
