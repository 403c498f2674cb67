"""Tensor parallelism inside one rank: which slice of each weight a worker holds, and the
collectives that stitch the slices back together (`TensorParallel`).

Sharding (Megatron-style, as the layers in `shoal.engine.model` apply it):
- column-parallel projections (q/k/v, gate/up, each expert's gate/up) hold a contiguous block of
  output rows, so each worker computes its own heads / its own slice of the MLP width;
- row-parallel projections (o_proj, down_proj, each expert's down) hold the matching block of
  input columns; their partial outputs are summed by one all-reduce per projection;
- the embedding and the LM head hold a block of vocabulary rows, padded so every worker's block
  has the same size: the embedding zeroes the ids it does not hold and all-reduces, the LM head
  all-gathers its logits and drops the padding;
- KV heads are split like the query heads when there are at least as many as workers, else each
  worker holds the one KV head its query heads read (replicated across the workers sharing it).

The workers form their groups over `ProcessGroups` (`shoal.engine.parallel.distributed`): the
device group (NCCL on CUDA, gloo on CPU) carries the all-reduces and all-gathers, except that
CPU workers exchange tensors that fit a slot through shared memory (`ShmCollectives`: a
decode step's collectives). A collective that waits past the timeout raises in every worker
still alive.

Knows nothing of processes, models or the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.distributed import ProcessGroups
from shoal.engine.parallel.shm_collectives import ShmCollectives


def check_tensor_parallel(arch: ModelArch, tensor_parallel_size: int) -> None:
    """Refuses a TP size this model cannot be split by, saying why.

    Raises:
        ValueError: a size below 1, or one that does not divide the attention heads, the KV
            heads (or is not a multiple of them when larger) or an MLP's width.
    """
    tp = tensor_parallel_size
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}")
    if tp == 1:
        return
    heads, kv_heads = arch.num_attention_heads, arch.num_kv_cache_heads
    if heads % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} does not divide the model's {heads} attention heads"
        )
    if kv_heads >= tp and kv_heads % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} does not divide the model's {kv_heads} KV heads"
        )
    if kv_heads < tp and tp % kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp} is not a multiple of the model's {kv_heads} KV heads "
            "(each KV head is replicated over a whole number of workers)"
        )
    widths = {"MLP width": arch.intermediate_size}
    if arch.is_moe:
        widths = {"expert MLP width": arch.expert_intermediate_size}
        if arch.mlp_only_layers:
            widths["MLP width"] = arch.intermediate_size
        if arch.num_shared_experts:
            widths["shared experts' width"] = (
                arch.num_shared_experts * arch.expert_intermediate_size
            )
    for what, width in widths.items():
        if width % tp:
            raise ValueError(
                f"tensor_parallel_size {tp} does not divide the model's {what} {width}"
            )


@dataclass(frozen=True)
class Shard:
    """A contiguous block `[start, start + size)` of one dimension of a full weight."""

    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size

    def narrow(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return tensor.narrow(dim, self.start, self.size)


class TensorParallel:
    """One worker's place in its rank's TP group, and the group's collectives.

    Args:
        rank: this worker's index in [0, size).
        size: workers in the group.
        groups: the group's process groups; None only when `size` is 1.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        groups: ProcessGroups | None = None,
        shm: ShmCollectives | None = None,
    ) -> None:
        assert 0 <= rank < size, f"TP rank {rank} outside [0, {size})"
        assert groups is not None or size == 1, "a TP group of several workers needs groups"
        self.rank = rank
        self.size = size
        self.groups = groups
        self.shm = shm

    @property
    def is_driver(self) -> bool:
        """Whether this worker samples and answers the engine core (rank 0)."""
        return self.rank == 0

    def shard(self, total: int) -> Shard:
        """This worker's equal block of `total` (which the size divides)."""
        assert total % self.size == 0, f"{total} does not split over {self.size} workers"
        size = total // self.size
        return Shard(self.rank * size, size)

    def vocab_shard(self, vocab_size: int) -> tuple[Shard, int]:
        """(the vocabulary rows this worker holds, its padded block size): blocks are
        ceil(V / size) rows, the last ones shorter (or empty) in the checkpoint."""
        padded = -(-vocab_size // self.size)
        start = min(self.rank * padded, vocab_size)
        return Shard(start, min(padded, vocab_size - start)), padded

    def kv_head_shard(self, num_kv_heads: int) -> Shard:
        """The KV heads this worker holds: an equal block, or the one its query heads read."""
        if num_kv_heads >= self.size:
            return self.shard(num_kv_heads)
        return Shard(self.rank * num_kv_heads // self.size, 1)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the workers, in place; returns it."""
        if self.size > 1:
            if self.shm is not None and self.shm.fits(tensor):
                return self.shm.all_reduce(tensor)
            assert self.groups is not None
            self.groups.device.allreduce([tensor]).wait()
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every worker's `tensor` side by side along the last dimension, by rank."""
        if self.size == 1:
            return tensor
        if self.shm is not None and self.shm.fits(tensor):
            return self.shm.all_gather_last(tensor)
        assert self.groups is not None
        local = tensor.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        self.groups.device.allgather([parts], [local]).wait()
        return torch.cat(parts, dim=-1)

    def destroy(self) -> None:
        """Releases the groups; collectives in flight on them fail. Idempotent."""
        if self.shm is not None:
            self.shm.close()
        if self.groups is not None:
            self.groups.destroy()


SINGLE = TensorParallel(0, 1)
"""The context of a model that is not split: every shard is the whole."""
