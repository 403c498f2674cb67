"""The switch of a resize, on real gloo groups over a real TCPStore: the ranks agree on one
forward (paused or mid-wave), a rank with work that decides first runs its wave, a set that
does not form rolls back to the old one, and an aborted join ends at once. And a dense rank
that leaves: its requests, and later ones, are released to their client."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
from torch.distributed import PrefixStore, TCPStore

from shoal.engine.parallel.distributed import ABORT_KEY, Rendezvous
from shoal.engine.parallel.dp_wave import SYNC_INTERVAL, DPWave
from shoal.engine.parallel.elastic import (
    SHUTDOWN_COMPLETE,
    PendingScale,
    ScaleNotice,
    ScalePlan,
    SwitchOutcome,
)
from shoal.engine.parallel.expert_parallel import ExpertParallel, ExpertPlacement
from shoal.engine.protocol import EEP_NOTIFICATION_CALL_ID, EngineCoreRequestType
from tests.engine.core_proc_utils import (
    RawPeer,
    on_each_rank,
    request,
    running_engine,
    tiny_config,
    wait_until,
)
from tests.factories import make_tiny_checkpoint


@pytest.fixture(scope="module")
def store() -> Iterator[TCPStore]:
    master = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    yield master


def _waves(store: TCPStore, num_ranks: int = 2) -> list[DPWave]:
    rendezvous = Rendezvous("127.0.0.1", int(store.port), group_name=uuid.uuid4().hex[:8])
    placement = ExpertPlacement.contiguous(4, num_ranks)
    waves = [
        DPWave(
            ExpertParallel(placement, rank),
            rendezvous,
            timeout_s=10.0,
            join_timeout_s=10.0,
        )
        for rank in range(num_ranks)
    ]
    on_each_rank(num_ranks, lambda rank: waves[rank].join())
    return waves


def _plan(waves: list[DPWave], num_ranks: int, **kwargs: object) -> ScalePlan:
    return ScalePlan(
        epoch=7,
        num_ranks=num_ranks,
        group_name=f"{waves[0].rendezvous.group_name}-resize",
        expert_to_rank=ExpertPlacement.contiguous(4, num_ranks).expert_to_rank,
        **kwargs,  # type: ignore[arg-type]
    )


def _commit(wave: DPWave, plan: ScalePlan) -> Callable[[], None]:
    def commit() -> None:
        assert plan.expert_to_rank is not None
        assert isinstance(wave.experts, ExpertParallel)
        wave.experts.placement = ExpertPlacement(plan.expert_to_rank, plan.num_ranks)

    return commit


def test_paused_ranks_agree_on_the_switch_and_one_leaves(store: TCPStore) -> None:
    waves = _waves(store)
    plan = _plan(waves, 1)
    waves[0].mark_ready(plan.epoch)
    waves[0].maybe_start(has_local_work=False, ready_epoch=plan.epoch)
    assert waves[0].agreed_switch is None, "rank 1 is not ready yet"
    waves[1].mark_ready(plan.epoch)
    for wave in waves:
        wave.maybe_start(has_local_work=False, ready_epoch=plan.epoch)
    assert [w.agreed_switch for w in waves] == [plan.epoch, plan.epoch]
    outcomes = on_each_rank(2, lambda r: waves[r].switch(plan, _commit(waves[r], plan)))
    assert outcomes == [(SwitchOutcome.COMMITTED, ""), (SwitchOutcome.LEFT, "")]
    assert waves[1].has_left and waves[1].groups is None
    survivor = waves[0]
    assert survivor.groups is not None and survivor.groups.world_size == 1
    assert survivor.rendezvous.group_name == plan.group_name
    assert survivor.experts.world_size == 1
    survivor.maybe_start(has_local_work=True)  # the new set runs waves
    assert survivor.is_running
    survivor.leave()


def test_a_rank_with_work_decides_first_and_the_switch_waits_for_the_wave_sync(
    store: TCPStore,
) -> None:
    waves = _waves(store)
    plan = _plan(waves, 2)
    waves[1].maybe_start(has_local_work=True)  # work arrived before the plan: wave 0 runs
    for wave in waves:
        wave.mark_ready(plan.epoch)
    waves[0].maybe_start(has_local_work=False, ready_epoch=plan.epoch)
    assert waves[0].is_running and waves[0].agreed_switch is None

    def run_wave(rank: int) -> None:
        for _ in range(SYNC_INTERVAL):
            waves[rank].end_turn(has_unfinished=True, ready_epoch=plan.epoch)

    on_each_rank(2, run_wave)
    # Both agreed at the same forward, with work left: the wave ends for the switch.
    assert [w.agreed_switch for w in waves] == [plan.epoch, plan.epoch]
    assert not any(w.is_running for w in waves)
    outcomes = on_each_rank(2, lambda r: waves[r].switch(plan, _commit(waves[r], plan)))
    assert outcomes == [(SwitchOutcome.COMMITTED, "")] * 2
    assert all(w.current_wave == 1 for w in waves)
    for wave in waves:
        wave.leave()


def test_a_set_that_does_not_form_rolls_back_to_the_old_one(store: TCPStore) -> None:
    waves = _waves(store)
    old_generation = waves[0].groups.generation if waves[0].groups else 0
    plan = _plan(waves, 3, switch_timeout_s=1.0)  # rank 2 never comes
    committed: list[int] = []
    start = time.monotonic()
    outcomes = on_each_rank(2, lambda r: waves[r].switch(plan, lambda: committed.append(r)))
    assert [o[0] for o in outcomes] == [SwitchOutcome.ROLLED_BACK] * 2  # type: ignore[index]
    assert "rank(s) [2]" in str(outcomes[0])
    assert time.monotonic() - start < 10
    assert not committed, "nothing is committed when the new set does not form"
    for wave in waves:  # the old set, a generation later, works
        assert wave.groups is not None and wave.groups.world_size == 2
        assert wave.groups.generation == old_generation + 1
        assert wave.rendezvous.group_name != plan.group_name
    sums = on_each_rank(2, lambda r: waves[r].groups.all_reduce_max([r]))  # type: ignore[union-attr]
    assert sums == [[1], [1]]
    for wave in waves:
        wave.leave()


def test_an_aborted_join_ends_at_once(store: TCPStore) -> None:
    waves = _waves(store)
    plan = _plan(waves, 3, switch_timeout_s=60.0)
    PrefixStore(f"{plan.group_name}/", store).set(ABORT_KEY, "1")
    start = time.monotonic()
    outcomes = on_each_rank(2, lambda r: waves[r].switch(plan, lambda: None))
    assert [o[0] for o in outcomes] == [SwitchOutcome.ROLLED_BACK] * 2  # type: ignore[index]
    assert "aborted" in str(outcomes[0])
    assert time.monotonic() - start < 10
    for wave in waves:
        wave.leave()


def test_a_pending_scale_is_ready_once_staged_and_asked_and_reports_its_outcome() -> None:
    release = threading.Event()
    plan = ScalePlan(3, 2, "g")
    pending = PendingScale(plan, lambda: release.wait(10) and "staged")
    pending.request_switch()
    assert not pending.is_ready, "still staging"
    release.set()
    assert wait_until(lambda: pending.is_ready, 10)
    assert pending.staged == "staged"
    assert pending.wait(0.01) is None
    pending.finish(SwitchOutcome.COMMITTED)
    assert pending.wait(1) == (SwitchOutcome.COMMITTED, "")
    assert pending.staged is None, "the staged experts are not kept after the switch"
    failing = PendingScale(plan, lambda: 1 / 0)
    assert wait_until(lambda: failing.has_failed_staging, 10) and not failing.is_ready


def test_a_stage_that_is_not_committed_is_discarded_even_when_built_after_the_outcome() -> None:
    plan = ScalePlan(3, 2, "g")
    discarded: list[object] = []
    committed = PendingScale(plan, lambda: "a", discard=discarded.append)
    assert wait_until(lambda: committed.staged == "a", 10)
    committed.finish(SwitchOutcome.COMMITTED)
    rolled_back = PendingScale(plan, lambda: "b", discard=discarded.append)
    assert wait_until(lambda: rolled_back.staged == "b", 10)
    rolled_back.finish(SwitchOutcome.ROLLED_BACK, "cancelled")
    release = threading.Event()
    late = PendingScale(plan, lambda: release.wait(10) and "c", discard=discarded.append)
    late.finish(SwitchOutcome.ROLLED_BACK, "cancelled")  # while it still stages
    release.set()
    assert wait_until(lambda: discarded == ["b", "c"], 10), discarded
    assert late.staged is None


def test_a_dense_rank_that_leaves_releases_its_requests_and_every_later_one(
    tmp_path: Path,
) -> None:
    path = make_tiny_checkpoint(tmp_path, "llama", seed=1)
    with running_engine(tiny_config(path)) as engine:
        peer = RawPeer(engine.proc.endpoint, client_index=3)
        peer.hello()
        peer.send_typed(EngineCoreRequestType.ADD, request("long", max_tokens=200))
        first = peer.recv()
        assert first.outputs and first.outputs[0].request_id == "long"
        engine.proc.elastic.leave(epoch=4)
        assert engine.proc.elastic.wait(4, timeout_s=10) == ("left", "")
        notice = _next_notice(peer)
        assert notice == (SHUTDOWN_COMPLETE, ScaleNotice(4, 0, request_ids=["long"]))
        # A request that reaches the rank after it left is released at once, never run.
        peer.send_typed(EngineCoreRequestType.ADD, request("late", max_tokens=5))
        assert _next_notice(peer) == (SHUTDOWN_COMPLETE, ScaleNotice(4, 0, request_ids=["late"]))
        assert peer.is_silent(0.5), "the released requests never finish here"
        peer.close()


def _next_notice(peer: RawPeer) -> tuple[str, ScaleNotice]:
    """The next elastic notification, skipping the outputs of steps before it."""
    while True:
        outputs = peer.recv()
        utility = outputs.utility_output
        if utility is not None and utility.call_id == EEP_NOTIFICATION_CALL_ID:
            assert utility.result is not None
            kind, payload = utility.result.result
            return kind, msgspec.convert(payload, ScaleNotice)
        assert all(not o.finished for o in outputs.outputs), outputs
