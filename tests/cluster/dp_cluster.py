"""What the tests of a served two-rank cluster share: its launch, the module's `cluster` and `llm`
fixtures, greedy sampling, the driver's DPLB client, and a request's final output."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from shoal.client import AsyncLLM, SamplingParams
from shoal.client.api.outputs import RequestOutput
from shoal.client.routing.lb_client import DPLBAsyncMPClient
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


def cluster_fixtures(name: str) -> tuple[Any, Any]:
    """The module-scoped fixtures `cluster` (`launch_dp_cluster` in a namespace named after
    `name`, shut down after the module's last test) and `llm` (one driver attached to it).

    A test module binds them to those names: `cluster, llm = cluster_fixtures("dp")`.
    """

    @pytest.fixture(scope="module", name="cluster")
    def cluster(
        ray_local: str, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[ClusterHandle]:
        handle = launch_dp_cluster(tmp_path_factory, name)
        yield handle
        handle.shutdown()

    @pytest_asyncio.fixture(scope="module", loop_scope="module", name="llm")
    async def llm(cluster: ClusterHandle) -> AsyncIterator[AsyncLLM]:
        engine = await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name="test driver")
        yield engine
        await engine.aclose()

    return cluster, llm


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
