"""Building blocks shared by the decoder models: RMSNorm (and Gemma's), the gated MLP
(tensor-parallel when given a `TensorParallel`), and the name -> tensor map that loads HF-named
checkpoint tensors into (possibly fused, possibly narrowed) params. Rotary embeddings are
`shoal.engine.model.rotary`'s (re-exported here).

Knows nothing about requests, the KV cache or the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from shoal.engine.errors import ModelLoadError
from shoal.engine.kernels.quant_matmul import QuantizedWeight, QuantMatmulKernel
from shoal.engine.loader import LazyTensor
from shoal.engine.model.lora_layers import LoRAStack
from shoal.engine.model.rotary import RopeAngles as RopeAngles
from shoal.engine.model.rotary import RotaryEmbedding as RotaryEmbedding
from shoal.engine.model.rotary import rope_inv_freq as rope_inv_freq
from shoal.engine.parallel.tensor_parallel import SINGLE, Shard, TensorParallel


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised frozen parameter; `load_weights` fills it."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def can_pack_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN-packed weights are available: CPU, float32 or bfloat16."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


# A oneDNN packed matmul costs about 10 us more per call than `F.linear` and only wins once the
# weight is large (even at ~65k elements, ahead from ~200k; 4-64 rows, one thread, torch 2.13):
# smaller weights, as in tiny test models, stay dense.
MIN_PACKED_WEIGHT_NUMEL = 1 << 16


def is_worth_packing(weight: torch.Tensor) -> bool:
    return weight.numel() >= MIN_PACKED_WEIGHT_NUMEL


# Steps of at most this many rows read a projection's dense float32 weight, when it keeps one:
# MKL's GEMV streams it at ~13 GB/s on one core, oneDNN's packed matmul at ~9 (1.45x the time
# at 1 row, 1.33x at 2; from 4 rows packed is ahead, 0.67x; torch 2.13, AVX-512).
DENSE_GEMV_MAX_ROWS = 2

# A model whose packable float32 projections hold at most this many bytes (per worker) keeps
# their dense copies beside the packed ones for those steps; a larger one keeps only the packed
# copies, as the dense ones would double its weight memory.
MAX_DUAL_LAYOUT_BYTES = 2 << 30


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A oneDNN blocked copy of a [out, in] weight (an opaque mkldnn tensor)."""
    # The batch-size hint only picks the blocking; any number of rows works afterwards.
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")


def assign_blocks(
    slots: BlockSlots, blocks: Iterable[tuple[str, QuantizedWeight]], kernel: QuantMatmulKernel
) -> int:
    """Hands each projection the GGUF blocks of all its parts (a fused projection's parts are
    stacked in order); a projection missing a part, or whose parts differ in type, keeps its
    dense weight only. Returns how many projections took blocks.

    Args:
        slots: HF name → (projection, part index, number of parts).
        blocks: (HF name, blocks) pairs; names without a slot are ignored.
        kernel: the loaded kernel.

    Raises:
        ModelLoadError: blocks whose shape is not their projection's.
    """
    parts: dict[Linear, dict[int, QuantizedWeight]] = {}
    for name, weight in blocks:
        if name in slots:
            linear, index, _ = slots[name]
            parts.setdefault(linear, {})[index] = weight
    counts = {linear: count for linear, _, count in slots.values()}
    loaded = 0
    for linear, by_index in parts.items():
        if len(by_index) != counts[linear]:
            continue
        try:
            fused = QuantizedWeight.concat([by_index[i] for i in range(counts[linear])])
        except ValueError:
            continue
        linear.use_blocks(kernel, fused)
        loaded += 1
    return loaded


@runtime_checkable
class Packable(Protocol):
    def pack(self, keep_dense: bool = False) -> None:
        """Adds oneDNN-packed copies of the dense weights (CPU only; see `can_pack_weights`)
        and drops the dense ones unless `keep_dense` (see `MAX_DUAL_LAYOUT_BYTES`)."""


class Linear(nn.Module):
    """y = x W^T (+ b). The dense weight is what checkpoints load into (possibly by slices of a
    fused weight); on CPU `pack()` then adds oneDNN's blocked layout, which runs matmuls of 4
    to 64 rows markedly faster than the default BLAS path. Steps of 1 or 2 rows are faster on
    the dense weight (`DENSE_GEMV_MAX_ROWS`), which stays when the model is small enough."""

    weight: nn.Parameter  # absent once packed without `keep_dense`

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.packed: torch.Tensor | None = None
        self.keeps_dense = False  # with `packed`: the dense weight serves steps of few rows
        # The checkpoint's GGUF blocks, for steps of few rows (`shoal.engine.kernels.quant_matmul`).
        self.quantized: tuple[QuantMatmulKernel, QuantizedWeight] | None = None
        self.lora: LoRAStack | None = None  # the live adapters' A/B, when serving LoRA

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base(x)
        return y if self.lora is None else self.lora.add_to(x, y)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None and x.shape[0] <= self.quantized[0].max_rows:
            kernel, blocks = self.quantized
            return kernel.linear(x, blocks, self.bias)
        if self.packed is not None and (not self.keeps_dense or x.shape[0] > DENSE_GEMV_MAX_ROWS):
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def use_blocks(self, kernel: QuantMatmulKernel, blocks: QuantizedWeight) -> None:
        """Computes steps of at most `kernel.max_rows` rows from `blocks` (the same weights,
        as GGUF stores them); larger steps keep the dense weight.

        Raises:
            ModelLoadError: the blocks' shape is not this projection's.
        """
        expected = (self.out_features, self.in_features)
        if (blocks.out_features, blocks.in_features) != expected:
            raise ModelLoadError(
                f"quantized blocks of {blocks.out_features}x{blocks.in_features} for a "
                f"{expected[0]}x{expected[1]} projection"
            )
        self.quantized = (kernel, blocks)

    def pack(self, keep_dense: bool = False) -> None:
        if not is_worth_packing(self.weight):
            return
        self.packed = pack_weight(self.weight)
        self.keeps_dense = keep_dense and self.weight.dtype == torch.float32
        if not self.keeps_dense:
            # Only this module's reference goes: a tied embedding keeps its dense table.
            del self.weight


# HF tensor name → (the projection it is part of, its part index, the number of parts).
BlockSlots = dict[str, tuple[Linear, int, int]]


@dataclass(frozen=True)
class LoRATarget:
    """Where a LoRA adapter's A/B pair for one checkpoint module lands in this worker.

    Attributes:
        linear: the (possibly fused) projection the module is part of.
        part: its index among the projection's `num_parts` fused parts.
        num_parts: how many modules the projection fuses.
        out_start: the module's first output row in this worker's projection.
        out_rows: the rows of the full B this worker holds (column-parallel: its shard).
        in_cols: the columns of the full A this worker holds (row-parallel: its shard of the
            input; the partial update joins the output before the all-reduce), or None.
        full_shape: the module's full (out, in) features.
    """

    linear: Linear
    part: int
    num_parts: int
    out_start: int
    out_rows: Shard
    in_cols: Shard | None
    full_shape: tuple[int, int]


# Checkpoint module name ("model.layers.0.self_attn.q_proj") → its LoRA target.
LoRATargets = dict[str, LoRATarget]


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (the pre-norm decoder pattern)."""

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = empty_param(hidden_size, dtype=dtype, device=device)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual); without a residual, (norm(x), x)."""
        if residual is not None:
            # In place: the running residual is this layer's alone (the sum it returned last).
            x = residual.add_(x)
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Half precision: normalise in float32 and cast back before the weight, as HF does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores w, the scale is (1 + w), applied in float32."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class FeedForward(nn.Module):
    """The MLP slot of a decoder layer: dense, or a mixture of experts."""

    def weight_map(self, layer_prefix: str) -> WeightMap:
        """Where each HF tensor under `layer_prefix` (e.g. "model.layers.3") goes."""
        raise NotImplementedError

    def block_slots(self, layer_prefix: str) -> BlockSlots:
        """The projections that can compute from a checkpoint's GGUF blocks (none here)."""
        return {}

    def lora_targets(self, layer_prefix: str) -> LoRATargets:
        """The projections a LoRA adapter may adapt (none here)."""
        return {}


class GatedMLP(FeedForward):
    """down(act(gate(x)) * up(x)) with gate and up fused into one [2I, H] projection (act:
    SiLU unless given).

    Under tensor parallelism gate/up are column-parallel and down row-parallel: each worker
    holds a block of the width I and its partial outputs are summed by one all-reduce.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        tp: TensorParallel = SINGLE,
        module_name: str = "mlp",
        activation: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.tp = tp
        self.activation = activation or silu_and_mul
        self.module_name = module_name  # its checkpoint names: `{layer prefix}.{module_name}.*`
        self.width_shard = tp.shard(intermediate_size)
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = self.width_shard.size
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.gate_up_proj = Linear(hidden_size, 2 * self.intermediate_size, **kw)
        self.down_proj = Linear(self.intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        hidden = self.activation(gate_up, self.intermediate_size)
        return self.tp.all_reduce(self.down_proj(hidden))

    def block_slots(self, layer_prefix: str) -> BlockSlots:
        if self.tp.size > 1:  # GGUF blocks are whole rows of the full weight: dense shards only
            return {}
        prefix = f"{layer_prefix}.{self.module_name}"
        gate_up, down = self.gate_up_proj, self.down_proj
        return {
            f"{prefix}.gate_proj.weight": (gate_up, 0, 2),
            f"{prefix}.up_proj.weight": (gate_up, 1, 2),
            f"{prefix}.down_proj.weight": (down, 0, 1),
        }

    def lora_targets(self, layer_prefix: str) -> LoRATargets:
        """gate/up: column-parallel parts of gate_up_proj; down: row-parallel."""
        prefix, size = f"{layer_prefix}.{self.module_name}", self.intermediate_size
        hidden, full, shard = (
            self.down_proj.out_features,
            self.full_intermediate_size,
            self.width_shard,
        )
        gate_up, down = self.gate_up_proj, self.down_proj
        return {
            f"{prefix}.gate_proj": LoRATarget(gate_up, 0, 2, 0, shard, None, (full, hidden)),
            f"{prefix}.up_proj": LoRATarget(gate_up, 1, 2, size, shard, None, (full, hidden)),
            f"{prefix}.down_proj": LoRATarget(
                down, 0, 1, 0, Shard(0, hidden), shard, (hidden, full)
            ),
        }

    def weight_map(self, layer_prefix: str) -> WeightMap:
        """HF names under `{layer_prefix}.{module_name}`, each narrowed to this worker's block."""
        size, prefix = self.intermediate_size, f"{layer_prefix}.{self.module_name}"
        hidden, full = self.down_proj.out_features, self.full_intermediate_size
        shard = self.width_shard
        gate_up = self.gate_up_proj.weight
        wm = WeightMap()
        wm.add(f"{prefix}.gate_proj.weight", gate_up[:size], shape=(full, hidden), block=(0, shard))
        wm.add(f"{prefix}.up_proj.weight", gate_up[size:], shape=(full, hidden), block=(0, shard))
        down = self.down_proj.weight
        wm.add(f"{prefix}.down_proj.weight", down, shape=(hidden, full), block=(1, shard))
        return wm


def silu_and_mul(gate_up: torch.Tensor, size: int) -> torch.Tensor:
    out = F.silu(gate_up[..., :size])
    return out.mul_(gate_up[..., size:])


def gelu_tanh_and_mul(gate_up: torch.Tensor, size: int) -> torch.Tensor:
    """GELU (tanh approximation) of the gate times up: Gemma's gated MLP."""
    out = F.gelu(gate_up[..., :size], approximate="tanh")
    return out.mul_(gate_up[..., size:])


# Buffers some checkpoints still carry; they are recomputed here, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass
class _Entry:
    dest: torch.Tensor | None  # None: accepted and shape-checked, but not held by this rank
    shape: tuple[int, ...]
    select: Callable[[torch.Tensor], torch.Tensor] | None
    covers: tuple[str, ...]  # required names this tensor satisfies (itself when empty)
    block: tuple[int, Shard] | None = None  # (dim, shard): the only part read and copied


@dataclass
class WeightMap:
    """HF tensor name -> where its data goes (a param or a slice of a fused param).

    `required` names must all be covered after loading. An alias (e.g. a fused expert tensor)
    covers the required names it replaces, so a checkpoint may use either spelling. An entry
    with a `block` (a tensor-parallel shard) takes only that block of the checkpoint's tensor,
    and reads only that block from a `LazyTensor`; one without a destination reads nothing.
    """

    entries: dict[str, _Entry] = field(default_factory=dict)
    required: set[str] = field(default_factory=set)

    def add(
        self,
        name: str,
        dest: torch.Tensor | None,
        *,
        shape: tuple[int, ...] | None = None,
        select: Callable[[torch.Tensor], torch.Tensor] | None = None,
        covers: tuple[str, ...] = (),
        required: bool = True,
        block: tuple[int, Shard] | None = None,
    ) -> None:
        if shape is None:
            assert dest is not None, f"{name}: a skipped tensor needs an explicit shape"
            shape = tuple(dest.shape)
        self.entries[name] = _Entry(dest, shape, select, covers, block)
        if required:
            self.required.add(name)

    def update(self, other: WeightMap) -> None:
        self.entries.update(other.entries)
        self.required |= other.required

    def load(
        self, weights: Iterable[tuple[str, torch.Tensor | LazyTensor]], *, skip: set[str]
    ) -> None:
        """Copies every tensor into place (casting dtype), then checks that nothing is missing.

        Args:
            weights: (HF name, tensor or unread tensor) pairs.
            skip: names that are accepted and ignored (e.g. a tied lm_head).

        Raises:
            ModelLoadError: for an unknown name, a shape mismatch or a missing tensor.
        """
        covered: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name in skip or name.endswith(_IGNORED_SUFFIXES):
                    continue
                entry = self.entries.get(name)
                if entry is None:
                    raise ModelLoadError(
                        f"unexpected tensor {name!r} (shape {tuple(tensor.shape)})"
                    )
                if tuple(tensor.shape) != entry.shape:
                    raise ModelLoadError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {entry.shape}"
                    )
                if entry.dest is not None:
                    src = _read(tensor, entry.block)
                    entry.dest.copy_(entry.select(src) if entry.select is not None else src)
                covered.update(entry.covers or (name,))
        missing = sorted(self.required - covered)
        if missing:
            shown = ", ".join(f"{n} {self.entries[n].shape}" for n in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s): {shown}{more}")


def _read(tensor: torch.Tensor | LazyTensor, block: tuple[int, Shard] | None) -> torch.Tensor:
    if block is None:
        return tensor.read() if isinstance(tensor, LazyTensor) else tensor
    dim, shard = block
    if isinstance(tensor, LazyTensor):
        return tensor.read_block(dim, shard.start, shard.size)
    return shard.narrow(tensor, dim)
