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
import torch
from torch.distributed import TCPStore

from shoal.engine.config import EngineConfig
from shoal.engine.distributed import Rendezvous
from shoal.engine.dp_wave import SYNC_INTERVAL, DPWave, WaveError
from shoal.engine.expert_parallel import ExpertParallel, ExpertPlacement
from shoal.engine.protocol import EngineCoreRequestType
from tests.engine.core_proc_utils import RawPeer, ServedEngine, request, tiny_config, wait_until
from tests.factories import make_tiny_checkpoint


@pytest.fixture(scope="module")
def store_port() -> Iterator[int]:
    master = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    yield int(master.port)


def _rendezvous(port: int) -> Rendezvous:
    return Rendezvous("127.0.0.1", port, group_name=uuid.uuid4().hex[:8])


def test_a_peer_that_hangs_ends_the_wave_within_the_collective_timeout(store_port: int) -> None:
    rendezvous = _rendezvous(store_port)
    placement = ExpertPlacement.contiguous(4, 2)
    waves = [
        DPWave(
            ExpertParallel(placement, rank),
            rendezvous,
            device=torch.device("cpu"),
            timeout_s=1.0,
            join_timeout_s=10.0,
        )
        for rank in range(2)
    ]
    threads = [threading.Thread(target=w.join) for w in waves]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
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
    finally:
        peer.close()
        for engine in engines.values():
            engine.proc.shutdown()
        for engine in engines.values():
            engine.stop()
