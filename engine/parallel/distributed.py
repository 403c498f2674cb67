"""The process groups of an expert-parallel cluster, built without torch's global default group.

A cluster's ranks meet at a rendezvous: a `torch.distributed.TCPStore` whose address the control
plane hands out (`Rendezvous`). Each rank builds two groups from it by constructing the
process-group objects directly, so nothing is registered process-wide and a rank can `destroy()`
its groups and build new ones in the same process (a peer restarted, the cluster resized):

- `cpu`: gloo, for small state syncs (does any rank still have work? which wave is this?);
- `device`: the MoE exchange — NCCL on CUDA, gloo on CPU.

Generations. Every (re)formation of the groups is one generation, numbered in the store's
`generation` key; its keys live under `gen/<g>/`. A rank that starts joins the current
generation unless it was already a member of it — then it is a restart, and it opens the next
one. Survivors see the key move (`is_superseded`) and join the new generation too. Joining
waits for every rank's `gen/<g>/member/<r>` key, up to a timeout, or until an abort key
(`ABORT_KEY`) is set; a rank that cannot join raises `GroupJoinError` naming itself and the
peers it waited for. A resized set of ranks forms its groups under a rendezvous prefix of its
own (`Rendezvous.group_name`), so the old set's generations are never touched. Several groups
formed by the same ranks side by side (the MoE exchange of each tensor-parallel index) each keep
their keys, and count their generations, under a subgroup prefix of their own
(`Rendezvous.subgroup`); the abort key stays the set's, so one key ends every join of the set.

Knows nothing of Ray, sockets or models: the caller brings the rendezvous, uses the groups.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import PrefixStore, Store, TCPStore

logger = logging.getLogger(__name__)

_GENERATION_KEY = "generation"
# Set (by the control plane) in a group's store to end every join still waiting there: a
# resize that is rolled back.
ABORT_KEY = "aborted"
# A c10d backend object (ProcessGroupGloo, ProcessGroupNCCL) used directly, never registered
# as a torch process group; torch's type stubs do not declare its collectives.
Group = Any
_JOIN_POLL_S = 0.01


class GroupJoinError(RuntimeError):
    """A rank could not form its process groups: a peer never joined within the timeout."""


@dataclass(frozen=True)
class Rendezvous:
    """Where a cluster's ranks meet: a TCPStore served by the control plane.

    Attributes:
        host: the store's address.
        port: the store's port.
        group_name: keys of this cluster live under it (one store can serve several).
        bind_host: the address this rank's gloo connections use (its own node's).
        subgroup: one of several groups the same ranks form side by side: its keys live
            under `<group_name>/<subgroup>/` ("": the set's own group).
    """

    host: str
    port: int
    group_name: str = "shoal"
    bind_host: str = "127.0.0.1"
    subgroup: str = ""


def connect_store(rendezvous: Rendezvous, timeout_s: float) -> Store:
    """A client of the rendezvous store, with this cluster's key prefix."""
    store = TCPStore(
        rendezvous.host,
        rendezvous.port,
        None,
        False,
        timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return PrefixStore(f"{rendezvous.group_name}/", store)


def current_generation(store: Store) -> int:
    """The store's current generation (0 before any rank has joined)."""
    if not store.check([_GENERATION_KEY]):
        return 0
    return int(store.get(_GENERATION_KEY).decode())


def choose_generation(store: Store, rank: int) -> int:
    """The generation a starting rank joins: the current one, or the next if it was a member.

    Every rank of a fresh cluster gets generation 1. A rank that was already a member of the
    current generation is a restart: it opens the next one (atomically; a peer that opened it
    first wins and the rank joins that).
    """
    generation = int(store.compare_set(_GENERATION_KEY, "", "1").decode())
    if store.check([_member_key(generation, rank)]):
        opened = store.compare_set(_GENERATION_KEY, str(generation), str(generation + 1))
        generation = int(opened.decode())
    return generation


class ProcessGroups:
    """One rank's CPU and device groups of one generation.

    Build with `ProcessGroups.join`; `destroy()` releases them (idempotent), after which the
    rank may join a newer generation in the same process.
    """

    def __init__(
        self,
        store: Store,
        generation: int,
        rank: int,
        world_size: int,
        cpu: Group,
        device: Group,
        device_type: str,
    ) -> None:
        self.store = store
        self.generation = generation
        self.rank = rank
        self.world_size = world_size
        self.cpu = cpu
        self.device = device
        self.device_type = device_type
        self._is_destroyed = False

    @classmethod
    def join(
        cls,
        rendezvous: Rendezvous,
        rank: int,
        world_size: int,
        *,
        device: torch.device,
        timeout_s: float,
        join_timeout_s: float | None = None,
        generation: int | None = None,
        abort_key: str | None = None,
    ) -> ProcessGroups:
        """Joins a generation (default: `choose_generation`) and builds both groups.

        Args:
            rendezvous: the cluster's store.
            rank: this rank, in [0, world_size).
            world_size: how many ranks form the groups.
            device: the device the MoE exchange runs on (cuda: NCCL, else gloo).
            timeout_s: how long any collective may wait for a peer.
            join_timeout_s: how long to wait for the peers to join; default `timeout_s`.
            generation: join exactly this generation (a survivor following a restart).
            abort_key: a key that, once set in the store, ends the wait for peers.

        Raises:
            GroupJoinError: a peer did not join within `join_timeout_s`, or `abort_key` was set.
        """
        assert 0 <= rank < world_size, f"rank {rank} outside [0, {world_size})"
        join_timeout_s = timeout_s if join_timeout_s is None else join_timeout_s
        root = connect_store(rendezvous, join_timeout_s)
        store = PrefixStore(f"{rendezvous.subgroup}/", root) if rendezvous.subgroup else root
        if generation is None:
            generation = choose_generation(store, rank)
        generation = _await_peers(
            store, generation, rank, world_size, join_timeout_s, abort_key, abort_store=root
        )
        timeout = timedelta(seconds=timeout_s)
        gen_store = PrefixStore(f"gen/{generation}/", store)
        cpu = _gloo_group(PrefixStore("cpu/", gen_store), rank, world_size, rendezvous, timeout)
        if device.type == "cuda":
            dev = _nccl_group(PrefixStore("nccl/", gen_store), rank, world_size, device, timeout)
        else:
            dev = _gloo_group(PrefixStore("dev/", gen_store), rank, world_size, rendezvous, timeout)
        logger.info("rank %d joined generation %d of %d ranks", rank, generation, world_size)
        return cls(store, generation, rank, world_size, cpu, dev, device.type)

    def is_superseded(self) -> bool:
        """Whether a newer generation has been opened (a peer restarted): rejoin."""
        return current_generation(self.store) > self.generation

    def all_reduce_max(self, values: list[int]) -> list[int]:
        """Element-wise maximum over ranks, on the CPU group."""
        tensor = torch.tensor(values, dtype=torch.int64)
        opts = torch.distributed.AllreduceOptions()
        opts.reduceOp = torch.distributed.ReduceOp(torch.distributed.ReduceOp.MAX)
        self.cpu.allreduce([tensor], opts).wait()
        return [int(v) for v in tensor.tolist()]

    def all_gather_ints(self, value: int) -> list[int]:
        """One int from every rank, by rank, on the CPU group."""
        local = torch.tensor([value], dtype=torch.int64)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        self.cpu.allgather([gathered], [local]).wait()
        return [int(t.item()) for t in gathered]

    def destroy(self) -> None:
        """Releases both groups; idempotent. Collectives in flight on them fail."""
        if self._is_destroyed:
            return
        self._is_destroyed = True
        for group in {id(self.cpu): self.cpu, id(self.device): self.device}.values():
            try:
                group.shutdown()
            except Exception as e:  # a group already broken by a dead peer
                logger.debug("rank %d: group shutdown: %s", self.rank, e)


def _member_key(generation: int, rank: int) -> str:
    return f"gen/{generation}/member/{rank}"


def _await_peers(
    store: Store,
    generation: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    abort_key: str | None = None,
    abort_store: Store | None = None,
) -> int:
    """Announces this rank in `generation` and waits for every peer; follows a newer one;
    gives up once `abort_key` is set in `abort_store` (default: `store`).

    Returns:
        The generation every rank joined.

    Raises:
        GroupJoinError: naming this rank and the peers still missing at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    store.set(_member_key(generation, rank), "1")
    keys = [_member_key(generation, r) for r in range(world_size)]
    while not store.check(keys):
        newest = current_generation(store)
        if newest > generation:  # a peer restarted meanwhile: everyone moves on
            generation = newest
            store.set(_member_key(generation, rank), "1")
            keys = [_member_key(generation, r) for r in range(world_size)]
            continue
        aborts = store if abort_store is None else abort_store
        if abort_key is not None and aborts.check([abort_key]):
            raise GroupJoinError(f"rank {rank}: joining generation {generation} was aborted")
        if time.monotonic() >= deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            raise GroupJoinError(
                f"rank {rank} waited {timeout_s:.0f} s for rank(s) {missing} to join "
                f"generation {generation} of {world_size} ranks"
            )
        time.sleep(_JOIN_POLL_S)
    return generation


def _gloo_group(
    store: Store, rank: int, world_size: int, rendezvous: Rendezvous, timeout: timedelta
) -> Group:
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=rendezvous.bind_host)]
    return ProcessGroupGloo(store, rank, world_size, options)


def _nccl_group(
    store: Store, rank: int, world_size: int, device: torch.device, timeout: timedelta
) -> Group:
    """An NCCL group on `device`, built eagerly so a peer that cannot join fails the start."""
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    group: Group = ProcessGroupNCCL(store, rank, world_size, options)
    torch.cuda.set_device(device)
    # The communicator forms on the first collective: do one now, inside the join timeout.
    probe = torch.zeros(1, device=device)
    group.allreduce([probe]).wait()
    torch.cuda.synchronize(device)
    return group
