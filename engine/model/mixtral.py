"""Mixtral: the Llama decoder with a top-k routed mixture of SiLU-gated experts as its MLP.

Each expert runs only over the tokens routed to it (index_select / index_add). `MixtralExperts`
holds any subset of the experts (a rank's share under expert parallelism); with an
`ExpertParallel` context, `MixtralMoE` runs its router and local experts over every rank's
tokens through the exchange (`shoal.engine.parallel.expert_parallel`), which sums the ranks' shares. At
a resize, `MixtralExperts.stage` / `commit` re-shard a layer to another set of experts. Under
tensor parallelism every worker holds a block of each expert's width (gate/up column-parallel,
down row-parallel) and the layer's output is summed by one all-reduce; the router is replicated.
Under both, each worker exchanges with the same TP index of the other ranks first, and the
all-reduce then sums the width blocks of what the exchange returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.errors import ModelLoadError
from shoal.engine.loader import SafetensorsReader
from shoal.engine.model.attention import AttentionBackend, AttentionMetadata
from shoal.engine.model.layers import (
    FeedForward,
    Linear,
    WeightMap,
    empty_param,
    is_worth_packing,
    pack_weight,
    packed_linear,
    silu_and_mul,
)
from shoal.engine.model.llama import DecoderLayer, LlamaForCausalLM
from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.expert_parallel import ExpertParallel, StagedLayerExperts
from shoal.engine.parallel.tensor_parallel import Shard, TensorParallel


class MixtralExperts(nn.Module):
    """The experts `expert_ids` of `num_experts`, gate and up fused per expert.

    Args:
        num_experts: experts in the whole layer.
        hidden_size: model width.
        intermediate_size: each expert's width.
        expert_ids: the experts held here (default: all).
        width_shard: the block of each expert's width held here (default: all of it).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        expert_ids: Sequence[int] | None = None,
        width_shard: Shard | None = None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.width_shard = width_shard or Shard(0, intermediate_size)
        self.full_intermediate_size = intermediate_size
        intermediate_size = self.width_shard.size
        self.num_experts = num_experts
        self.expert_ids = list(range(num_experts)) if expert_ids is None else sorted(expert_ids)
        assert self.expert_ids, "an experts module holds at least one expert"
        assert all(0 <= e < num_experts for e in self.expert_ids), "expert id out of range"
        assert len(set(self.expert_ids)) == len(self.expert_ids), "duplicate expert ids"
        self.intermediate_size = intermediate_size
        self.hidden_size = hidden_size
        self.dtype, self.device = dtype, device
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

    def pack(self, keep_dense: bool = False) -> None:
        """Per-expert oneDNN-packed weights replace the dense ones (CPU), when large enough.
        Experts keep no dense copy whatever `keep_dense` says: a step's rows spread over them."""
        if not is_worth_packing(self.w2[0]):
            return
        self.packed = [
            (pack_weight(a), pack_weight(b)) for a, b in zip(self.w13, self.w2, strict=True)
        ]
        del self.w13, self.w2

    def stage(
        self, expert_ids: Sequence[int], prefix: str, reader: SafetensorsReader
    ) -> StagedLayerExperts:
        """Weights for holding `expert_ids` instead, built beside the live ones.

        Held experts are copied from the live tensors (packed ones are shared: never written);
        the others are read from `reader` under the names `weight_map` accepts (per-expert, else
        the fused transformers-5 tensors, one row each), and packed if this layer is. Reads the
        live weights only, so forwards may run meanwhile on another thread.

        Args:
            expert_ids: the experts to hold, any order.
            prefix: the decoder layer's checkpoint prefix, e.g. "model.layers.3".
            reader: the checkpoint.

        Raises:
            ValueError: an expert id out of range or repeated, or none.
            ModelLoadError: a needed tensor is missing or has the wrong shape.
        """
        new_ids = sorted(expert_ids)
        if not new_ids or len(set(new_ids)) != len(new_ids):
            raise ValueError(f"a layer holds one or more distinct experts, not {new_ids}")
        if not all(0 <= e < self.num_experts for e in new_ids):
            raise ValueError(f"expert ids {new_ids} outside [0, {self.num_experts})")
        local_of = {e: i for i, e in enumerate(self.expert_ids)}
        with torch.no_grad():
            if self.packed is not None:
                packed = tuple(
                    self.packed[local_of[e]]
                    if e in local_of
                    else _pack_pair(self._read_expert(e, prefix, reader))
                    for e in new_ids
                )
                return StagedLayerExperts(tuple(new_ids), packed=packed)
            kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
            w13 = empty_param(len(new_ids), 2 * self.intermediate_size, self.hidden_size, **kw)
            w2 = empty_param(len(new_ids), self.hidden_size, self.intermediate_size, **kw)
            for i, e in enumerate(new_ids):
                local = local_of.get(e)
                if local is None:
                    gate_up, down = self._read_expert(e, prefix, reader)
                else:
                    gate_up, down = self.w13[local], self.w2[local]
                w13[i].copy_(gate_up)
                w2[i].copy_(down)
        return StagedLayerExperts(tuple(new_ids), w13=w13, w2=w2)

    def commit(self, staged: StagedLayerExperts) -> None:
        """Swaps in a stage of this layer; the old weights are no longer referenced here."""
        assert (staged.packed is None) == (self.packed is None), "stage and layer layouts differ"
        if staged.packed is not None:
            self.packed = list(staged.packed)
        else:
            assert staged.w13 is not None and staged.w2 is not None, "a dense stage has weights"
            self.w13, self.w2 = staged.w13, staged.w2
        self.expert_ids = list(staged.expert_ids)

    def _read_expert(
        self, expert: int, prefix: str, reader: SafetensorsReader
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert's width block, in this dtype."""
        size, hidden, shard = self.full_intermediate_size, self.hidden_size, self.width_shard
        base = f"{prefix}.block_sparse_moe.experts.{expert}"
        fused = f"{prefix}.mlp.experts"
        if f"{base}.w1.weight" in reader:
            gate = _checked(reader, f"{base}.w1.weight", (size, hidden))
            up = _checked(reader, f"{base}.w3.weight", (size, hidden))
            down = _checked(reader, f"{base}.w2.weight", (hidden, size))
        elif f"{fused}.gate_up_proj" in reader:
            gate_up = _checked(reader, f"{fused}.gate_up_proj", (2 * size, hidden), expert)
            gate, up = gate_up[:size], gate_up[size:]
            down = _checked(reader, f"{fused}.down_proj", (hidden, size), expert)
        else:
            raise ModelLoadError(f"the checkpoint has no weights of expert {expert} in {prefix}")
        gate_up = torch.cat([shard.narrow(gate), shard.narrow(up)])
        kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        return gate_up.to(**kw), shard.narrow(down, 1).to(**kw)

    def weight_map(self, prefix: str) -> WeightMap:
        """Per-expert names `{prefix}.block_sparse_moe.experts.{e}.w1|w2|w3.weight` (saved
        checkpoints) or fused `{prefix}.mlp.experts.gate_up_proj|down_proj` (transformers 5
        state_dict). Experts outside the local range are accepted and dropped; each held one is
        narrowed to this worker's width block."""
        size, hidden = self.full_intermediate_size, self.hidden_size
        local_size, shard = self.intermediate_size, self.width_shard
        local_of = {e: i for i, e in enumerate(self.expert_ids)}
        wm = WeightMap()
        w13_names, w2_names = [], []
        for e in range(self.num_experts):
            local = local_of.get(e)
            base = f"{prefix}.block_sparse_moe.experts.{e}"
            w1 = self.w13[local, :local_size] if local is not None else None
            w3 = self.w13[local, local_size:] if local is not None else None
            w2 = self.w2[local] if local is not None else None
            wm.add(f"{base}.w1.weight", w1, shape=(size, hidden), block=(0, shard))
            wm.add(f"{base}.w3.weight", w3, shape=(size, hidden), block=(0, shard))
            wm.add(f"{base}.w2.weight", w2, shape=(hidden, size), block=(1, shard))
            w13_names += [f"{base}.w1.weight", f"{base}.w3.weight"]
            w2_names.append(f"{base}.w2.weight")
        held = torch.tensor(self.expert_ids)
        wm.add(
            f"{prefix}.mlp.experts.gate_up_proj",
            self.w13,
            shape=(self.num_experts, 2 * size, hidden),
            select=lambda t: _narrow_gate_up(t.index_select(0, held.to(t.device)), shard, size),
            covers=tuple(w13_names),
            required=False,
        )
        wm.add(
            f"{prefix}.mlp.experts.down_proj",
            self.w2,
            shape=(self.num_experts, hidden, size),
            select=lambda t: shard.narrow(t.index_select(0, held.to(t.device)), 2),
            covers=tuple(w2_names),
            required=False,
        )
        return wm


def _narrow_gate_up(gate_up: torch.Tensor, shard: Shard, size: int) -> torch.Tensor:
    """[E, 2I, H] fused gate/up -> [E, 2 * shard, H]: the shard's rows of gate, then of up."""
    return torch.cat([shard.narrow(gate_up[:, :size], 1), shard.narrow(gate_up[:, size:], 1)], 1)


def _checked(
    reader: SafetensorsReader, name: str, shape: tuple[int, ...], index: int | None = None
) -> torch.Tensor:
    tensor = reader.get(name, index)
    if tuple(tensor.shape) != shape:
        where = name if index is None else f"{name}[{index}]"
        raise ModelLoadError(f"tensor {where} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor


def _pack_pair(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return pack_weight(pair[0]), pack_weight(pair[1])


class MixtralMoE(FeedForward):
    """Router (softmax, top-k, renormalise: HF Mixtral's order, in float32) plus the experts;
    across the ranks' tokens when an `ExpertParallel` context is given, summed over the TP
    group's width blocks when a `TensorParallel` one is."""

    def __init__(
        self,
        arch: ModelArch,
        *,
        expert_parallel: ExpertParallel | None = None,
        tp: TensorParallel | None = None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.tp = tp
        self.top_k = arch.num_experts_per_tok
        self.expert_parallel = expert_parallel
        expert_ids = expert_parallel.local_expert_ids if expert_parallel is not None else None
        self.router = Linear(arch.hidden_size, arch.num_local_experts, dtype=dtype, device=device)
        self.experts = MixtralExperts(
            arch.num_local_experts,
            arch.hidden_size,
            arch.intermediate_size,
            expert_ids=expert_ids,
            width_shard=tp.shard(arch.intermediate_size) if tp is not None else None,
            dtype=dtype,
            device=device,
        )
        # Where this layer's tensors are in the checkpoint; set by the model once it is built.
        self.layer_prefix = ""
        if expert_parallel is not None:
            expert_parallel.register_layer(self, arch.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.expert_parallel is None:
            out = self.route_and_compute(x)
        else:
            out = self.expert_parallel.exchange(x, self.route_and_compute)
        if self.tp is None or out.shape[0] == 0:
            # No rows (a dummy forward): nothing to sum, and every TP worker of the rank
            # skips alike (they run the same batch).
            return out
        return self.tp.all_reduce(out)

    def route_and_compute(self, x: torch.Tensor) -> torch.Tensor:
        """This module's experts' share of the MoE output for tokens `x`."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        return self.experts(x, ids, weights)

    def stage_experts(
        self, expert_ids: Sequence[int], reader: SafetensorsReader
    ) -> StagedLayerExperts:
        """See `MixtralExperts.stage`."""
        assert self.layer_prefix, "the model names its layers at construction"
        return self.experts.stage(expert_ids, self.layer_prefix, reader)

    def commit_experts(self, staged: StagedLayerExperts) -> None:
        self.experts.commit(staged)

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
        attention_backend: AttentionBackend[Any] | None = None,
        tensor_parallel: TensorParallel | None = None,
    ):
        assert arch.is_moe, "MixtralForCausalLM needs num_local_experts > 0"
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
            # The prefix `LlamaForCausalLM.weight_map` gives layer i, for re-staging experts.
            cast(MixtralMoE, cast(DecoderLayer, layer).mlp).layer_prefix = f"model.layers.{i}"

    def _make_mlp(
        self, arch: ModelArch, *, dtype: torch.dtype, device: torch.device
    ) -> FeedForward:
        return MixtralMoE(
            arch, expert_parallel=self.expert_parallel, tp=self.tp, dtype=dtype, device=device
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.expert_parallel is not None:
            self.expert_parallel.begin_forward(input_ids.shape[0])
        return super().forward(input_ids, positions, meta)
