"""The ranks' process groups: built from a TCPStore rendezvous without torch's default group,
destroyed and built again in the same process, and a clear error when a peer never joins;
subgroups of the same ranks side by side."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from shoal.engine.parallel.distributed import (
    ABORT_KEY,
    GroupJoinError,
    ProcessGroups,
    Rendezvous,
    connect_store,
    current_generation,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def store_port() -> int:
    master = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    store_port.master = master  # type: ignore[attr-defined]  # kept alive with the module
    return int(master.port)


def _rendezvous(port: int) -> Rendezvous:
    return Rendezvous("127.0.0.1", port, group_name=f"t-{uuid.uuid4().hex[:8]}")


def _on_ranks(world_size: int, body: Callable[[int], Any]) -> list[Any]:
    """Runs body(rank) on one thread per rank; returns the results by rank (re-raises)."""
    results: list[Any] = [None] * world_size

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as e:
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def test_groups_form_from_the_store_and_run_collectives(store_port: int) -> None:
    rendezvous = _rendezvous(store_port)

    def body(rank: int) -> tuple[int, list[int], list[int], list[float]]:
        groups = ProcessGroups.join(rendezvous, rank, 3, device=CPU, timeout_s=10)
        try:
            tensor = torch.full((2,), float(rank + 1))
            groups.device.allreduce([tensor]).wait()
            return (
                groups.generation,
                groups.all_reduce_max([rank, 5 - rank]),
                groups.all_gather_ints(10 * rank),
                tensor.tolist(),
            )
        finally:
            groups.destroy()

    results = _on_ranks(3, body)
    assert results == [(1, [2, 5], [0, 10, 20], [6.0, 6.0])] * 3
    assert not torch.distributed.is_initialized(), "no global default group was created"


def test_groups_are_rebuilt_in_process_and_a_restarted_rank_opens_a_new_generation(
    store_port: int,
) -> None:
    rendezvous = _rendezvous(store_port)

    def form(rank: int) -> int:
        groups = ProcessGroups.join(rendezvous, rank, 2, device=CPU, timeout_s=10)
        (total,) = groups.all_reduce_max([rank])
        groups.destroy()
        groups.destroy()  # idempotent
        return groups.generation * 10 + total

    assert _on_ranks(2, form) == [11, 11]
    # The same threads' process joins again: both were members, so generation 2 opens.
    assert _on_ranks(2, form) == [21, 21]


def test_a_survivor_sees_its_generation_superseded(store_port: int) -> None:
    rendezvous = _rendezvous(store_port)
    first = _on_ranks(2, lambda r: ProcessGroups.join(rendezvous, r, 2, device=CPU, timeout_s=10))
    assert not first[0].is_superseded()

    # Rank 1 restarts: it opens generation 2, and rank 0 follows it in the same process.
    def restart(rank: int) -> int:
        if rank == 1:
            groups = ProcessGroups.join(rendezvous, 1, 2, device=CPU, timeout_s=10)
        else:
            assert first[0].is_superseded() or _wait_superseded(first[0])
            first[0].destroy()
            generation = current_generation(first[0].store)
            groups = ProcessGroups.join(
                rendezvous, 0, 2, device=CPU, timeout_s=10, generation=generation
            )
        (value,) = groups.all_reduce_max([rank + 1])
        groups.destroy()
        return groups.generation * 10 + value

    assert _on_ranks(2, restart) == [22, 22]
    first[1].destroy()


def _wait_superseded(groups: ProcessGroups, timeout_s: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if groups.is_superseded():
            return True
        time.sleep(0.01)
    return False


def test_a_rank_whose_peer_never_joins_names_it(store_port: int) -> None:
    rendezvous = _rendezvous(store_port)
    with pytest.raises(GroupJoinError, match=r"rank 1 waited 1 s for rank\(s\) \[0, 2\]"):
        ProcessGroups.join(rendezvous, 1, 3, device=CPU, timeout_s=1)
    store = connect_store(rendezvous, 5)
    assert current_generation(store) == 1


def test_a_collective_with_a_dead_peer_fails_instead_of_hanging(store_port: int) -> None:
    rendezvous = _rendezvous(store_port)
    groups = _on_ranks(2, lambda r: ProcessGroups.join(rendezvous, r, 2, device=CPU, timeout_s=2))
    groups[1].destroy()  # rank 1 is gone; rank 0 still calls a collective
    with pytest.raises(RuntimeError):
        groups[0].all_reduce_max([1])
    groups[0].destroy()


def test_subgroups_of_the_same_ranks_form_apart_and_the_sets_abort_key_ends_their_joins(
    store_port: int,
) -> None:
    """The exchange groups of two TP indices: the same ranks at once, each group its own
    generations; the set's abort key (not the subgroup's) ends a subgroup's join."""
    rendezvous = _rendezvous(store_port)
    sub = replace(rendezvous, subgroup="tp1")

    def join_both(rank: int) -> tuple[ProcessGroups, ProcessGroups]:
        return (
            ProcessGroups.join(rendezvous, rank, 2, device=CPU, timeout_s=10),
            ProcessGroups.join(sub, rank, 2, device=CPU, timeout_s=10),
        )

    pairs = _on_ranks(2, join_both)
    # Each group sums only its own members' values.
    sums = _on_ranks(2, lambda r: [g.all_reduce_max([10 * i + r]) for i, g in enumerate(pairs[r])])
    assert sums == [[[1], [11]], [[1], [11]]]
    # Rank 1 restarts in the subgroup only: the subgroup opens generation 2, the set's stays 1.
    pairs[1][1].destroy()
    pairs[0][1].destroy()
    again = _on_ranks(2, lambda r: ProcessGroups.join(sub, r, 2, device=CPU, timeout_s=10))
    assert [g.generation for g in again] == [2, 2]
    assert [g.generation for g, _ in pairs] == [1, 1] and not pairs[0][0].is_superseded()
    for groups in [*again, *(g for g, _ in pairs)]:
        groups.destroy()
    # A join of a subgroup of a resized set ends once the set's abort key is set.
    resized = replace(sub, group_name=f"{rendezvous.group_name}-resized")
    connect_store(replace(resized, subgroup=""), 5).set(ABORT_KEY, "1")
    with pytest.raises(GroupJoinError, match="aborted"):
        ProcessGroups.join(resized, 0, 2, device=CPU, timeout_s=10, abort_key=ABORT_KEY)
