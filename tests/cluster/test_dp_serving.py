"""Drivers on a real two-rank cluster: routing, aborts, pinned ranks, several drivers at once,
and a cluster's life from launch to stop as its drivers see it. (Restarts and failures:
`test_restarts.py`.)"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from shoal.client import AsyncLLM
from shoal.client.api.outputs import RequestOutput
from shoal.client.routing.cluster_link import ClusterLink
from shoal.client.transport.attach_driver import ENGINE_RETURN_WAIT_S
from shoal.cluster.launch import ClusterHandle, ClusterNotFoundError, launch
from shoal.engine.config import EngineConfig
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import EngineCoreRequest
from tests.cluster.dp_cluster import (
    ENGINE_KWARGS,
    LOCAL_RANKS,
    cluster_fixtures,
    dp_client,
    final,
    greedy,
)
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import unique_namespace

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


cluster, llm = cluster_fixtures("dp")


async def test_new_requests_avoid_the_rank_busy_with_a_long_request(llm: AsyncLLM) -> None:
    long_prompt = {"prompt_token_ids": list(range(1, 401))}
    long_task = asyncio.create_task(final(llm, long_prompt, greedy(200)))
    await asyncio.sleep(0)  # let it be routed first
    busy = dp_client(llm).rank_of(dp_client(llm).router.request_ids()[0])
    shorts = await asyncio.gather(*(final(llm, f"short {i}", greedy(4)) for i in range(4)))
    assert {s.data_parallel_rank for s in shorts} == {1 - busy}  # type: ignore[operator]
    long_output = await long_task
    assert long_output.data_parallel_rank == busy
    assert len(dp_client(llm).router) == 0


async def test_many_short_requests_use_every_rank(llm: AsyncLLM) -> None:
    outputs = await asyncio.gather(*(final(llm, f"q {i}", greedy(6)) for i in range(40)))
    shares = Counter(o.data_parallel_rank for o in outputs)
    assert set(shares) == {0, 1} and min(shares.values()) >= 10, shares
    assert len(dp_client(llm).router) == 0


async def test_abort_reaches_the_owning_rank(llm: AsyncLLM) -> None:
    stream = llm.generate("abort me", greedy(400), request_id="to-abort")
    first = await stream.__anext__()
    owner = first.data_parallel_rank
    await stream.aclose()
    deadline = time.monotonic() + 5
    while True:
        stats = await dp_client(llm).call_utility_all_async("get_stats")
        if stats[owner].num_running_reqs == 0:
            break
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.02)
    assert stats[owner].num_free_blocks == stats[owner].num_total_blocks
    assert len(dp_client(llm).router) == 0


async def test_pinned_rank_is_honoured(llm: AsyncLLM) -> None:
    for rank in (0, 1, 1, 0):
        output = await final(llm, "pinned", greedy(3), data_parallel_rank=rank)
        assert output.data_parallel_rank == rank


async def test_a_plain_shutdown_call_detaches_from_the_cluster(cluster: ClusterHandle) -> None:
    """vLLM's `llm.shutdown()`, not awaited, on a client attached by namespace."""
    other = await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name="plain shutdown")

    async def client_names() -> list[str]:
        status = await asyncio.to_thread(cluster.status)
        return [c["name"] for c in status["clients"]]

    assert "plain shutdown" in await client_names()
    assert (await final(other, "before", greedy(3))).outputs[0].token_ids
    assert other.shutdown() is None
    assert "plain shutdown" not in await client_names()
    with pytest.raises(EngineDeadError):
        await final(other, "after", greedy(3))


async def test_conversation_turns_follow_their_cache_and_front_ends_agree(
    llm: AsyncLLM, cluster: ClusterHandle
) -> None:
    """Each turn repeats the last: it goes where that is cached, and the engine finds it
    there; a second front end, which sent nothing, would send the next turn to the same rank."""
    other = await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name="second front end")
    try:
        prompt = [3 + (i * 7) % 90 for i in range(200)]
        ranks, hits = [], []
        for _ in range(3):
            output = await final(llm, {"prompt_token_ids": prompt}, greedy(4))
            ranks.append(output.data_parallel_rank)
            hits.append(output.num_cached_tokens)
            prompt = [*prompt, *output.outputs[0].token_ids, 5, 6, 7]
        assert len(set(ranks)) == 1 and min(hits[1:]) >= 192, (ranks, hits)
        probe = EngineCoreRequest("probe", prompt, greedy(4))
        deadline = time.monotonic() + 10
        while True:
            mine, theirs = dp_client(llm).route(probe), dp_client(other).route(probe)
            if mine == theirs and mine.rank == ranks[0] and mine.predicted_hit_tokens >= 208:
                break
            assert time.monotonic() < deadline, (mine, theirs)
            await asyncio.sleep(0.1)
    finally:
        await other.aclose()


async def test_two_drivers_only_see_their_own_outputs(
    llm: AsyncLLM, cluster: ClusterHandle
) -> None:
    other = await ClusterLink.attach(cluster.namespace, host="127.0.0.1", name="raw driver")
    client = other.client
    assert client.client_index != dp_client(llm).client_index
    own_ids = {f"raw-{i}" for i in range(10)}
    for request_id in sorted(own_ids):
        await client.add_request_async(EngineCoreRequest(request_id, [7, 8, 9], greedy(5)))
    mine = asyncio.gather(*(final(llm, f"mine {i}", greedy(5)) for i in range(10)))
    seen: Counter[str] = Counter()
    finished: set[str] = set()
    while finished != own_ids:
        outputs = await asyncio.wait_for(client.get_output_async(), timeout=30)
        for output in outputs.outputs:
            assert output.request_id in own_ids, output.request_id
            seen[output.request_id] += len(output.new_token_ids)
            if output.finished:
                finished.add(output.request_id)
    assert all(n == 5 for n in seen.values())
    assert all(len(o.outputs[0].token_ids) == 5 for o in await mine)
    await other.aclose()


async def test_drivers_may_use_the_same_request_ids_on_one_rank(
    llm: AsyncLLM, cluster: ClusterHandle
) -> None:
    other = await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name="same ids")
    try:
        prompts = {llm: [5, 6, 7], other: [8, 9, 10, 11]}

        async def run(driver: AsyncLLM, i: int) -> RequestOutput:
            prompt = {"prompt_token_ids": prompts[driver]}
            return await final(
                driver, prompt, greedy(6 + i), request_id=f"job-{i}", data_parallel_rank=0
            )

        mine, theirs = await asyncio.gather(
            asyncio.gather(*(run(llm, i) for i in range(4))),
            asyncio.gather(*(run(other, i) for i in range(4))),
        )
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert a.request_id == b.request_id == f"job-{i}"
            assert a.error is None and b.error is None
            assert len(a.outputs[0].token_ids) == len(b.outputs[0].token_ids) == 6 + i
            assert a.prompt_token_ids == prompts[llm] and b.prompt_token_ids == prompts[other]
        with pytest.raises(ValueError, match="'job-0' is already in use"):  # within one driver
            await asyncio.gather(run(other, 0), run(other, 0))
    finally:
        await other.aclose()


async def test_a_driver_that_shut_down_leaves_no_task_on_its_loop(cluster: ClusterHandle) -> None:
    """On a loop of its own, in a thread, so only this driver's tasks are looked at."""

    async def drive() -> set[asyncio.Task[Any]]:
        other = await AsyncLLM.connect(cluster.namespace, host="127.0.0.1", name="brief driver")
        await final(other, "brief", greedy(3))
        await asyncio.sleep(0.2)  # the membership watch is waiting by now
        await other.aclose()
        for _ in range(3):  # cancelled tasks finish on the loop's next turns
            await asyncio.sleep(0)
        return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}

    left = await asyncio.wait_for(asyncio.to_thread(lambda: asyncio.run(drive())), 60)
    assert not left, left


async def test_a_cluster_seen_by_its_drivers_from_launch_to_stop(
    ray_local: str, tmp_path: Path
) -> None:
    """The driver connects before `launch` has made the registry; a second one connects where
    the checkpoint is not (it takes the rank's tokenizer); after the stop, requests fail without
    waiting `ENGINE_RETURN_WAIT_S` for a rank, as none will come back."""
    namespace = unique_namespace("lifecycle")
    with pytest.raises(ClusterNotFoundError):  # no wait asked for: none
        await AsyncLLM.connect(namespace, host="127.0.0.1")
    checkpoint = make_tiny_checkpoint(tmp_path / "here", "llama")
    config = EngineConfig.from_kwargs(checkpoint, data_parallel_size=1, **ENGINE_KWARGS)
    launched = asyncio.create_task(
        asyncio.to_thread(launch, config, LOCAL_RANKS, namespace=namespace)
    )
    driver = await AsyncLLM.connect(
        namespace, host="127.0.0.1", name="early driver", ready_timeout_s=60
    )
    try:
        # Without the wait it would have found no cluster, or a rank not yet serving.
        assert dp_client(driver).lb_engines == [0]
        before = await final(driver, "before", greedy(3))
        assert len(before.outputs[0].token_ids) == 3
        handle = await launched
        (tmp_path / "here").rename(tmp_path / "gone")  # as on a node without the model files
        away = await AsyncLLM.connect(namespace, host="127.0.0.1", name="driver away")
        try:
            text = before.outputs[0].text
            assert (await final(away, "before", greedy(3))).outputs[0].text == text
        finally:
            await away.aclose()
        await asyncio.to_thread(handle.shutdown)
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            await final(driver, "after the stop", greedy(3))
        assert time.monotonic() - started < ENGINE_RETURN_WAIT_S / 2
    finally:
        await driver.aclose()
        (await launched).shutdown()
