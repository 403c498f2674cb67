"""Tensor parallelism inside expert-parallel ranks (`TPExpertWorkers`): two ranks of two worker
processes each, on threads of this process with a real TCPStore, gloo groups and ZMQ. Each TP
index exchanges with its peer of the other rank, the TP all-reduce sums the width blocks: the
greedy tokens are HF's, an idle rank's workers all join the dummy forwards, and each worker
holds its rank's experts narrowed to its width block. A resize's switch re-stages the experts
in every worker (here to a swapped placement) and the tokens stay HF's."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from shoal.engine.loader import load_model_arch
from shoal.engine.model.multiproc_executor import MultiprocExecutor
from shoal.engine.model.tp_experts import TPExpertWorkers
from shoal.engine.parallel.distributed import Rendezvous
from shoal.engine.parallel.elastic import ScalePlan
from shoal.engine.parallel.expert_parallel import ExpertPlacement
from shoal.engine.protocol import EngineCoreRequestType
from tests.engine.core_proc_utils import (
    RawPeer,
    ServedEngine,
    request,
    tiny_config,
    wait_until,
)
from tests.factories import hf_reference, make_tiny_checkpoint
from tests.reference import assert_greedy_matches, hf_greedy

NUM_EXPERTS = 4
# Rank 0's prompts run longer than rank 1's: rank 1 idles through dummy forwards meanwhile.
PROMPTS = [([5, 6, 7, 8, 9], 12), ([11, 3, 40, 2, 17, 23, 4], 4), ([20, 21], 10), ([9, 8], 3)]
SWAPPED = (1, 1, 0, 0)  # rank 0 takes experts 2 and 3, rank 1 experts 0 and 1


@pytest.fixture(scope="module")
def store_port() -> Iterator[int]:
    master = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    yield int(master.port)


def _start_ranks(path: str, rendezvous: Rendezvous) -> list[ServedEngine]:
    """Two EP ranks of TP=2 each, built at once (their groups form together)."""
    built: dict[int, ServedEngine] = {}
    errors: list[BaseException] = []

    def build(rank: int) -> None:
        config = tiny_config(
            path,
            data_parallel_size=2,
            data_parallel_rank=rank,
            enable_expert_parallel=True,
            tensor_parallel_size=2,
            collective_timeout_s=10.0,
        )
        try:
            built[rank] = ServedEngine(config, engine_index=rank, rendezvous=rendezvous)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    if errors or len(built) < 2:
        for engine in built.values():
            engine.stop()
        raise errors[0] if errors else AssertionError("a rank did not start in time")
    return [built[0], built[1]]


def _generate(peers: list[RawPeer], tag: str) -> dict[int, list[int]]:
    """Prompt i on rank i % 2, all at once; the greedy tokens of each."""
    for i, (prompt, n) in enumerate(PROMPTS):
        req = request(f"{tag}{i}", prompt, max_tokens=n)
        peers[i % 2].send_typed(EngineCoreRequestType.ADD, req)
    tokens: dict[int, list[int]] = {}
    for rank, peer in enumerate(peers):
        ids = {f"{tag}{i}" for i in range(len(PROMPTS)) if i % 2 == rank}
        for rid, outputs in peer.collect_until_finished(ids, timeout_s=120).items():
            tokens[int(rid[len(tag) :])] = [t for o in outputs for t in o.new_token_ids]
    return tokens


def _is_wave_running(engine: ServedEngine) -> bool:
    wave = engine.proc._wave
    return wave is not None and wave.is_running


def _swap_experts(engines: list[ServedEngine], rendezvous: Rendezvous) -> list[Any]:
    """A resize to the same two ranks with the experts swapped; each rank's outcome."""
    plan = ScalePlan(1, 2, f"{rendezvous.group_name}-swapped", expert_to_rank=SWAPPED)
    for engine in engines:
        engine.proc.elastic.prepare(plan)
    for engine in engines:
        engine.proc.elastic.request_switch(plan.epoch)
    return [engine.proc.elastic.wait(plan.epoch, 60) for engine in engines]


@pytest.mark.slow
def test_two_ep_ranks_of_two_tp_workers_give_hfs_tokens_before_and_after_a_restage(
    tmp_path, store_port: int
) -> None:
    path = make_tiny_checkpoint(
        tmp_path, "mixtral", num_experts=NUM_EXPERTS, top_k=2, intermediate_size=96, seed=5
    )
    hf = hf_reference(path)
    references = [hf_greedy(hf, prompt, n) for prompt, n in PROMPTS]
    rendezvous = Rendezvous("127.0.0.1", store_port, group_name=uuid.uuid4().hex[:8])
    threads = torch.get_num_threads()
    engines = _start_ranks(path, rendezvous)
    peers = [RawPeer(e.endpoint) for e in engines]
    try:
        for peer in peers:
            peer.hello_until_accepted()
        before = _generate(peers, "a")
        worker_bytes = [e.proc.engine_core.collective_rpc("parameter_bytes") for e in engines]
        executors = [e.proc.engine_core.executor for e in engines]
        wave = engines[1].proc._wave
        idle_dummies = wave.num_dummy_steps if wave is not None else 0
        outcomes = _swap_experts(engines, rendezvous)
        after = _generate(peers, "b")
        assert not any(e.errors for e in engines), [e.errors for e in engines]
        # Stopped paused: a rank that left mid-wave would hold its peer's collective until
        # the collective timeout.
        assert wait_until(lambda: not any(_is_wave_running(e) for e in engines), 10)
    finally:
        for peer in peers:
            peer.close()
        for engine in engines:
            engine.proc.shutdown()
        for engine in engines:
            engine.stop()
        torch.set_num_threads(threads)  # the TP executors set this process's to 1
    for i, reference in enumerate(references):
        assert_greedy_matches(before[i], reference, label=f"before, prompt {i}")
    assert all(isinstance(x, MultiprocExecutor) for x in executors)
    assert all(isinstance(x.expert_workers, TPExpertWorkers) for x in executors)
    assert idle_dummies > 0, "the idle rank's workers never joined a dummy forward"
    # Each worker holds its rank's two experts (of four), narrowed to half their width, and
    # about half of the rest (norms and routers are held whole by both).
    arch = load_model_arch(path)
    placement = ExpertPlacement.contiguous(NUM_EXPERTS, 2)
    expert_bytes = 4 * 3 * arch.hidden_size * arch.intermediate_size * arch.num_hidden_layers
    rest_bytes = 4 * sum(p.numel() for p in hf.parameters()) - NUM_EXPERTS * expert_bytes
    for rank, held in enumerate(worker_bytes):
        assert len(held) == 2 and held[0] == held[1], held
        experts_share = len(placement.experts_of(rank)) * expert_bytes // 2
        assert 0.5 <= (held[0] - experts_share) / rest_bytes < 0.56, (held, rest_bytes)
    # Every worker re-staged: a worker left with its old experts would sum the wrong ones.
    assert outcomes == [("committed", ""), ("committed", "")]
    drivers = [x.worker.expert_parallel for x in executors if isinstance(x, MultiprocExecutor)]
    assert [d.local_expert_ids for d in drivers if d is not None] == [[2, 3], [0, 1]]
    for i, reference in enumerate(references):
        assert_greedy_matches(after[i], reference, label=f"after, prompt {i}")
