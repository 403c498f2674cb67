"""A mixture-of-experts MLP: a router (`Router`: which experts each token goes to, with what
weights), the routed experts (`RoutedExperts`), and optionally shared experts every token takes
(DeepSeek-V3) or dense MLPs in some layers of an MoE model (`make_moe_mlp`).

With an `ExpertParallel` context the router and the local experts run over every rank's tokens
through the exchange (`shoal.engine.parallel.expert_parallel`), which sums the ranks' shares;
with a `TensorParallel` one each worker holds a block of every expert's width and the layer's
output is summed by one all-reduce. Under both, each worker exchanges with the same TP index of
the other ranks first, and the all-reduce then sums the width blocks of what the exchange
returned. Shared experts see only this rank's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shoal.engine.loader import SafetensorsReader
from shoal.engine.model.experts import RoutedExperts
from shoal.engine.model.layers import FeedForward, Linear, WeightMap, empty_param
from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.expert_parallel import ExpertParallel, StagedLayerExperts
from shoal.engine.parallel.tensor_parallel import TensorParallel


class Router(torch.nn.Module):
    """Scores the experts for each token and picks `top_k`; the base is Mixtral's and Qwen3-MoE's
    order: softmax over all experts (float32), top-k, renormalised to sum to 1 when asked.

    Args:
        hidden_size, num_experts, top_k: the layer's shape.
        renormalize: divide the top-k weights by their sum.
        bias: the router's linear has a bias (gpt-oss).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        renormalize: bool = True,
        bias: bool = False,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.linear = Linear(hidden_size, num_experts, bias=bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights [T, k], expert ids [T, k])."""
        probs = torch.softmax(self.linear(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def weight_map(self, name: str, aliases: Sequence[str] = ()) -> WeightMap:
        """The router's weight under `name` (`.weight`, `.bias`), or under any alias."""
        wm = WeightMap()
        wm.add(f"{name}.weight", self.linear.weight)
        for alias in aliases:
            wm.add(
                f"{alias}.weight", self.linear.weight, covers=(f"{name}.weight",), required=False
            )
        if self.linear.bias is not None:
            wm.add(f"{name}.bias", self.linear.bias)
        return wm


class TopKSoftmaxRouter(Router):
    """gpt-oss: top-k of the raw scores first, then a softmax over those k."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, ids = torch.topk(self.linear(x).float(), self.top_k, dim=-1)
        return torch.softmax(values, dim=-1), ids


class GroupedTopKRouter(Router):
    """DeepSeek-V3: sigmoid scores; the choice adds a learnt bias per expert, keeps the
    `topk_group` groups whose two best biased scores sum highest, and picks the top k of their
    experts; the weights are the unbiased scores, renormalised if asked, times a scale."""

    def __init__(self, arch: ModelArch, *, dtype: torch.dtype, device: torch.device):
        super().__init__(
            arch.hidden_size,
            arch.num_local_experts,
            arch.num_experts_per_tok,
            renormalize=arch.norm_topk_prob,
            dtype=torch.float32,  # as HF keeps it: scores in float32 whatever the model's dtype
            device=device,
        )
        self.num_groups, self.topk_group = arch.n_group, arch.topk_group
        self.scale = arch.routed_scaling_factor
        self.score_bias = empty_param(arch.num_local_experts, dtype=torch.float32, device=device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.linear(x.float()).sigmoid()
        choice = scores + self.score_bias
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, self.num_groups, num_experts // self.num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        ids = torch.topk(
            choice.masked_fill(~keep, float("-inf")), k=self.top_k, dim=-1, sorted=False
        )[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids

    def weight_map(self, name: str, aliases: Sequence[str] = ()) -> WeightMap:
        wm = super().weight_map(name, aliases)
        wm.add(f"{name}.e_score_correction_bias", self.score_bias)
        return wm


class SparseMoE(FeedForward):
    """Router plus routed experts (plus shared experts, if given): one decoder layer's MLP.

    Args:
        router: scores and picks the experts.
        experts: the experts held here (a rank's share under expert parallelism).
        router_name: the router's checkpoint name under the layer prefix (and aliases).
        shared: an MLP every token of this rank also goes through, added to the output.
        expert_parallel, tp: the rank's exchange and the worker's TP group, if any.
    """

    def __init__(
        self,
        router: Router,
        experts: RoutedExperts,
        *,
        router_name: str,
        router_aliases: Sequence[str] = (),
        shared: FeedForward | None = None,
        expert_parallel: ExpertParallel | None = None,
        tp: TensorParallel | None = None,
    ):
        super().__init__()
        self.router, self.experts, self.shared = router, experts, shared
        self.router_name, self.router_aliases = router_name, tuple(router_aliases)
        self.tp, self.expert_parallel = tp, expert_parallel
        # Where this layer's tensors are in the checkpoint; set by the model once it is built.
        self.layer_prefix = ""
        if expert_parallel is not None:
            expert_parallel.register_layer(self, experts.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.expert_parallel is None:
            out = self.route_and_compute(x)
        else:
            out = self.expert_parallel.exchange(x, self.route_and_compute)
        if self.tp is not None and out.shape[0] > 0:
            # No rows (a dummy forward): nothing to sum, and every TP worker of the rank
            # skips alike (they run the same batch).
            out = self.tp.all_reduce(out)
        if self.shared is not None:
            out = out + self.shared(x)
        return out

    def route_and_compute(self, x: torch.Tensor) -> torch.Tensor:
        """This module's experts' share of the MoE output for tokens `x`."""
        weights, ids = self.router(x)
        return self.experts(x, ids, weights)

    def stage_experts(
        self, expert_ids: Sequence[int], reader: SafetensorsReader
    ) -> StagedLayerExperts:
        """See `RoutedExperts.stage`."""
        assert self.layer_prefix, "the model names its layers at construction"
        return self.experts.stage(expert_ids, self.layer_prefix, reader)

    def commit_experts(self, staged: StagedLayerExperts) -> None:
        self.experts.commit(staged)

    def weight_map(self, layer_prefix: str) -> WeightMap:
        wm = self.experts.weight_map(layer_prefix)
        aliases = [f"{layer_prefix}.{a}" for a in self.router_aliases]
        wm.update(self.router.weight_map(f"{layer_prefix}.{self.router_name}", aliases))
        if self.shared is not None:
            wm.update(self.shared.weight_map(layer_prefix))
        return wm


def expert_kwargs(
    arch: ModelArch, expert_parallel: ExpertParallel | None, tp: TensorParallel | None
) -> dict[str, Any]:
    """The experts held and the width block of each, for a `RoutedExperts`."""
    width = arch.expert_intermediate_size
    return {
        "expert_ids": expert_parallel.local_expert_ids if expert_parallel is not None else None,
        "width_shard": tp.shard(width) if tp is not None else None,
    }
