"""Shared-memory collectives between processes: every worker gets the same sum (bit for bit),
the gathers line up by worker, slots are reused safely over many collectives, a tensor over a
slot is refused to the caller's fallback, and a missing peer fails the wait in time."""

from __future__ import annotations

import multiprocessing
import os
import time
from datetime import timedelta
from multiprocessing.connection import Connection

import pytest
import torch
from torch.distributed import TCPStore

from shoal.engine.parallel.shm_collectives import (
    SLOT_BYTES,
    CollectiveTimeoutError,
    ShmCollectives,
    shm_supported,
)

pytestmark = pytest.mark.skipif(not shm_supported(), reason="shared-memory collectives: x86 only")


def _store(port: int, is_server: bool) -> TCPStore:
    return TCPStore("127.0.0.1", port, None, is_server, timedelta(seconds=30))


def _worker(rank: int, size: int, port: int, out: Connection) -> None:
    shm = ShmCollectives.join(_store(port, False), rank, size, timeout_s=30)
    results = []
    for step in range(300):  # slots of both parities reused many times
        x = torch.full((3, 5), float(rank + 1)) * (step + 1) + torch.arange(15).view(3, 5) / 7
        results.append(shm.all_reduce(x).clone())
    gathered = shm.all_gather_last(torch.full((2, 2), float(rank)))
    out.send((torch.stack(results).numpy().tobytes(), gathered.numpy().tolist()))


def test_every_worker_gets_the_same_sums_and_gathers_in_worker_order() -> None:
    size = 3
    server = _store(0, True)
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe(duplex=False) for _ in range(size)]
    workers = [
        context.Process(target=_worker, args=(r, size, server.port, pipes[r][1]))
        for r in range(size)
    ]
    for w in workers:
        w.start()
    answers = [pipes[r][0].recv() for r in range(size)]
    for w in workers:
        w.join(30)
    assert len({sums for sums, _ in answers}) == 1  # bit for bit the same everywhere
    expected = torch.stack(
        [
            sum(
                torch.full((3, 5), float(r + 1)) * (step + 1) + torch.arange(15).view(3, 5) / 7
                for r in range(size)
            )
            for step in range(300)
        ]
    )
    got = torch.frombuffer(bytearray(answers[0][0]), dtype=torch.float32).view(300, 3, 5)
    torch.testing.assert_close(got, expected)
    for _, gathered in answers:
        assert gathered == [[0.0, 0.0, 1.0, 1.0, 2.0, 2.0]] * 2
    assert not os.path.exists(server.get("shm/path").decode())  # unlinked once all mapped


def test_a_tensor_over_a_slot_does_not_fit_and_a_missing_peer_fails_the_wait() -> None:
    server = _store(0, True)
    context = multiprocessing.get_context("spawn")
    # A peer that maps the file and then never joins a collective.
    peer = context.Process(target=_map_and_sleep, args=(server.port,))
    peer.start()
    try:
        shm = ShmCollectives.join(server, 0, 2, timeout_s=1.0)
        assert shm.fits(torch.empty(SLOT_BYTES // 4))
        assert not shm.fits(torch.empty(SLOT_BYTES // 4 + 1))
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match="did not reach collective 1"):
            shm.all_reduce(torch.ones(4))
        assert time.monotonic() - started < 10
        shm.close()
        with pytest.raises(CollectiveTimeoutError, match="closed"):
            shm.all_reduce(torch.ones(4))
    finally:
        peer.terminate()
        peer.join(5)


def _map_and_sleep(port: int) -> None:
    ShmCollectives.join(_store(port, False), 1, 2, timeout_s=30)
    time.sleep(60)
