"""Mixtral and Qwen3-MoE: the Llama decoder (Qwen3's q/k norms for Qwen3-MoE) with a top-k
routed mixture of SiLU-gated experts as its MLP (`shoal.engine.model.moe`).

Mixtral routes with a softmax over all experts, the top k renormalised; Qwen3-MoE the same,
renormalised only with `norm_topk_prob`, and keeps a dense MLP in its `mlp_only_layers`. Both
serve expert-parallel across ranks and tensor-parallel within one; at a resize,
`ExpertParallel.stage` / `commit` re-shard every MoE layer to another set of experts.
"""

from __future__ import annotations

from typing import Any

import torch

from shoal.engine.model.attention import AttentionBackend, AttentionMetadata
from shoal.engine.model.experts import MIXTRAL_EXPERTS, PROJ_EXPERTS, RoutedExperts
from shoal.engine.model.layers import FeedForward, GatedMLP, RMSNorm
from shoal.engine.model.llama import LlamaForCausalLM
from shoal.engine.model.llama_layers import AttentionOptions
from shoal.engine.model.moe import Router, SparseMoE, expert_kwargs
from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.expert_parallel import ExpertParallel
from shoal.engine.parallel.tensor_parallel import TensorParallel


class MixtralMoE(SparseMoE):
    """Mixtral's MoE layer: router `block_sparse_moe.gate` (transformers 5 in memory:
    `mlp.gate`), experts `block_sparse_moe.experts.{e}.w1|w3|w2` (or fused)."""

    def __init__(
        self,
        arch: ModelArch,
        *,
        expert_parallel: ExpertParallel | None = None,
        tp: TensorParallel | None = None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        super().__init__(
            Router(arch.hidden_size, arch.num_local_experts, arch.num_experts_per_tok, **kw),
            RoutedExperts(
                arch.num_local_experts,
                arch.hidden_size,
                arch.expert_intermediate_size,
                names=MIXTRAL_EXPERTS,
                **expert_kwargs(arch, expert_parallel, tp),
                **kw,
            ),
            router_name="block_sparse_moe.gate",
            router_aliases=("mlp.gate",),
            expert_parallel=expert_parallel,
            tp=tp,
        )


class MoEForCausalLM(LlamaForCausalLM):
    """The base of the MoE decoders: an `ExpertParallel` context shared by every MoE layer.

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
        attention_backend: AttentionBackend[Any] | None = None,
        tensor_parallel: TensorParallel | None = None,
    ):
        assert arch.is_moe, f"{type(self).__name__} needs num_local_experts > 0"
        self.expert_parallel = expert_parallel
        if expert_parallel is not None:
            expert_parallel.dtype, expert_parallel.device = dtype, torch.device(device)
        super().__init__(
            arch,
            max_position=max_position,
            dtype=dtype,
            device=device,
            attention_backend=attention_backend,
            tensor_parallel=tensor_parallel,
        )
        for i, layer in enumerate(self.layers):
            mlp = layer.get_submodule("mlp")
            if isinstance(mlp, SparseMoE):
                # The prefix `LlamaForCausalLM.weight_map` gives layer i, for re-staging.
                mlp.layer_prefix = f"model.layers.{i}"

    @property
    def moe_tp(self) -> TensorParallel | None:
        """The TP group the MoE layers sum their width blocks over (None: not split)."""
        return self.tp if self.tp.size > 1 else None

    def _make_mlp(
        self, arch: ModelArch, layer: int, *, dtype: torch.dtype, device: torch.device
    ) -> FeedForward:
        if layer in arch.mlp_only_layers:
            return GatedMLP(
                arch.hidden_size, arch.intermediate_size, tp=self.tp, dtype=dtype, device=device
            )
        return self._make_moe(arch, dtype=dtype, device=device)

    def _make_moe(self, arch: ModelArch, *, dtype: torch.dtype, device: torch.device) -> SparseMoE:
        raise NotImplementedError

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.expert_parallel is not None:
            self.expert_parallel.begin_forward(input_ids.shape[0])
        return super().forward(input_ids, positions, meta)


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral decoder."""

    def _make_moe(self, arch: ModelArch, *, dtype: torch.dtype, device: torch.device) -> SparseMoE:
        return MixtralMoE(
            arch, expert_parallel=self.expert_parallel, tp=self.moe_tp, dtype=dtype, device=device
        )


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE: Qwen3's attention (q/k norms); router `mlp.gate`, experts
    `mlp.experts.{e}.gate_proj|up_proj|down_proj` (or fused), top-k renormalised with
    `norm_topk_prob`."""

    def _attention_options(self, arch: ModelArch, layer: int) -> AttentionOptions:
        return AttentionOptions(
            qkv_bias=arch.attention_bias,
            o_bias=arch.attention_bias,
            qk_norm=RMSNorm,
            sliding_window=arch.window_of(layer),
        )

    def _make_moe(self, arch: ModelArch, *, dtype: torch.dtype, device: torch.device) -> SparseMoE:
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        router = Router(
            arch.hidden_size,
            arch.num_local_experts,
            arch.num_experts_per_tok,
            renormalize=arch.norm_topk_prob,
            **kw,
        )
        experts = RoutedExperts(
            arch.num_local_experts,
            arch.hidden_size,
            arch.expert_intermediate_size,
            names=PROJ_EXPERTS,
            **expert_kwargs(arch, self.expert_parallel, self.moe_tp),
            **kw,
        )
        return SparseMoE(
            router,
            experts,
            router_name="mlp.gate",
            expert_parallel=self.expert_parallel,
            tp=self.moe_tp,
        )
