"""Failover by request migration on a real three-rank cluster: a rank killed or hung mid-stream
loses no request of the drivers (or the HTTP front end) that allow migration, and fails those
of one that does not."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
import pytest_asyncio
import ray
import uvicorn

from shoal.client import AsyncLLM, SamplingParams
from shoal.client.routing.migration import DEFAULT_MIGRATION_LIMIT, REASON_RANK_FAILED
from shoal.cluster.launch import ClusterHandle, LaunchOptions, launch
from shoal.cluster.placement import RankResources
from shoal.deploy.openai.app import build_app
from shoal.deploy.openai.state import ServerState
from shoal.engine.config import EngineConfig
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import RequestOutputKind
from tests.cluster.in_flight import decoding_on, dplb_client
from tests.deploy.openai_utils import scrape, total
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import free_port, unique_namespace

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

NUM_RANKS = 3
MAX_TOKENS = 160
ENGINE_KWARGS: dict[str, Any] = {
    "num_gpu_blocks_override": 128,
    "max_model_len": 512,
    "max_num_batched_tokens": 64,
}
PARAMS = SamplingParams(
    temperature=0.0,
    max_tokens=MAX_TOKENS,
    ignore_eos=True,
    output_kind=RequestOutputKind.DELTA,
)
# One per rank; the same in every run, so their references are computed once.
PROMPTS = [f"the story of request number {i} goes like this" for i in range(NUM_RANKS)]


@pytest.fixture(scope="module")
def cluster(ray_local: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterHandle]:
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
    config = EngineConfig.from_kwargs(checkpoint, data_parallel_size=NUM_RANKS, **ENGINE_KWARGS)
    options = LaunchOptions(RankResources(num_cpus=1), host="127.0.0.1")
    handle = launch(config, options, namespace=unique_namespace("failover"))
    yield handle
    handle.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def drivers(cluster: ClusterHandle) -> AsyncIterator[list[AsyncLLM]]:
    """Two drivers that migrate (the default limit) and a third with the limit at 0, all
    round-robin so that each driver's first three requests land one on every rank."""
    made = [
        await AsyncLLM.connect(
            cluster.namespace,
            host="127.0.0.1",
            name=f"driver {i}",
            policy="round-robin",
            migration_limit=limit,
        )
        for i, limit in enumerate([DEFAULT_MIGRATION_LIMIT, DEFAULT_MIGRATION_LIMIT, 0])
    ]
    yield made
    for driver in made:
        await driver.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def references(drivers: list[AsyncLLM]) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, from an undisturbed run."""
    runs = [_stream(drivers[0], prompt) for prompt in PROMPTS]
    return {run.prompt: run.token_ids for run in await asyncio.gather(*runs)}


@dataclass
class Stream:
    """What one caller saw of one streamed request."""

    prompt: str
    token_ids: list[int] = field(default_factory=list)
    ranks: list[tuple[int | None, int]] = field(default_factory=list)  # (rank, tokens before)
    num_finished: int = 0
    error: BaseException | None = None
    error_at: float = 0.0  # time.monotonic() when the error came

    @property
    def moved_with_tokens(self) -> bool:
        """Whether it changed rank after it had streamed tokens."""
        return any(before > 0 for _rank, before in self.ranks[1:])


async def _stream(driver: AsyncLLM, prompt: str) -> Stream:
    seen = Stream(prompt)
    try:
        async for output in driver.generate(prompt, PARAMS):
            rank = output.data_parallel_rank
            if not seen.ranks or seen.ranks[-1][0] != rank:
                seen.ranks.append((rank, len(seen.token_ids)))
            seen.token_ids.extend(output.outputs[0].token_ids)
            seen.num_finished += output.finished
    except EngineDeadError as e:
        seen.error, seen.error_at = e, time.monotonic()
    return seen


async def _start(drivers: list[AsyncLLM]) -> list[asyncio.Task[Stream]]:
    """Three requests per driver (one per rank), once every one of them is in flight."""
    tasks = [
        asyncio.create_task(_stream(driver, prompt)) for driver in drivers for prompt in PROMPTS
    ]
    deadline = time.monotonic() + 30
    while sum(len(dplb_client(d).router) for d in drivers) < len(tasks):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    return tasks


def _pid_of(cluster: ClusterHandle, rank: int) -> int:
    return int(ray.get(cluster.engine(rank).health.remote(), timeout=30)["pid"])


def _assert_nothing_lost(runs: list[Stream], references: dict[str, list[int]]) -> None:
    for run in runs:
        assert run.error is None, run
        assert run.num_finished == 1, run
        assert run.token_ids == references[run.prompt], run.ranks
    assert any(run.moved_with_tokens for run in runs), [run.ranks for run in runs]


async def test_a_killed_rank_loses_no_request_and_limit_zero_fails_as_before(
    cluster: ClusterHandle, drivers: list[AsyncLLM], references: dict[str, list[int]]
) -> None:
    victim = 1
    tasks = await _start(drivers)
    await decoding_on(drivers, victim, 8)
    os.kill(_pid_of(cluster, victim), signal.SIGKILL)
    killed_at = time.monotonic()

    runs = await asyncio.wait_for(asyncio.gather(*tasks), 120)

    # The driver with the limit at 0 loses its request there within 2 s, as before.
    failed = [run for run in runs[2 * NUM_RANKS :] if run.error is not None]
    assert len(failed) == 1, runs[2 * NUM_RANKS :]
    assert isinstance(failed[0].error, EngineDeadError)
    assert failed[0].ranks[-1][0] == victim
    assert failed[0].error_at - killed_at < 2.0

    # The two that migrate lose nothing; streams that moved went on where they stopped.
    _assert_nothing_lost(runs[: 2 * NUM_RANKS], references)
    for driver in drivers[:2]:
        assert dplb_client(driver).router.stats.migrated.get(REASON_RANK_FAILED, 0) >= 1
    assert not dplb_client(drivers[2]).router.stats.migrated

    # `shoal status` counts the failure, once the registry has seen it (the drivers may
    # have moved their requests first).
    deadline = time.monotonic() + 30
    while not (status := await asyncio.to_thread(cluster.status))["rank_failures"]:
        assert time.monotonic() < deadline, status
        await asyncio.sleep(0.2)
    assert [f["rank"] for f in status["rank_failures"]] == [victim]


async def test_a_hung_rank_that_wakes_delivers_no_token_twice(
    cluster: ClusterHandle, drivers: list[AsyncLLM], references: dict[str, list[int]]
) -> None:
    victim = 2
    migrating = drivers[:2]
    before = [dplb_client(d).router.stats.migrated.get(REASON_RANK_FAILED, 0) for d in migrating]
    tasks = await _start(migrating)
    await decoding_on(migrating, victim, 8)
    pid = _pid_of(cluster, victim)
    os.kill(pid, signal.SIGSTOP)  # alive to Ray, deaf to its clients
    try:
        # Past the drivers' heartbeat timeout they move its requests away...
        deadline = time.monotonic() + 20
        while any(
            dplb_client(d).router.stats.migrated.get(REASON_RANK_FAILED, 0) <= n
            for d, n in zip(migrating, before, strict=True)
        ):
            assert time.monotonic() < deadline, "the hung rank's requests did not move"
            await asyncio.sleep(0.05)
    finally:
        # ...and the rank wakes before the registry restarts it: what it still sends for
        # them is dropped.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    runs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    _assert_nothing_lost(runs, references)


async def test_through_the_http_front_end_a_killed_rank_loses_nothing(
    cluster: ClusterHandle, drivers: list[AsyncLLM]
) -> None:
    """The official `openai` client against the real app over the first driver, streamed and
    not: references first, then the same prompts with the busiest rank killed mid-stream."""
    front = drivers[0]
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(ServerState.make(front, "tiny", None)),
            host="127.0.0.1",
            port=free_port(),
            log_level="warning",
        )
    )
    serving = asyncio.create_task(server.serve())
    while not server.started:
        assert not serving.done(), serving
        await asyncio.sleep(0.05)
    port = server.config.port
    api = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
    )
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }

    async def whole(prompt: str) -> tuple[str, int]:
        completion = await api.completions.create(prompt=prompt, **body)
        return completion.choices[0].text, int(completion.choices[0].finish_reason is not None)

    async def streamed(prompt: str) -> tuple[str, int]:
        text, num_finished = "", 0
        async for chunk in await api.completions.create(prompt=prompt, stream=True, **body):
            for choice in chunk.choices:
                text += choice.text
                num_finished += choice.finish_reason is not None
        return text, num_finished

    try:
        references = [text for text, _ in await asyncio.gather(*map(whole, PROMPTS))]
        before = dplb_client(front).router.stats.migrated.get(REASON_RANK_FAILED, 0)
        tasks = [asyncio.create_task(call(p)) for call in (streamed, whole) for p in PROMPTS]
        router = dplb_client(front).router
        while len(router) < len(tasks):
            await asyncio.sleep(0.01)
        victim = max(router.loads, key=lambda rank: len(router.loads[rank].in_flight))
        await decoding_on([front], victim, 8)
        os.kill(_pid_of(cluster, victim), signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert results == [(text, 1) for text in references * 2]
        assert router.stats.migrated.get(REASON_RANK_FAILED, 0) > before
        samples = await asyncio.to_thread(scrape, f"http://127.0.0.1:{port}")
        migrated = total(samples, "shoal:requests_migrated_total", reason=REASON_RANK_FAILED)
        assert migrated == router.stats.migrated[REASON_RANK_FAILED]
        assert total(samples, "shoal:requests_failed_total") == 0
    finally:
        await api.close()
        server.should_exit = True
        await serving
