"""Mixtral: the Llama decoder with a top-k routed mixture of SiLU-gated experts as its MLP.

Each expert runs only over the tokens routed to it (index_select / index_add). `MixtralExperts`
holds a contiguous range of experts so the experts can be sharded over expert-parallel ranks;
combining the ranks' partial sums is the caller's business and not done here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.model_arch import ModelArch
from shoal.engine.models.layers import (
    FeedForward,
    Linear,
    WeightMap,
    empty_param,
    is_worth_packing,
    pack_weight,
    packed_linear,
    silu_and_mul,
)
from shoal.engine.models.llama import LlamaForCausalLM


class MixtralExperts(nn.Module):
    """Experts [expert_start, expert_end) of `num_experts`, gate and up fused per expert.

    Args:
        num_experts: experts in the whole layer.
        hidden_size: model width.
        intermediate_size: each expert's width.
        expert_start: first expert held here.
        expert_end: one past the last expert held here (default: all).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        expert_start: int = 0,
        expert_end: int | None = None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.expert_start = expert_start
        self.expert_end = num_experts if expert_end is None else expert_end
        assert 0 <= self.expert_start < self.expert_end <= num_experts, "bad expert range"
        self.intermediate_size = intermediate_size
        num_local = self.expert_end - self.expert_start
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.w13 = empty_param(num_local, 2 * intermediate_size, hidden_size, **kw)
        self.w2 = empty_param(num_local, hidden_size, intermediate_size, **kw)
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum of the local experts' outputs per token (zero for tokens routed elsewhere).

        Args:
            x: [T, hidden] tokens.
            topk_ids: [T, k] expert ids per token.
            topk_weights: [T, k] float32 routing weights.
        """
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        flat_weights = topk_weights.reshape(-1)
        out = torch.zeros_like(x)
        offset = sum(counts[: self.expert_start])
        for local, expert in enumerate(range(self.expert_start, self.expert_end)):
            count = counts[expert]
            if count == 0:
                continue
            picks = order[offset : offset + count]
            offset += count
            tokens = picks // top_k
            h = self._gate_up(x.index_select(0, tokens), local)
            h = self._down(silu_and_mul(h, self.intermediate_size), local)
            # float32 weights, then back to the activation dtype: HF Mixtral's rounding.
            h = h * flat_weights.index_select(0, picks)[:, None]
            out.index_add_(0, tokens, h.to(out.dtype))
        return out

    def _gate_up(self, x: torch.Tensor, local: int) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed[local][0])
        return F.linear(x, self.w13[local])

    def _down(self, x: torch.Tensor, local: int) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed[local][1])
        return F.linear(x, self.w2[local])

    def pack(self) -> None:
        """Per-expert oneDNN-packed weights replace the dense ones (CPU), when large enough."""
        if not is_worth_packing(self.w2[0]):
            return
        self.packed = [
            (pack_weight(a), pack_weight(b)) for a, b in zip(self.w13, self.w2, strict=True)
        ]
        del self.w13, self.w2

    def weight_map(self, prefix: str) -> WeightMap:
        """Per-expert names `{prefix}.block_sparse_moe.experts.{e}.w1|w2|w3.weight` (saved
        checkpoints) or fused `{prefix}.mlp.experts.gate_up_proj|down_proj` (transformers 5
        state_dict). Experts outside the local range are accepted and dropped."""
        size, hidden = self.intermediate_size, self.w13.shape[2]
        wm = WeightMap()
        w13_names, w2_names = [], []
        for e in range(self.num_experts):
            local = e - self.expert_start
            is_local = self.expert_start <= e < self.expert_end
            base = f"{prefix}.block_sparse_moe.experts.{e}"
            w1 = self.w13[local, :size] if is_local else None
            w3 = self.w13[local, size:] if is_local else None
            w2 = self.w2[local] if is_local else None
            wm.add(f"{base}.w1.weight", w1, shape=(size, hidden))
            wm.add(f"{base}.w3.weight", w3, shape=(size, hidden))
            wm.add(f"{base}.w2.weight", w2, shape=(hidden, size))
            w13_names += [f"{base}.w1.weight", f"{base}.w3.weight"]
            w2_names.append(f"{base}.w2.weight")
        local_range = slice(self.expert_start, self.expert_end)
        wm.add(
            f"{prefix}.mlp.experts.gate_up_proj",
            self.w13,
            shape=(self.num_experts, 2 * size, hidden),
            select=lambda t: t[local_range],
            covers=tuple(w13_names),
            required=False,
        )
        wm.add(
            f"{prefix}.mlp.experts.down_proj",
            self.w2,
            shape=(self.num_experts, hidden, size),
            select=lambda t: t[local_range],
            covers=tuple(w2_names),
            required=False,
        )
        return wm


class MixtralMoE(FeedForward):
    """Router (softmax, top-k, renormalise: HF Mixtral's order, in float32) plus the experts."""

    def __init__(
        self,
        arch: ModelArch,
        *,
        expert_range: tuple[int, int] | None = None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        start, end = expert_range or (0, arch.num_local_experts)
        self.router = Linear(arch.hidden_size, arch.num_local_experts, dtype=dtype, device=device)
        self.experts = MixtralExperts(
            arch.num_local_experts,
            arch.hidden_size,
            arch.intermediate_size,
            expert_start=start,
            expert_end=end,
            dtype=dtype,
            device=device,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        return self.experts(x, ids, weights)

    def weight_map(self, layer_prefix: str) -> WeightMap:
        router_name = f"{layer_prefix}.block_sparse_moe.gate.weight"
        wm = self.experts.weight_map(layer_prefix)
        router = self.router.weight
        wm.add(router_name, router)
        wm.add(f"{layer_prefix}.mlp.gate.weight", router, covers=(router_name,), required=False)
        return wm


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral decoder.

    Args:
        arch: the checkpoint's architecture facts (num_local_experts > 0).
        expert_range: [start, end) of the experts this rank holds; default all.
        **kwargs: as for `LlamaForCausalLM`.
    """

    def __init__(
        self,
        arch: ModelArch,
        *,
        expert_range: tuple[int, int] | None = None,
        max_position: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        assert arch.is_moe, "MixtralForCausalLM needs num_local_experts > 0"
        self.expert_range = expert_range
        super().__init__(arch, max_position=max_position, dtype=dtype, device=device)

    def _make_mlp(
        self, arch: ModelArch, *, dtype: torch.dtype, device: torch.device
    ) -> FeedForward:
        return MixtralMoE(arch, expert_range=self.expert_range, dtype=dtype, device=device)
