"""Ray's autoscaler under shoal's, on one machine: a Ray head of 1 CPU whose autoscaler
launches simulated nodes of 1 CPU (Ray's fake multi-node provider; CPU stands in for a GPU
pod), a cluster of one rank that takes the head's CPU, and `AutoscalerActor` between 1 and 2
ranks. A burst makes shoal ask for a second rank; its placement group is pending (the rank is
no capacity) until Ray launches a node; the rank starts there and serves. Idle makes shoal
remove the rank, and Ray terminates the node. Every request completes, greedy-equal to HF."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray

from shoal.client import AsyncLLM
from shoal.cluster.autoscale_policy import AutoscalerConfig
from shoal.cluster.autoscaler import start_autoscaler
from shoal.cluster.launch import ClusterHandle, LaunchOptions, launch
from shoal.cluster.placement import RankResources, unplaced_ranks
from shoal.engine.config import EngineConfig
from tests.cluster.elastic_load import Load, Served
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import (
    FAKE_HEAD_NODE_ID,
    RayHead,
    start_autoscaling_head,
    stop_ray_head,
    unique_namespace,
)
from tests.reference import assert_greedy_matches, hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 17], [42] * 9, [7, 300, 11, 12]]
MAX_TOKENS = 24
# Short clocks: the test waits for each step, not for the production defaults.
POLICY = AutoscalerConfig(min_size=1, max_size=2, scale_down_delay_s=10.0, cooldown_s=3.0)
# A node launch, a rank's start and a node's idle timeout, on a busy machine.
STEP_DEADLINE_S = 300.0


@pytest.fixture(scope="module")
def autoscaling_head() -> Iterator[RayHead]:
    if ray.is_initialized():
        ray.shutdown()
    pod = {"resources": {"CPU": 1}, "min_workers": 0, "max_workers": 1}
    head = start_autoscaling_head({"cpu_pod": pod}, head_cpus=1, idle_timeout_minutes=0.1)
    try:
        yield head
    finally:
        stop_ray_head(head)


def _alive_nodes() -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n["Alive"]]


def _serving(handle: ClusterHandle) -> list[int]:
    return sorted(r["rank"] for r in handle.status()["ranks"] if r["state"] == "ready")


def _rank_node(handle: ClusterHandle, rank: int) -> str:
    """The Ray node id of a rank's engine process."""
    info = next(r for r in handle.status()["ranks"] if r["rank"] == rank)
    return str(info["workers"][0]["node_id"])


def _pending_not_serving(handle: ClusterHandle) -> bool:
    """Whether the autoscaler wants 2 ranks while only rank 0 serves and rank 1's placement
    group waits for a node."""
    status = handle.status()
    serving = sorted(r["rank"] for r in status["ranks"] if r["state"] == "ready")
    record = status["autoscaler"]
    wants_two = record is not None and record["desired_size"] == 2
    return wants_two and serving == [0] and 1 in unplaced_ranks(handle.namespace)


async def _until(what: str, done: Callable[[], bool]) -> None:
    start = time.monotonic()
    while not done():
        assert time.monotonic() - start < STEP_DEADLINE_S, f"{what}: not in {STEP_DEADLINE_S} s"
        await asyncio.sleep(0.2)


async def _burst_then_idle(handle: ClusterHandle) -> list[Served]:
    llm = await AsyncLLM.connect(handle.namespace, host="127.0.0.1", name="burst")
    try:
        burst = Load(llm, PROMPTS, MAX_TOKENS, concurrency=10)
        task = asyncio.create_task(burst.run())
        # The new rank waits for a node: pending, and no capacity (read in this order, so
        # that it was pending when it was seen not serving).
        await _until("rank 1 pending a node, not serving", lambda: _pending_not_serving(handle))
        await _until("rank 1 serving", lambda: _serving(handle) == [0, 1])
        assert len(_alive_nodes()) == 2
        assert _rank_node(handle, 0) == FAKE_HEAD_NODE_ID
        assert _rank_node(handle, 1) != FAKE_HEAD_NODE_ID  # on the node Ray launched
        await _until("rank 1 serves the burst", lambda: any(1 in s.ranks for s in burst.served))
        burst.stop.set()
        await asyncio.wait_for(task, 120)
        await _until("rank 1 removed", lambda: _serving(handle) == [0])
        await _until("the launched node terminated", lambda: len(_alive_nodes()) == 1)
        return burst.served
    finally:
        await llm.aclose()


def test_a_burst_makes_ray_launch_a_node_for_a_rank_and_idle_makes_both_go(
    autoscaling_head: RayHead, tmp_path_factory: pytest.TempPathFactory
) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=3)
    namespace = unique_namespace("ray-autoscaler")
    ray.init(address=autoscaling_head.gcs_address, namespace=namespace, log_to_driver=False)
    try:
        assert len(_alive_nodes()) == 1
        config = EngineConfig.from_kwargs(
            checkpoint, max_num_seqs=2, num_gpu_blocks_override=64, max_model_len=256
        )
        handle = launch(
            config, LaunchOptions(RankResources(num_cpus=1), host="127.0.0.1"), namespace=namespace
        )
        try:
            start_autoscaler(handle, POLICY, ready_timeout_s=STEP_DEADLINE_S)
            served = asyncio.run(_burst_then_idle(handle))
            decisions = handle.status()["autoscaler"]["decisions"]
        finally:
            handle.shutdown()
    finally:
        ray.shutdown()
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    references = {tuple(p): hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS}
    for s in served:
        assert s.error is None and len(s.token_ids) == MAX_TOKENS, s
        assert_greedy_matches(s.token_ids, references[tuple(s.prompt)])
    assert [(d["direction"], d["to_size"]) for d in decisions][:2] == [("up", 2), ("down", 1)]
