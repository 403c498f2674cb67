"""Mixtral: the Llama decoder with a top-k routed mixture of SiLU-gated experts as its MLP.

Each expert runs only over the tokens routed to it (index_select / index_add). `MixtralExperts`
holds any subset of the experts (a rank's share under expert parallelism); with an
`ExpertParallel` context, `MixtralMoE` runs its router and local experts over every rank's
tokens through the exchange (`shoal.engine.expert_parallel`), which sums the ranks' shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.attention import AttentionMetadata
from shoal.engine.expert_parallel import ExpertParallel
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
    """The experts `expert_ids` of `num_experts`, gate and up fused per expert.

    Args:
        num_experts: experts in the whole layer.
        hidden_size: model width.
        intermediate_size: each expert's width.
        expert_ids: the experts held here (default: all).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        expert_ids: Sequence[int] | None = None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.expert_ids = list(range(num_experts)) if expert_ids is None else sorted(expert_ids)
        assert self.expert_ids, "an experts module holds at least one expert"
        assert all(0 <= e < num_experts for e in self.expert_ids), "expert id out of range"
        assert len(set(self.expert_ids)) == len(self.expert_ids), "duplicate expert ids"
        self.intermediate_size = intermediate_size
        num_local = len(self.expert_ids)
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
        starts = [0] * self.num_experts
        for expert in range(1, self.num_experts):
            starts[expert] = starts[expert - 1] + counts[expert - 1]
        flat_weights = topk_weights.reshape(-1)
        out = torch.zeros_like(x)
        for local, expert in enumerate(self.expert_ids):
            count = counts[expert]
            if count == 0:
                continue
            picks = order[starts[expert] : starts[expert] + count]
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
        local_of = {e: i for i, e in enumerate(self.expert_ids)}
        wm = WeightMap()
        w13_names, w2_names = [], []
        for e in range(self.num_experts):
            local = local_of.get(e)
            base = f"{prefix}.block_sparse_moe.experts.{e}"
            w1 = self.w13[local, :size] if local is not None else None
            w3 = self.w13[local, size:] if local is not None else None
            w2 = self.w2[local] if local is not None else None
            wm.add(f"{base}.w1.weight", w1, shape=(size, hidden))
            wm.add(f"{base}.w3.weight", w3, shape=(size, hidden))
            wm.add(f"{base}.w2.weight", w2, shape=(hidden, size))
            w13_names += [f"{base}.w1.weight", f"{base}.w3.weight"]
            w2_names.append(f"{base}.w2.weight")
        held = torch.tensor(self.expert_ids)
        wm.add(
            f"{prefix}.mlp.experts.gate_up_proj",
            self.w13,
            shape=(self.num_experts, 2 * size, hidden),
            select=lambda t: t.index_select(0, held.to(t.device)),
            covers=tuple(w13_names),
            required=False,
        )
        wm.add(
            f"{prefix}.mlp.experts.down_proj",
            self.w2,
            shape=(self.num_experts, hidden, size),
            select=lambda t: t.index_select(0, held.to(t.device)),
            covers=tuple(w2_names),
            required=False,
        )
        return wm


class MixtralMoE(FeedForward):
    """Router (softmax, top-k, renormalise: HF Mixtral's order, in float32) plus the experts;
    across the ranks' tokens when an `ExpertParallel` context is given."""

    def __init__(
        self,
        arch: ModelArch,
        *,
        expert_parallel: ExpertParallel | None = None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.expert_parallel = expert_parallel
        expert_ids = expert_parallel.local_expert_ids if expert_parallel is not None else None
        self.router = Linear(arch.hidden_size, arch.num_local_experts, dtype=dtype, device=device)
        self.experts = MixtralExperts(
            arch.num_local_experts,
            arch.hidden_size,
            arch.intermediate_size,
            expert_ids=expert_ids,
            dtype=dtype,
            device=device,
        )
        if expert_parallel is not None:
            expert_parallel.register_layer(self, arch.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.expert_parallel is None:
            return self.route_and_compute(x)
        return self.expert_parallel.exchange(x, self.route_and_compute)

    def route_and_compute(self, x: torch.Tensor) -> torch.Tensor:
        """This module's experts' share of the MoE output for tokens `x`."""
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
        expert_parallel: this rank's expert-parallel context (its experts, the exchange);
            default: every expert here, no exchange.
        **kwargs: as for `LlamaForCausalLM`.
    """

    def __init__(
        self,
        arch: ModelArch,
        *,
        expert_parallel: ExpertParallel | None = None,
        max_position: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        assert arch.is_moe, "MixtralForCausalLM needs num_local_experts > 0"
        self.expert_parallel = expert_parallel
        if expert_parallel is not None:
            expert_parallel.dtype, expert_parallel.device = dtype, torch.device(device)
        super().__init__(arch, max_position=max_position, dtype=dtype, device=device)

    def _make_mlp(
        self, arch: ModelArch, *, dtype: torch.dtype, device: torch.device
    ) -> FeedForward:
        return MixtralMoE(arch, expert_parallel=self.expert_parallel, dtype=dtype, device=device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.expert_parallel is not None:
            self.expert_parallel.begin_forward(input_ids.shape[0])
        return super().forward(input_ids, positions, meta)
