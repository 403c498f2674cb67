"""`TPExpertWorkers`: a TP rank's MoE exchange, as its DP waves and resizes reach it.

Every worker of the rank holds the rank's experts, each narrowed to its block of the experts'
width, and its own `ExpertParallel`. What the DP waves do to a rank's exchange (form, bind and
leave the groups, run a dummy forward) is one executor call that runs on every worker at once
(`Worker.join_expert_groups` and its siblings); each worker joins the exchange group of its TP
index (`exchange_rendezvous`). The driver's side answers for the rank: its groups carry the
waves, its forward count is the rank's.

At a resize every worker stages its width block of the rank's new experts on a thread of its
own while the rank serves (the driver polls until all are built); the switch commits every
worker's stage, and a rolled-back resize discards them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from shoal.engine.parallel.distributed import ProcessGroups, Rendezvous
from shoal.engine.parallel.expert_parallel import ExpertParallel, ExpertPlacement, StagedExperts

# Runs a worker method on every worker of the rank, the driver's first; one result each. Any
# thread may call it (the executor serializes the calls with the steps).
CallAll = Callable[[str, tuple[Any, ...]], list[Any]]
# How often the driver asks whether every worker's stage is built.
STAGE_POLL_S = 0.05


class TPExpertWorkers:
    """`ExpertWorkers` over every worker of a tensor-parallel rank.

    Args:
        driver: the driver worker's expert-parallel context (in this process).
        call_all: runs a `Worker` method on every worker (`MultiprocExecutor`'s).
    """

    def __init__(self, driver: ExpertParallel, call_all: CallAll) -> None:
        self._driver = driver
        self._call_all = call_all

    @property
    def rank(self) -> int:
        return self._driver.rank

    @property
    def world_size(self) -> int:
        return self._driver.world_size

    @property
    def num_forwards(self) -> int:
        return self._driver.num_forwards

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
        args = (
            msgspec.to_builtins(rendezvous),
            world_size,
            timeout_s,
            join_timeout_s,
            generation,
            abort_key,
        )
        self._call_all("join_expert_groups", args)  # every TP index's group forms at once
        groups = self._driver.joined_groups
        assert groups is not None, "the driver joined its group"
        return groups

    def bind_joined(self) -> None:
        self._call_all("bind_expert_groups", ())

    def leave_groups(self) -> None:
        self._call_all("leave_expert_groups", ())

    def run_dummy_forward(self) -> None:
        self._call_all("run_dummy_forward", ())

    def stage(self, placement: ExpertPlacement, rank: int, model_path: str) -> StagedExperts:
        """Every worker stages its width block of the experts `rank` holds under `placement`
        on a thread of its own; this waits (polling) until all are built.

        Returns:
            A receipt for `commit` / `discard`: the tensors stay in each worker.

        Raises:
            ValueError, ModelLoadError: the driver's staging failed.
            WorkerError: another worker's did.
        """
        args = (list(placement.expert_to_rank), placement.num_ranks, rank, model_path)
        self._call_all("start_staging_experts", args)
        try:
            while not all(self._call_all("is_staging_done", ())):
                time.sleep(STAGE_POLL_S)
        except Exception:
            self._call_all("drop_staged_experts", ())  # what the other workers built
            raise
        return StagedExperts(placement, rank, layers=())

    def commit(self, staged: StagedExperts) -> None:
        self._call_all("commit_staged_experts", ())

    def discard(self, staged: StagedExperts) -> None:
        self._call_all("drop_staged_experts", ())
