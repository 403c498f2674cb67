"""A poison request on a real two-rank cluster: the rank that dies taking it in dies alone. The
request fails with `PoisonRequestError` instead of moving to the other rank; the requests that
were streaming on the dead rank move and finish."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import ray

from shoal.client import AsyncLLM, SamplingParams
from shoal.client.routing.migration import POISON_INTAKE, REASON_RANK_FAILED, PoisonRequestError
from shoal.cluster.launch import ClusterHandle
from shoal.engine.protocol import RequestOutputKind, StructuredOutputsParams
from tests.cluster.dp_cluster import launch_dp_cluster
from tests.cluster.in_flight import decoding_on, dplb_client
from tests.security.poison_inputs import ENGINE_CRASHING_SCHEMA_LENGTH, ref_chain_schema

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

STREAM = SamplingParams(
    temperature=0.0, max_tokens=96, ignore_eos=True, output_kind=RequestOutputKind.DELTA
)


@pytest.fixture(scope="module")
def cluster(ray_local: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    handle = launch_dp_cluster(tmp_path_factory, "poison")
    yield handle
    handle.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def driver(cluster: ClusterHandle) -> AsyncIterator[AsyncLLM]:
    """A driver that takes turns: the first request to one rank, the next to the other."""
    made = await AsyncLLM.connect(
        cluster.namespace, host="127.0.0.1", name="poison driver", policy="round-robin"
    )
    yield made
    await made.aclose()


def _pid(cluster: ClusterHandle, rank: int) -> int:
    return int(ray.get(cluster.engine(rank).health.remote(), timeout=60)["pid"])


async def _tokens(driver: AsyncLLM, prompt: str) -> list[int]:
    tokens: list[int] = []
    async for output in driver.generate(prompt, STREAM):
        tokens.extend(output.outputs[0].token_ids)
    return tokens


async def test_a_rank_that_dies_taking_a_request_in_dies_alone(
    cluster: ClusterHandle, driver: AsyncLLM
) -> None:
    client = dplb_client(driver)
    pids = {rank: _pid(cluster, rank) for rank in (0, 1)}
    streams = [asyncio.create_task(_tokens(driver, f"story {i}")) for i in range(2)]
    while len(client.router) < 2:
        await asyncio.sleep(0.01)
    await decoding_on([driver], 0, 4)
    await decoding_on([driver], 1, 4)

    # Through the Python API, with no front end's sandbox: a chain past the engine's stack.
    poison = SamplingParams(
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(
            json=ref_chain_schema(ENGINE_CRASHING_SCHEMA_LENGTH)
        ),
    )
    with pytest.raises(PoisonRequestError, match="died while taking it in") as caught:
        async for _ in driver.generate("poison", poison):
            pass
    victim = caught.value.engine_index
    assert victim is not None
    survivor = 1 - victim

    # The streams finish, the one on the dead rank after moving; the survivor never died.
    assert [len(tokens) for tokens in await asyncio.gather(*streams)] == [96, 96]
    assert client.router.stats.poisoned == {POISON_INTAKE: 1}
    assert client.router.stats.migrated.get(REASON_RANK_FAILED, 0) == 1
    assert _pid(cluster, survivor) == pids[survivor]
    deadline = time.monotonic() + 60
    while not (status := await asyncio.to_thread(cluster.status))["rank_failures"]:
        assert time.monotonic() < deadline, status
        await asyncio.sleep(0.2)
    assert [f["rank"] for f in status["rank_failures"]] == [victim]
