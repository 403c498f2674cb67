"""Tensor parallelism inside expert-parallel ranks on a real local Ray cluster: two ranks of two
workers each, launched through `shoal.cluster.launch`, serve HF's greedy tokens from both
ranks (each TP index exchanges with its peer of the other rank)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from shoal.client import AsyncLLM, SamplingParams
from shoal.cluster.launch import ClusterHandle, LaunchOptions, launch
from shoal.cluster.ranks import default_resources
from shoal.engine.config import EngineConfig
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import unique_namespace
from tests.reference import assert_greedy_matches, hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 17], [42] * 9, [7, 300, 11, 12]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-moe"), "mixtral", num_experts=4, top_k=2, seed=7
    )


@pytest.fixture(scope="module")
def cluster(ray_local: str, checkpoint: str) -> Iterator[ClusterHandle]:
    config = EngineConfig.from_kwargs(
        checkpoint,
        data_parallel_size=2,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        num_gpu_blocks_override=64,
        max_model_len=256,
        collective_timeout_s=30.0,
    )
    options = LaunchOptions(default_resources(2), host="127.0.0.1", ready_timeout_s=180)
    handle = launch(config, options, namespace=unique_namespace("ep-tp"))
    yield handle
    handle.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def llm(cluster: ClusterHandle) -> AsyncIterator[AsyncLLM]:
    engine = await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name="ep-tp driver")
    yield engine
    await engine.aclose()


async def _tokens(llm: AsyncLLM, prompt: list[int], rank: int) -> tuple[list[int], Any]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    final = None
    async for output in llm.generate({"prompt_token_ids": prompt}, params, data_parallel_rank=rank):
        final = output
    assert final is not None
    return list(final.outputs[0].token_ids), final.data_parallel_rank


async def test_two_ep_ranks_of_two_tp_workers_serve_hfs_tokens(
    llm: AsyncLLM, cluster: ClusterHandle, checkpoint: str
) -> None:
    import transformers

    status = cluster.status()
    assert status["tensor_parallel_size"] == 2
    assert status["expert_parallel"]["experts_per_rank"] == [[0, 1], [2, 3]]
    assert [len(r["workers"]) for r in status["ranks"]] == [2, 2]
    served = await asyncio.gather(*(_tokens(llm, p, i % 2) for i, p in enumerate(PROMPTS)))
    assert sorted(rank for _, rank in served) == [0, 0, 1, 1]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    for prompt, (tokens, _) in zip(PROMPTS, served, strict=True):
        assert_greedy_matches(tokens, hf_greedy(hf_model, prompt, MAX_TOKENS))
