"""DP waves under failure: a peer that never joins a collective ends the wave within the
collective timeout, and a paused survivor rebuilds its groups in its own process when a peer
restarts, then serves with it."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from shoal.engine.config import EngineConfig
from shoal.engine.parallel.distributed import Rendezvous
from shoal.engine.parallel.dp_wave import SYNC_INTERVAL, DPWave, WaveError
from shoal.engine.parallel.expert_parallel import ExpertParallel, ExpertPlacement
from shoal.engine.protocol import EngineCoreRequestType
from tests.engine.core_proc_utils import (
    RawPeer,
    ServedEngine,
    on_each_rank,
    request,
    tiny_config,
    wait_until,
)
from tests.factories import make_tiny_checkpoint


@pytest.fixture(scope="module")
def store_port() -> Iterator[int]:
    master = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    yield int(master.port)


def _rendezvous(port: int) -> Rendezvous:
    return Rendezvous("127.0.0.1", port, group_name=uuid.uuid4().hex[:8])


def _joined_waves(port: int, timeout_s: float = 10.0) -> list[DPWave]:
    """Two ranks' waves with their groups joined (no model: the waves' own collectives)."""
    rendezvous = _rendezvous(port)
    placement = ExpertPlacement.contiguous(4, 2)
    waves = [
        DPWave(
            ExpertParallel(placement, rank),
            rendezvous,
            timeout_s=timeout_s,
            join_timeout_s=10.0,
        )
        for rank in range(2)
    ]
    on_each_rank(2, lambda rank: waves[rank].join())
    return waves


def test_a_request_racing_the_end_of_a_wave_starts_the_next_one_and_old_wakes_do_nothing(
    store_port: int,
) -> None:
    waves = _joined_waves(store_port)
    waves[0].maybe_start(has_local_work=True)
    waves[1].maybe_start(has_local_work=False)  # woken by rank 0's key for wave 0
    assert all(w.is_running and w.current_wave == 0 for w in waves)

    def finish_wave(rank: int) -> None:
        for _ in range(SYNC_INTERVAL):
            waves[rank].end_turn(has_unfinished=False)

    on_each_rank(2, finish_wave)
    assert all(not w.is_running and w.current_wave == 1 for w in waves)
    # Wave 0's wake key is still in the store: it starts nothing now.
    waves[1].maybe_start(has_local_work=False)
    assert not waves[1].is_running
    # A request stamped with wave 0 (its client saw wave 0 running) reaches rank 0 just after
    # the wave ended: it is counted as a race, and starts wave 1 on both ranks.
    waves[0].note_request(0)
    assert waves[0].num_wave_races == 1
    waves[0].maybe_start(has_local_work=True)
    waves[1].maybe_start(has_local_work=False)
    assert all(w.is_running and w.current_wave == 1 for w in waves)
    for wave in waves:
        wave.leave()


def test_a_peer_that_hangs_ends_the_wave_within_the_collective_timeout(store_port: int) -> None:
    waves = _joined_waves(store_port, timeout_s=1.0)
    survivor = waves[0]
    survivor.maybe_start(has_local_work=True)
    assert survivor.is_running
    # Rank 1 "hangs": it never joins the wave's all-reduce.
    for _ in range(SYNC_INTERVAL - 1):
        survivor.end_turn(has_unfinished=True)
    start = time.monotonic()
    with pytest.raises(WaveError, match="rank 0: a collective of wave 0 failed"):
        survivor.end_turn(has_unfinished=True)
    assert time.monotonic() - start < 5.0
    for wave in waves:
        wave.leave()


def test_a_paused_rank_rebuilds_its_groups_in_process_when_a_peer_restarts(
    tmp_path, store_port: int
) -> None:
    path = make_tiny_checkpoint(tmp_path, "mixtral", num_experts=4, top_k=2, seed=2)
    rendezvous = _rendezvous(store_port)

    def config(rank: int) -> EngineConfig:
        return tiny_config(
            path, data_parallel_size=2, data_parallel_rank=rank, enable_expert_parallel=True
        )

    engines: dict[int, ServedEngine] = {}

    def build(rank: int) -> None:
        engines[rank] = ServedEngine(config(rank), engine_index=rank, rendezvous=rendezvous)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    survivor = engines[0]
    wave = survivor.proc._wave
    assert wave is not None and wave.groups is not None
    first = wave.groups.generation
    peer = RawPeer(survivor.endpoint)
    try:
        peer.hello_until_accepted()
        peer.send_typed(EngineCoreRequestType.ADD, request("before", [5, 6, 7], max_tokens=6))
        before = peer.collect_until_finished({"before"})
        assert wait_until(lambda: not wave.is_running, 5)

        # Rank 1 goes away while the cluster is paused and a new rank 1 starts: it opens the
        # next generation, and rank 0 follows it without leaving its process.
        engines[1].stop()
        engines[1] = ServedEngine(config(1), engine_index=1, rendezvous=rendezvous)
        assert wait_until(
            lambda: wave.groups is not None and wave.groups.generation == first + 1, 5
        )
        assert survivor.thread.is_alive() and not survivor.errors

        peer.send_typed(EngineCoreRequestType.ADD, request("after", [5, 6, 7], max_tokens=6))
        after = peer.collect_until_finished({"after"})
        tokens = [
            [t for o in seen for t in o.new_token_ids]
            for seen in (before["before"], after["after"])
        ]
        assert tokens[0] == tokens[1]
        assert len(tokens[1]) == 6
        # Both ranks paused before they stop: a rank stopped mid-wave would leave its peer
        # blocked in a collective until the collective timeout.
        new_wave = engines[1].proc._wave
        assert new_wave is not None
        assert wait_until(lambda: not wave.is_running and not new_wave.is_running, 10)
    finally:
        peer.close()
        for engine in engines.values():
            engine.proc.shutdown()
        for engine in engines.values():
            engine.stop()
