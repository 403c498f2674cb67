"""`shoal serve --autoscale --min-data-parallel-size 1 --max-data-parallel-size 2` on a `ray
start --head` node, with the policy's default targets and clocks: a burst one rank cannot keep
up with grows the cluster to two ranks, and once the burst is over it is back to one within
150 s; every request of the burst and of the trickle that follows it (which the scale-down
may hand over) completes, greedy-equal to HF. Every wait is on an event, with a deadline."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import ray

from shoal.client import AsyncLLM
from shoal.cluster.launch import ClusterHandle, attach
from tests.cluster.elastic_load import Load, Served
from tests.deploy.openai_utils import API_KEY, MODEL_NAME, scrape, start_shoal, total
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import (
    REPO_ROOT,
    TINY_ENGINE_FLAGS,
    RayHead,
    ray_env,
    ray_head,
    unique_namespace,
)
from tests.reference import assert_greedy_matches, hf_greedy

__all__ = ["ray_head"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 17], [42] * 9, [7, 300, 11, 12], [9, 8, 7, 6, 5, 4]]
MAX_TOKENS = 24
# Streams kept in flight by the burst: two run on a rank (--max-num-seqs 2), the rest wait.
BURST_CONCURRENCY = 12
# How long the cluster may take to grow (a rank starts on a busy machine), and to shrink.
GROW_DEADLINE_S = 300.0
SHRINK_DEADLINE_S = 150.0


def _serving(handle: ClusterHandle) -> list[int]:
    return sorted(r["rank"] for r in handle.status()["ranks"] if r["state"] == "ready")


def _settled(handle: ClusterHandle) -> bool:
    """Whether the autoscaler's last decision has its outcome (its resize has ended)."""
    decisions = handle.status()["autoscaler"]["decisions"]
    return bool(decisions) and decisions[-1]["outcome"] != ""


async def _until(what: str, deadline_s: float, done: Callable[[], bool]) -> float:
    """Waits until `done()` (checked every 0.2 s) or fails after `deadline_s`; returns the
    seconds it took."""
    start = time.monotonic()
    while not done():
        assert time.monotonic() - start < deadline_s, f"{what}: not within {deadline_s:.0f} s"
        await asyncio.sleep(0.2)
    return time.monotonic() - start


async def _burst_then_idle(namespace: str) -> tuple[list[Served], list[Served], float]:
    """The burst until a second rank serves and has served some of it; then a trickle of one
    stream until the cluster is back to one rank. Returns both loads' requests and how long
    the shrink took after the burst."""
    handle = attach(namespace)
    llm = await AsyncLLM.connect(namespace, host="127.0.0.1", name="burst")
    try:
        assert _serving(handle) == [0]
        burst = Load(llm, PROMPTS, MAX_TOKENS, concurrency=BURST_CONCURRENCY)
        task = asyncio.create_task(burst.run())
        await _until("two ranks serve", GROW_DEADLINE_S, lambda: _serving(handle) == [0, 1])
        await _until("rank 1 serves the burst", 60, lambda: any(1 in s.ranks for s in burst.served))
        burst.stop.set()
        await asyncio.wait_for(task, 120)
        trickle = Load(llm, PROMPTS, MAX_TOKENS, concurrency=1)
        task = asyncio.create_task(trickle.run())
        shrink_s = await _until(
            "back to one rank", SHRINK_DEADLINE_S, lambda: _serving(handle) == [0]
        )
        trickle.stop.set()
        await asyncio.wait_for(task, 120)
        await _until("the scale-down's outcome is recorded", 60, lambda: _settled(handle))
        return burst.served, trickle.served, shrink_s
    finally:
        await llm.aclose()


def test_a_burst_grows_the_cluster_to_two_ranks_and_idle_brings_it_back_to_one(
    ray_head: RayHead, tmp_path: Path
) -> None:
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny-llama", "llama", seed=3)
    namespace = unique_namespace("autoscale")
    args = [
        "serve", "--model", checkpoint, "--namespace", namespace,
        "--data-parallel-address", "127.0.0.1", "--host", "127.0.0.1", "--api-key", API_KEY,
        "--served-model-name", MODEL_NAME, "--max-num-seqs", "2", *TINY_ENGINE_FLAGS,
        "--autoscale", "--min-data-parallel-size", "1", "--max-data-parallel-size", "2",
    ]  # fmt: skip
    front_end = start_shoal(ray_head, args, tmp_path / "serve.log")
    try:
        ray.init(address=ray_head.gcs_address, namespace=namespace, log_to_driver=False)
        try:
            burst, trickle, shrink_s = asyncio.run(_burst_then_idle(namespace))
            record = attach(namespace).status()["autoscaler"]
        finally:
            ray.shutdown()
        samples = scrape(front_end.base_url)
        status = subprocess.run(
            [sys.executable, "-m", "shoal.deploy", "status", "--namespace", namespace,
             "--address", ray_head.gcs_address],
            capture_output=True, text=True, env=ray_env(), cwd=REPO_ROOT, timeout=120,
        )  # fmt: skip
    finally:
        assert front_end.stop() == 0, front_end.output()

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    references = {tuple(p): hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS}
    assert burst and trickle
    for served in burst + trickle:  # nothing lost, every stream whole and greedy-equal
        assert served.error is None and served.finish_reason == "length", served
        assert len(served.token_ids) == MAX_TOKENS, served
        assert_greedy_matches(served.token_ids, references[tuple(served.prompt)])
    assert shrink_s <= SHRINK_DEADLINE_S
    # Each decision with its reason, in the registry, `shoal status` and the metrics.
    decisions = [(d["direction"], d["reason"], d["from_size"], d["to_size"], d["outcome"])
                 for d in record["decisions"]]  # fmt: skip
    assert decisions == [("up", "queue", 1, 2, "committed"), ("down", "idle", 2, 1, "committed")]
    assert status.returncode == 0, status.stderr
    assert "autoscaler: 1..2 ranks, wants 1, 1 serving" in status.stdout, status.stdout
    assert "up 1 → 2 (queue: " in status.stdout and "down 2 → 1 (idle: " in status.stdout
    assert total(samples, "shoal:autoscaler_decisions_total", direction="up", reason="queue") == 1
    assert total(samples, "shoal:autoscaler_decisions_total", direction="down", reason="idle") == 1
    assert total(samples, "shoal:autoscaler_current_size") == 1
    assert total(samples, "shoal:autoscaler_desired_size") == 1
