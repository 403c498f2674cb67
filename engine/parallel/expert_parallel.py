"""Expert parallelism: which rank holds which expert (`ExpertPlacement`, plain data) and the MoE
exchange across the ranks (`ExpertParallel`).

Placement. A table expert → rank. The default (`ExpertPlacement.contiguous`) gives each rank a
contiguous block of experts; when N ranks do not divide E experts, the first `E % N` ranks hold
one expert more (E=8 over N=3: ranks hold 3, 3, 2). Any table with every rank holding at least
one expert is valid, so a resize can hand out a new one.

Exchange: all-gather + reduce-scatter. In each MoE layer every rank gathers the hidden states of
every rank's tokens (padded to the largest batch), routes them (the router is replicated, so all
ranks agree on the routing without exchanging it), runs its own experts over the tokens routed
to them, and a reduce-scatter sums the partial outputs and hands each rank back its own rows.
Chosen over all-to-all dispatch/combine for the device path: two collectives with shapes fixed
for the whole step, no permutation, and no per-layer host round trip for split sizes (an
all-to-all must know the counts on the host to size its buffers: a device sync per layer on
CUDA). The price is volume — every rank receives every token, where an all-to-all moves each
token only to the ranks of its top-k experts — and on the CPU over gloo the all-to-all is the
cheaper exchange (`bench/expert_parallel.py` measures both); `exchange` is the one place a
different exchange would go.

Per forward, `begin_forward` all-gathers every rank's token count once (CPU group) so every
layer knows the shapes; a forward in which no rank has a token skips the layers' collectives.
A rank with nothing to run still joins each layer's exchange with an empty batch
(`run_dummy_forward`): its experts serve the other ranks' tokens.

Groups. An `ExpertParallel` is one process's side. The DP waves and resizes reach a rank's
sides through `ExpertWorkers`: a rank of one worker is its own `ExpertParallel`; under tensor
parallelism every worker has one (its experts narrowed to its width block), and the executor
fans each call out to all of them. The hidden states are replicated across a rank's TP
workers, so each TP index exchanges on its own: the exchange group of TP index i is the i-th
worker of every rank (`exchange_rendezvous`), and the TP all-reduce after the exchange sums the
width blocks. Summed over ranks, then over blocks, that is the whole layer's output.

Re-sharding at a resize, in two steps. `stage` builds, beside the live weights, every MoE
layer's weights for the experts the rank holds under a new placement: held experts are copied
from the live tensors (oneDNN-packed ones are shared as they are: nothing ever writes them), the
others are read from the checkpoint, only their tensors. It reads the live weights and writes
only new tensors, so it may run on a background thread while forwards go on. `commit` swaps
the stage in, on the busy-loop thread between forwards while the rank is unbound from its
groups; the old weights are released then. Dropping a `StagedExperts` instead is the rollback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from shoal.engine.config import EngineConfig
from shoal.engine.errors import ModelLoadError
from shoal.engine.loader import SafetensorsReader, is_gguf_path
from shoal.engine.model_arch import ModelArch
from shoal.engine.parallel.distributed import ProcessGroups, Rendezvous


@dataclass(frozen=True)
class ExpertPlacement:
    """Expert → rank table of one MoE model over `num_ranks` ranks (the same for every layer)."""

    expert_to_rank: tuple[int, ...]
    num_ranks: int

    def __post_init__(self) -> None:
        held = set(self.expert_to_rank)
        if any(not 0 <= r < self.num_ranks for r in held) or len(held) != self.num_ranks:
            raise ValueError(
                f"every one of {self.num_ranks} ranks must hold an expert: {self.expert_to_rank}"
            )

    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int) -> ExpertPlacement:
        """Contiguous blocks; the first `num_experts % num_ranks` ranks hold one more.

        Raises:
            ValueError: more ranks than experts (some rank would hold none).
        """
        if not 0 < num_ranks <= num_experts:
            raise ValueError(
                f"expert parallelism over {num_ranks} ranks needs 1..{num_experts} ranks "
                f"(the model has {num_experts} experts)"
            )
        base, extra = divmod(num_experts, num_ranks)
        table: list[int] = []
        for rank in range(num_ranks):
            table += [rank] * (base + (1 if rank < extra else 0))
        return cls(tuple(table), num_ranks)

    @property
    def num_experts(self) -> int:
        return len(self.expert_to_rank)

    def experts_of(self, rank: int) -> list[int]:
        """The experts `rank` holds, ascending."""
        return [e for e, r in enumerate(self.expert_to_rank) if r == rank]

    def as_dict(self) -> dict[int, list[int]]:
        """rank → its experts (for status displays)."""
        return {rank: self.experts_of(rank) for rank in range(self.num_ranks)}


def check_expert_parallel(arch: ModelArch, num_ranks: int) -> None:
    """Whether a model can be served expert-parallel over `num_ranks` ranks.

    Raises:
        ValueError: a dense model, or more ranks than experts.
    """
    if not arch.is_moe:
        raise ValueError(
            f"--enable-expert-parallel needs a mixture-of-experts model; {arch.architecture} "
            "is dense"
        )
    if num_ranks > arch.num_local_experts:
        raise ValueError(
            f"--enable-expert-parallel over {num_ranks} ranks needs at least as many experts; "
            f"the model has {arch.num_local_experts}"
        )


def make_expert_parallel(config: EngineConfig, arch: ModelArch) -> ExpertParallel | None:
    """A worker's expert-parallel context when `config` asks for expert parallelism over
    several ranks (every TP worker of a rank builds its own, alike).

    Raises:
        ValueError: expert parallelism on a dense model, or over more ranks than experts.
    """
    parallel = config.parallel
    if not parallel.enable_expert_parallel:
        return None
    check_expert_parallel(arch, parallel.data_parallel_size)
    if parallel.data_parallel_size == 1:
        return None  # one rank holds every expert: nothing to exchange
    placement = ExpertPlacement.contiguous(arch.num_local_experts, parallel.data_parallel_size)
    return ExpertParallel(placement, parallel.data_parallel_rank)


LocalCompute = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, eq=False)
class StagedLayerExperts:
    """One MoE layer's weights for a new set of experts, in that layer's layout.

    Dense: `w13` [n, 2I, H] (gate and up fused) and `w2` [n, H, I]; packed: one oneDNN-packed
    (gate_up, down) pair per expert, those of experts the layer already held shared with it.
    Experts with biases (gpt-oss) have `w13_bias` [n, 2I] and `w2_bias` [n, H] either way.
    """

    expert_ids: tuple[int, ...]
    w13: torch.nn.Parameter | None = None
    w2: torch.nn.Parameter | None = None
    packed: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    w13_bias: torch.nn.Parameter | None = None
    w2_bias: torch.nn.Parameter | None = None


@dataclass(frozen=True, eq=False)
class StagedExperts:
    """A rank's experts under a new placement, built by `ExpertParallel.stage` beside the live
    ones; `ExpertParallel.commit` swaps them in, and dropping this object discards them."""

    placement: ExpertPlacement
    rank: int
    layers: tuple[StagedLayerExperts, ...]  # one per MoE layer, in forward order


class MoELayer(Protocol):
    """What `ExpertParallel` needs of an MoE layer: a forward, and re-staging its experts."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def stage_experts(
        self, expert_ids: Sequence[int], reader: SafetensorsReader
    ) -> StagedLayerExperts:
        """This layer's weights for `expert_ids`: held ones copied, the others read."""
        ...

    def commit_experts(self, staged: StagedLayerExperts) -> None:
        """Swaps the staged weights in, releasing the old ones."""
        ...


def exchange_rendezvous(rendezvous: Rendezvous, tp_rank: int) -> Rendezvous:
    """Where TP index `tp_rank` of every rank forms its exchange group: the set's own group for
    index 0 (whose groups also carry the DP waves), a subgroup `tp<i>` for the others."""
    return rendezvous if tp_rank == 0 else replace(rendezvous, subgroup=f"tp{tp_rank}")


class ExpertWorkers(Protocol):
    """A rank's sides of the MoE exchange as its DP waves and resizes reach them: each call
    runs on every worker of the rank (one `ExpertParallel`, or each TP worker's)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def num_forwards(self) -> int:
        """Forwards the rank has joined (real or dummy)."""
        ...

    def join_groups(
        self,
        rendezvous: Rendezvous,
        world_size: int,
        *,
        timeout_s: float,
        join_timeout_s: float,
        generation: int | None = None,
        abort_key: str | None = None,
    ) -> ProcessGroups:
        """Every worker forms (does not bind) its exchange group of `world_size` ranks.

        Returns:
            TP index 0's groups, which also carry the DP waves.

        Raises:
            GroupJoinError: a peer did not join in time, or the join was aborted.
        """
        ...

    def bind_joined(self) -> None:
        """Every worker starts exchanging over the groups it joined last."""
        ...

    def leave_groups(self) -> None:
        """Every worker unbinds and destroys its groups; idempotent."""
        ...

    def run_dummy_forward(self) -> None: ...

    def stage(self, placement: ExpertPlacement, rank: int, model_path: str) -> StagedExperts:
        """Every worker builds its experts under `placement` beside the live ones (forwards
        may go on meanwhile, from another thread); returns the stage, for `commit` or
        `discard`.

        Raises:
            ValueError, ModelLoadError: as `ExpertParallel.stage`; a worker's, as its
                executor reports it.
        """
        ...

    def commit(self, staged: StagedExperts) -> None:
        """Every worker swaps its stage in (between forwards, the groups unbound)."""
        ...

    def discard(self, staged: StagedExperts) -> None:
        """Every worker drops its stage (the resize was rolled back); any thread."""
        ...


class ExpertParallel:
    """One rank's side of the MoE exchange: its placement, its groups, this forward's shapes.

    Built before the model (the placement decides which experts it loads); the groups are bound
    later (`bind`), and may be unbound and bound again (a peer restarted) in the same process.

    Args:
        placement: the expert → rank table.
        rank: this rank.
    """

    def __init__(self, placement: ExpertPlacement, rank: int) -> None:
        self.placement = placement
        self.rank = rank
        self.groups: ProcessGroups | None = None
        # The model's MoE layers in forward order: for forwards with no local tokens, and to
        # re-stage their experts at a resize.
        self.moe_layers: list[MoELayer] = []
        self.hidden_size = 0
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        self.num_forwards = 0  # forwards joined (real or dummy), for the wave loop
        self._joined: ProcessGroups | None = None  # formed by `join_groups`, maybe not bound
        self._counts: list[int] = []
        self._valid_rows: torch.Tensor | None = None

    @property
    def local_expert_ids(self) -> list[int]:
        return self.placement.experts_of(self.rank)

    @property
    def world_size(self) -> int:
        return self.placement.num_ranks

    def bind(self, groups: ProcessGroups) -> None:
        assert groups.world_size == self.world_size, "groups and placement disagree on N"
        self.groups = groups

    def unbind(self) -> None:
        self.groups = None

    def join_groups(
        self,
        rendezvous: Rendezvous,
        world_size: int,
        *,
        timeout_s: float,
        join_timeout_s: float,
        generation: int | None = None,
        abort_key: str | None = None,
    ) -> ProcessGroups:
        """Forms this side's groups of `world_size` ranks (see `ExpertWorkers.join_groups`)."""
        self._joined = ProcessGroups.join(
            rendezvous,
            self.rank,
            world_size,
            device=self.device,
            timeout_s=timeout_s,
            join_timeout_s=join_timeout_s,
            generation=generation,
            abort_key=abort_key,
        )
        return self._joined

    @property
    def joined_groups(self) -> ProcessGroups | None:
        """The groups `join_groups` formed last (bound or not), until `leave_groups`."""
        return self._joined

    def bind_joined(self) -> None:
        assert self._joined is not None, "join_groups first"
        self.bind(self._joined)

    def leave_groups(self) -> None:
        groups = self._joined or self.groups
        self._joined = self.groups = None
        if groups is not None:
            groups.destroy()

    def register_layer(self, layer: MoELayer, hidden_size: int) -> None:
        """Called by each MoE layer at construction, in forward order."""
        self.moe_layers.append(layer)
        self.hidden_size = hidden_size

    def begin_forward(self, num_tokens: int) -> None:
        """Learns every rank's token count for this forward (one small CPU collective).

        Raises:
            RuntimeError: the rank has no groups (expert parallelism outside a cluster).
        """
        if self.groups is None:
            raise RuntimeError(
                "this expert-parallel rank has no process groups: an expert-parallel model is "
                "served by a cluster (shoal serve, shoal.cluster.launch)"
            )
        self.num_forwards += 1
        counts = self.groups.all_gather_ints(num_tokens)
        self._counts = counts
        padded = max(counts)
        rows = [torch.arange(r * padded, r * padded + c) for r, c in enumerate(counts) if c]
        self._valid_rows = torch.cat(rows).to(self.device) if rows else None

    def run_dummy_forward(self) -> None:
        """Joins one forward with no tokens of its own: every layer's exchange, if any rank
        has tokens."""
        self.begin_forward(0)
        if self._valid_rows is None:
            return
        empty = torch.empty(0, self.hidden_size, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            for layer in self.moe_layers:
                layer(empty)

    def exchange(self, x: torch.Tensor, compute: LocalCompute) -> torch.Tensor:
        """One MoE layer across the ranks: `compute` (route + local experts) over every rank's
        tokens; returns the summed expert output for this rank's tokens [T, hidden]."""
        groups = self.groups
        assert groups is not None, "expert-parallel groups are not bound"
        valid = self._valid_rows
        if valid is None:  # no rank has a token this forward
            return torch.zeros_like(x)
        num_tokens, padded = x.shape[0], max(self._counts)
        assert num_tokens == self._counts[self.rank], "begin_forward saw another batch size"
        send = x.new_zeros(padded, x.shape[1])
        send[:num_tokens] = x
        gathered = x.new_empty(padded * self.world_size, x.shape[1])
        groups.device._allgather_base(gathered, send).wait()
        partial = compute(gathered.index_select(0, valid))
        full = x.new_zeros(padded * self.world_size, x.shape[1])
        full.index_copy_(0, valid, partial)
        out = x.new_empty(padded, x.shape[1])
        groups.device._reduce_scatter_base(
            out, full, torch.distributed.ReduceScatterOptions()
        ).wait()
        return out[:num_tokens]

    def stage(self, placement: ExpertPlacement, rank: int, model_path: str) -> StagedExperts:
        """Builds every MoE layer's weights for the experts `rank` holds under `placement`.

        Experts the layers hold now are copied from their live tensors; the others are read
        from `model_path`, only their tensors. Safe on a background thread while forwards run
        with the live experts: it reads those and writes only new tensors. The new weights
        exist beside the old until `commit`.

        Args:
            placement: the new expert → rank table.
            rank: this rank's index under `placement` (it may differ from `self.rank`).
            model_path: the checkpoint (safetensors directory or file) the model was loaded from.

        Returns:
            The stage, for `commit`; dropping it discards it.

        Raises:
            ValueError: `rank` holds no expert under `placement`, or the placement is for
                another number of experts.
            ModelLoadError: the checkpoint lacks a needed tensor, or cannot be read.
        """
        if placement.num_experts != self.placement.num_experts:
            raise ValueError(
                f"the placement has {placement.num_experts} experts, the model "
                f"{self.placement.num_experts}"
            )
        expert_ids = placement.experts_of(rank)
        if not expert_ids:
            raise ValueError(f"rank {rank} holds no expert under {placement.as_dict()}")
        if is_gguf_path(model_path):
            raise ModelLoadError(f"{model_path}: experts are re-staged from safetensors only")
        with SafetensorsReader(model_path) as reader:
            layers = tuple(layer.stage_experts(expert_ids, reader) for layer in self.moe_layers)
        return StagedExperts(placement, rank, layers)

    def commit(self, staged: StagedExperts) -> None:
        """Swaps a stage in: the placement, the rank, and every layer's experts and weights.

        Call on the busy-loop thread between forwards, with the rank unbound (`unbind` before,
        `bind` to groups of the new size after). The old weights are released here.
        """
        assert self.groups is None, "experts are swapped only while the rank is unbound"
        assert len(staged.layers) == len(self.moe_layers), "the stage is of another model"
        for layer, weights in zip(self.moe_layers, staged.layers, strict=True):
            layer.commit_experts(weights)
        self.placement, self.rank = staged.placement, staged.rank
        self._counts, self._valid_rows = [], None

    def discard(self, staged: StagedExperts) -> None:
        """Nothing to do: a stage's tensors go with the last reference to it."""
