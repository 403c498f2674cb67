"""`RoutedExperts`: any subset of one MoE layer's experts, gate and up fused per expert, each run
only over the tokens routed to it (index_select / index_add), with optional biases and the
gated activation its architecture uses; and re-staging them to another subset (`stage` /
`commit`, for elastic expert parallelism).

Checkpoints name experts one module each (`ExpertNames`: Mixtral's w1/w3/w2, the gate/up/down
projections of Qwen3-MoE and DeepSeek-V3) or, as transformers 5 holds them in memory, as one
fused tensor per projection; both load. Under tensor parallelism each worker holds a block of
every expert's width. Knows nothing of routing, the exchange or requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.errors import ModelLoadError
from shoal.engine.loader import SafetensorsReader
from shoal.engine.model.layers import (
    WeightMap,
    empty_param,
    is_worth_packing,
    pack_weight,
    packed_linear,
    silu_and_mul,
)
from shoal.engine.parallel.expert_parallel import StagedLayerExperts
from shoal.engine.parallel.tensor_parallel import Shard

# (gate and up side by side [T, 2I], I) -> [T, I]
Activation = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class ExpertNames:
    """Where a saved checkpoint keeps one expert's projections, under the decoder layer's
    prefix; `{e}` stands for the expert id."""

    expert: str
    gate: str
    up: str
    down: str

    def of(self, prefix: str, expert: int, part: str) -> str:
        return f"{prefix}.{self.expert.format(e=expert)}.{part}"


MIXTRAL_EXPERTS = ExpertNames("block_sparse_moe.experts.{e}", "w1.weight", "w3.weight", "w2.weight")
PROJ_EXPERTS = ExpertNames(
    "mlp.experts.{e}", "gate_proj.weight", "up_proj.weight", "down_proj.weight"
)
FUSED_EXPERTS = "mlp.experts"  # transformers 5's fused gate_up_proj [E, 2I, H], down_proj [E, H, I]


class RoutedExperts(nn.Module):
    """The experts `expert_ids` of `num_experts`, gate and up fused per expert.

    Args:
        num_experts: experts in the whole layer.
        hidden_size: model width.
        intermediate_size: each expert's width.
        names: the per-expert checkpoint names.
        expert_ids: the experts held here (default: all).
        width_shard: the block of each expert's width held here (default: all of it).
        biases: the projections carry biases (gpt-oss); `add_down_bias` False leaves the down
            bias to another worker of a TP group (it is summed once).
        activation: the gated activation (default SiLU(gate) * up).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        names: ExpertNames = MIXTRAL_EXPERTS,
        expert_ids: Sequence[int] | None = None,
        width_shard: Shard | None = None,
        biases: bool = False,
        add_down_bias: bool = True,
        activation: Activation = silu_and_mul,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.names = names
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
        self.activation = activation
        self.dtype, self.device = dtype, device
        num_local = len(self.expert_ids)
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.w13 = empty_param(num_local, 2 * intermediate_size, hidden_size, **kw)
        self.w2 = empty_param(num_local, hidden_size, intermediate_size, **kw)
        self.has_biases, self.add_down_bias = biases, add_down_bias
        self.w13_bias = empty_param(num_local, 2 * intermediate_size, **kw) if biases else None
        self.w2_bias = empty_param(num_local, hidden_size, **kw) if biases else None
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
            h = self._down(self.activation(h, self.intermediate_size), local)
            # float32 weights, then back to the activation dtype: HF Mixtral's rounding.
            h = h * flat_weights.index_select(0, picks)[:, None]
            out.index_add_(0, tokens, h.to(out.dtype))
        return out

    def _gate_up(self, x: torch.Tensor, local: int) -> torch.Tensor:
        bias = self.w13_bias[local] if self.w13_bias is not None else None
        if self.packed is not None:
            return packed_linear(x, self.packed[local][0], bias)
        return F.linear(x, self.w13[local], bias)

    def _down(self, x: torch.Tensor, local: int) -> torch.Tensor:
        bias = None
        if self.w2_bias is not None and self.add_down_bias:
            bias = self.w2_bias[local]
        if self.packed is not None:
            return packed_linear(x, self.packed[local][1], bias)
        return F.linear(x, self.w2[local], bias)

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
        the others are read from `reader` under the names `weight_map` accepts, and packed if
        this layer is. Reads the live weights only, so forwards may run meanwhile on another
        thread.

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
            biases = self._stage_biases(new_ids, local_of, prefix, reader)
            if self.packed is not None:
                packed = tuple(
                    self.packed[local_of[e]]
                    if e in local_of
                    else _pack_pair(self.read_expert(e, prefix, reader))
                    for e in new_ids
                )
                return StagedLayerExperts(tuple(new_ids), packed=packed, **biases)
            kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
            w13 = empty_param(len(new_ids), 2 * self.intermediate_size, self.hidden_size, **kw)
            w2 = empty_param(len(new_ids), self.hidden_size, self.intermediate_size, **kw)
            for i, e in enumerate(new_ids):
                local = local_of.get(e)
                if local is None:
                    gate_up, down = self.read_expert(e, prefix, reader)
                else:
                    gate_up, down = self.w13[local], self.w2[local]
                w13[i].copy_(gate_up)
                w2[i].copy_(down)
        return StagedLayerExperts(tuple(new_ids), w13=w13, w2=w2, **biases)

    def _stage_biases(
        self, new_ids: list[int], local_of: dict[int, int], prefix: str, reader: SafetensorsReader
    ) -> dict[str, Any]:
        if self.w13_bias is None or self.w2_bias is None:
            return {}
        kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        w13_bias = empty_param(len(new_ids), 2 * self.intermediate_size, **kw)
        w2_bias = empty_param(len(new_ids), self.hidden_size, **kw)
        for i, e in enumerate(new_ids):
            local = local_of.get(e)
            if local is None:
                gate_up, down = self.read_expert_biases(e, prefix, reader)
            else:
                gate_up, down = self.w13_bias[local], self.w2_bias[local]
            w13_bias[i].copy_(gate_up)
            w2_bias[i].copy_(down)
        return {"w13_bias": w13_bias, "w2_bias": w2_bias}

    def commit(self, staged: StagedLayerExperts) -> None:
        """Swaps in a stage of this layer; the old weights are no longer referenced here."""
        assert (staged.packed is None) == (self.packed is None), "stage and layer layouts differ"
        if staged.packed is not None:
            self.packed = list(staged.packed)
        else:
            assert staged.w13 is not None and staged.w2 is not None, "a dense stage has weights"
            self.w13, self.w2 = staged.w13, staged.w2
        if self.has_biases:
            assert staged.w13_bias is not None and staged.w2_bias is not None
            self.w13_bias, self.w2_bias = staged.w13_bias, staged.w2_bias
        self.expert_ids = list(staged.expert_ids)

    def read_expert(
        self, expert: int, prefix: str, reader: SafetensorsReader
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert's width block, in this dtype."""
        size, hidden = self.full_intermediate_size, self.hidden_size
        names, fused = self.names, f"{prefix}.{FUSED_EXPERTS}"
        if names.of(prefix, expert, names.gate) in reader:
            gate = checked(reader, names.of(prefix, expert, names.gate), (size, hidden))
            up = checked(reader, names.of(prefix, expert, names.up), (size, hidden))
            down = checked(reader, names.of(prefix, expert, names.down), (hidden, size))
        elif f"{fused}.gate_up_proj" in reader:
            gate_up = checked(reader, f"{fused}.gate_up_proj", (2 * size, hidden), expert)
            gate, up = gate_up[:size], gate_up[size:]
            down = checked(reader, f"{fused}.down_proj", (hidden, size), expert)
        else:
            raise ModelLoadError(f"the checkpoint has no weights of expert {expert} in {prefix}")
        return self._shard_pair(gate, up, down)

    def read_expert_biases(
        self, expert: int, prefix: str, reader: SafetensorsReader
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up bias [2I], down bias [H]) of one expert; only layers with biases have them."""
        raise ModelLoadError(f"{prefix}: these experts carry no biases")

    def _shard_pair(
        self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shard = self.width_shard
        gate_up = torch.cat([shard.narrow(gate), shard.narrow(up)])
        kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        return gate_up.to(**kw), shard.narrow(down, 1).to(**kw)

    def weight_map(self, prefix: str) -> WeightMap:
        """Per-expert names (`names`, saved checkpoints) or the fused `mlp.experts.gate_up_proj`
        / `down_proj` (transformers 5 state_dict). Experts outside the local range are accepted
        and dropped; each held one is narrowed to this worker's width block."""
        size, hidden = self.full_intermediate_size, self.hidden_size
        local_size, shard, names = self.intermediate_size, self.width_shard, self.names
        local_of = {e: i for i, e in enumerate(self.expert_ids)}
        wm = WeightMap()
        w13_names, w2_names = [], []
        for e in range(self.num_experts):
            local = local_of.get(e)
            gate = self.w13[local, :local_size] if local is not None else None
            up = self.w13[local, local_size:] if local is not None else None
            down = self.w2[local] if local is not None else None
            gate_name, up_name = names.of(prefix, e, names.gate), names.of(prefix, e, names.up)
            down_name = names.of(prefix, e, names.down)
            wm.add(gate_name, gate, shape=(size, hidden), block=(0, shard))
            wm.add(up_name, up, shape=(size, hidden), block=(0, shard))
            wm.add(down_name, down, shape=(hidden, size), block=(1, shard))
            w13_names += [gate_name, up_name]
            w2_names.append(down_name)
        held = torch.tensor(self.expert_ids)
        fused = f"{prefix}.{FUSED_EXPERTS}"
        wm.add(
            f"{fused}.gate_up_proj",
            self.w13,
            shape=(self.num_experts, 2 * size, hidden),
            select=lambda t: narrow_gate_up(t.index_select(0, held.to(t.device)), shard, size),
            covers=tuple(w13_names),
            required=False,
        )
        wm.add(
            f"{fused}.down_proj",
            self.w2,
            shape=(self.num_experts, hidden, size),
            select=lambda t: shard.narrow(t.index_select(0, held.to(t.device)), 2),
            covers=tuple(w2_names),
            required=False,
        )
        return wm


def narrow_gate_up(gate_up: torch.Tensor, shard: Shard, size: int) -> torch.Tensor:
    """[E, 2I, ...] fused gate/up -> [E, 2 * shard, ...]: the shard's rows of gate, then of up."""
    return torch.cat([shard.narrow(gate_up[:, :size], 1), shard.narrow(gate_up[:, size:], 1)], 1)


def checked(
    reader: SafetensorsReader, name: str, shape: tuple[int, ...], index: int | None = None
) -> torch.Tensor:
    tensor = reader.get(name, index)
    if tuple(tensor.shape) != shape:
        where = name if index is None else f"{name}[{index}]"
        raise ModelLoadError(f"tensor {where} has shape {tuple(tensor.shape)}, expected {shape}")
    return tensor


def _pack_pair(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return pack_weight(pair[0]), pack_weight(pair[1])
