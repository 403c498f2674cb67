"""A real two-rank expert-parallel cluster on Ray: each rank holds half the experts, greedy
tokens equal HF's, the ranks step in DP waves and pause together, and a rank killed mid-wave
fails the pinned requests promptly, holds the others, and the cluster serves them again once
Ray has restarted it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
import ray

from shoal.actors.membership import RankState
from shoal.client import AsyncLLM, SamplingParams
from shoal.client.api.outputs import RequestOutput
from shoal.client.routing.migration import REASON_RANK_FAILED
from shoal.cluster.launch import ClusterHandle, LaunchOptions, launch
from shoal.cluster.placement import RankResources
from shoal.engine.config import EngineConfig
from shoal.engine.errors import EngineDeadError
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import unique_namespace
from tests.reference import assert_greedy_matches, assert_resumed_greedy_matches, hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

ENGINE_KWARGS: dict[str, Any] = {
    "num_gpu_blocks_override": 128,
    "max_model_len": 512,
    "max_num_batched_tokens": 64,
    "enable_expert_parallel": True,
    "collective_timeout_s": 10.0,
}


# Unpinned requests in flight when a rank dies: still decoding then, held, and resumed.
MAX_HELD_TOKENS = 120


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-moe"), "mixtral", num_experts=8, top_k=2, seed=5
    )


@pytest.fixture(scope="module")
def cluster(ray_local: str, checkpoint: str) -> Iterator[ClusterHandle]:
    config = EngineConfig.from_kwargs(checkpoint, data_parallel_size=2, **ENGINE_KWARGS)
    options = LaunchOptions(RankResources(num_cpus=1), host="127.0.0.1")
    handle = launch(config, options, namespace=unique_namespace("ep"))
    yield handle
    handle.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def llm(cluster: ClusterHandle) -> AsyncIterator[AsyncLLM]:
    engine = await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name="ep driver")
    yield engine
    await engine.aclose()


async def _final(llm: AsyncLLM, prompt: Any, params: SamplingParams, **kw: Any) -> RequestOutput:
    final = None
    async for output in llm.generate(prompt, params, **kw):
        final = output
    assert final is not None
    return final


def _wave(cluster: ClusterHandle) -> dict[str, Any]:
    status = cluster.status()
    expert_parallel = status["expert_parallel"]
    assert expert_parallel is not None
    return {
        **expert_parallel,
        "loads": {r["rank"]: r["load"] for r in status["ranks"] if r["load"] is not None},
    }


async def _until(predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def test_status_shows_the_placement_and_greedy_tokens_equal_hf(
    llm: AsyncLLM, cluster: ClusterHandle, checkpoint: str
) -> None:
    import transformers

    wave = _wave(cluster)
    assert wave["size"] == 2
    assert wave["experts_per_rank"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    prompts = [[5, 6, 7], [100, 200, 300, 400, 17], [42] * 9, [7, 300, 11, 12]]
    outputs = await asyncio.gather(
        *(
            _final(llm, {"prompt_token_ids": p}, _params(8), data_parallel_rank=i % 2)
            for i, p in enumerate(prompts)
        )
    )
    assert sorted(o.data_parallel_rank for o in outputs) == [0, 0, 1, 1]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        assert_greedy_matches(list(output.outputs[0].token_ids), hf_greedy(hf_model, prompt, 8))


async def test_idle_rank_steps_in_the_wave_then_every_rank_pauses(
    llm: AsyncLLM, cluster: ClusterHandle
) -> None:
    await _until(lambda: not _wave(cluster)["running"] and len(_wave(cluster)["loads"]) == 2, 10)
    before = _wave(cluster)
    long = asyncio.create_task(_final(llm, "a long one", _params(150), data_parallel_rank=0))
    start_dummies = before["loads"][1]["num_dummy_steps"]
    # Rank 1 has no request, yet runs dummy forwards while rank 0 decodes.
    await _until(lambda: _wave(cluster)["loads"][1]["num_dummy_steps"] > start_dummies + 20, 20)
    assert _wave(cluster)["running"]
    await asyncio.wait_for(long, 60)
    await _until(lambda: not _wave(cluster)["running"], 10)
    paused = _wave(cluster)
    assert paused["current_wave"] > before["current_wave"]
    counters = {r: (ld["num_dummy_steps"], ld["step_counter"]) for r, ld in paused["loads"].items()}
    await asyncio.sleep(1.5)  # a heartbeat later: nothing stepped
    later = _wave(cluster)["loads"]
    assert {r: (ld["num_dummy_steps"], ld["step_counter"]) for r, ld in later.items()} == counters
    # A request on the other rank wakes the cluster: a new, higher wave.
    await asyncio.wait_for(_final(llm, "wake", _params(4), data_parallel_rank=1), 30)
    await _until(lambda: _wave(cluster)["current_wave"] > paused["current_wave"], 10)


async def test_a_rank_killed_mid_wave_holds_unpinned_requests_until_the_cluster_serves_again(
    llm: AsyncLLM, cluster: ClusterHandle, checkpoint: str
) -> None:
    """Pinned requests fail promptly; unpinned ones are held while the ranks re-form, then go
    on from their last token to HF's greedy output."""
    import transformers

    old = {r: i.incarnation for r, i in cluster.membership().ranks.items()}
    pending = [
        asyncio.create_task(_final(llm, f"doomed {i}", _params(400), data_parallel_rank=i % 2))
        for i in range(4)
    ]
    held = [asyncio.create_task(_final(llm, f"held {i}", _params(MAX_HELD_TOKENS))) for i in (0, 1)]
    await _until(lambda: _wave(cluster)["running"], 10)
    await asyncio.sleep(0.3)
    ray.kill(cluster.engine(1), no_restart=False)
    killed_at = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), 15)
    assert time.monotonic() - killed_at < 10.0
    assert all(isinstance(r, EngineDeadError) for r in results), results
    outputs = await asyncio.wait_for(asyncio.gather(*held), 120)
    router = llm.routing_stats()
    assert router is not None and router.migrated.get(REASON_RANK_FAILED, 0) >= 1
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    for output in outputs:
        tokens = list(output.outputs[0].token_ids)
        assert len(tokens) == MAX_HELD_TOKENS
        assert_resumed_greedy_matches(hf_model, list(output.prompt_token_ids), tokens, label="held")

    # Ray restarts the killed rank (and the survivor, whose wave failed); the groups form
    # again and the cluster serves with no one's help.
    def both_back() -> bool:
        ranks = cluster.membership().ranks
        return sorted(llm.serving_ranks()) == [0, 1] and all(
            ranks[r].state == RankState.READY and ranks[r].incarnation > old[r] for r in (0, 1)
        )

    await _until(both_back, 120)
    outputs = await asyncio.wait_for(
        asyncio.gather(*(_final(llm, "back", _params(4), data_parallel_rank=r) for r in (0, 1))),
        60,
    )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
