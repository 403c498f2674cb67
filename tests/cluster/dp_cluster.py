"""What the tests of a served two-rank cluster share: its launch, greedy sampling, the driver's
DPLB client, and a request's final output."""

from __future__ import annotations

from typing import Any

import pytest

from shoal.client import AsyncLLM, SamplingParams
from shoal.client.dp_client import DPLBAsyncMPClient
from shoal.client.outputs import RequestOutput
from shoal.cluster.launch import ClusterHandle, LaunchOptions, launch
from shoal.cluster.placement import RankResources
from shoal.engine.config import EngineConfig
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import unique_namespace

ENGINE_KWARGS: dict[str, Any] = {
    "num_gpu_blocks_override": 128,
    "max_model_len": 512,
    "max_num_batched_tokens": 64,
}
# One CPU per rank, everything on loopback.
LOCAL_RANKS = LaunchOptions(RankResources(num_cpus=1), host="127.0.0.1")


def launch_dp_cluster(tmp_path_factory: pytest.TempPathFactory, name: str) -> ClusterHandle:
    """Two ranks of a tiny random Llama, in a namespace of their own."""
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
    config = EngineConfig.from_kwargs(checkpoint, data_parallel_size=2, **ENGINE_KWARGS)
    return launch(config, LOCAL_RANKS, namespace=unique_namespace(name))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def dp_client(llm: AsyncLLM) -> DPLBAsyncMPClient:
    assert isinstance(llm.engine_core, DPLBAsyncMPClient)
    return llm.engine_core


async def final(llm: AsyncLLM, prompt: Any, params: SamplingParams, **kw: Any) -> RequestOutput:
    """The last output of one request."""
    last = None
    async for output in llm.generate(prompt, params, **kw):
        last = output
    assert last is not None
    return last
