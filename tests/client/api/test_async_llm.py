"""`AsyncLLM` with its engine in a child process: streaming, stop strings, cancel, failures."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import warnings
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from shoal.client import LLM, AsyncLLM, SamplingParams
from shoal.engine.errors import EngineDeadError, RequestError
from shoal.engine.protocol import RequestOutputKind
from tests.factories import make_tiny_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["hello world", "the quick brown fox", "one two three four five", "a"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def llm(checkpoint: str) -> AsyncIterator[AsyncLLM]:
    engine = AsyncLLM(checkpoint, max_model_len=256, num_gpu_blocks_override=64)
    yield engine
    await engine.aclose()


async def _collect(
    llm: AsyncLLM, prompt: str, params: SamplingParams, request_id: str | None = None
) -> list:
    return [out async for out in llm.generate(prompt, params, request_id=request_id)]


async def test_streams_match_offline_generation(llm: AsyncLLM, checkpoint: str) -> None:
    offline = LLM(checkpoint, max_model_len=256).generate(PROMPTS, GREEDY)
    streams = await asyncio.gather(*(_collect(llm, p, GREEDY) for p in PROMPTS))
    for stream, want in zip(streams, offline, strict=True):
        final = stream[-1]
        assert final.finished and sum(o.finished for o in stream) == 1
        assert final.outputs[0].token_ids == want.outputs[0].token_ids
        assert final.outputs[0].text == want.outputs[0].text
        assert len(stream) > 1, "a 12-token request should stream more than one output"
        assert final.data_parallel_rank == 0


async def test_delta_outputs_concatenate_to_the_full_text(llm: AsyncLLM) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    deltas = await _collect(llm, PROMPTS[1], params)
    cumulative = await _collect(llm, PROMPTS[1], SamplingParams(**_greedy(16)))
    assert "".join(d.outputs[0].text for d in deltas) == cumulative[-1].outputs[0].text
    assert [t for d in deltas for t in d.outputs[0].token_ids] == cumulative[-1].outputs[
        0
    ].token_ids


def _greedy(max_tokens: int) -> dict:
    return {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}


async def test_stop_string_ends_the_stream_and_frees_the_engine(llm: AsyncLLM) -> None:
    free = (await _collect(llm, PROMPTS[2], SamplingParams(**_greedy(20))))[-1].outputs[0]
    stop = free.text[len(free.text) // 2 :][:2]
    if not stop.strip():
        pytest.skip("generated text has no usable stop string")
    stopped = await _collect(llm, PROMPTS[2], SamplingParams(**_greedy(20), stop=[stop]))
    final = stopped[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == free.text[: free.text.index(stop)]
    # No streamed text may ever show the stop string.
    assert all(stop not in o.outputs[0].text for o in stopped)
    await _wait_idle(llm)


async def test_cancelling_the_consumer_aborts_the_request(llm: AsyncLLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    seen = 0

    async def consume() -> None:
        nonlocal seen
        async for _ in llm.generate(PROMPTS[0], params, request_id="to-cancel"):
            seen += 1

    task = asyncio.create_task(consume())
    while seen < 2:
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = await _wait_idle(llm)
    assert stats.num_free_blocks == stats.num_total_blocks


async def test_bad_request_fails_alone(llm: AsyncLLM) -> None:
    too_long = list(range(1, 300))

    async def bad() -> None:
        await _collect(llm, {"prompt_token_ids": too_long}, GREEDY)  # type: ignore[arg-type]

    results = await asyncio.gather(bad(), _collect(llm, PROMPTS[0], GREEDY), return_exceptions=True)
    assert isinstance(results[0], RequestError)
    assert "maximum context length is 256" in str(results[0])
    assert results[1][-1].outputs[0].finish_reason == "length"


async def test_many_concurrent_streams_get_their_own_tokens(llm: AsyncLLM, checkpoint: str) -> None:
    prompts = [f"request number {i} says" for i in range(40)]
    offline = LLM(checkpoint, max_model_len=256).generate(prompts, GREEDY)
    streams = await asyncio.gather(
        *(_collect(llm, p, GREEDY, request_id=f"r{i}") for i, p in enumerate(prompts))
    )
    for i, (stream, want) in enumerate(zip(streams, offline, strict=True)):
        assert {o.request_id for o in stream} == {f"r{i}"}
        assert sum(o.finished for o in stream) == 1
        assert stream[-1].outputs[0].token_ids == want.outputs[0].token_ids


async def test_duplicate_live_request_id_is_refused(llm: AsyncLLM) -> None:
    params = SamplingParams(**_greedy(100))
    first = llm.generate(PROMPTS[0], params, request_id="same")
    await first.__anext__()
    with pytest.raises(ValueError, match="already in use"):
        await llm.generate(PROMPTS[1], params, request_id="same").__anext__()
    await first.aclose()
    await _wait_idle(llm)


async def _wait_idle(llm: AsyncLLM, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await llm.get_stats()
        if stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0:
            return stats
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        await asyncio.sleep(0.02)


@pytest.mark.asyncio(loop_scope="function")
async def test_a_plain_shutdown_call_closes_everything_without_a_warning(checkpoint: str) -> None:
    """vLLM's `llm.shutdown()`, not awaited: open streams fail and the engine process ends."""
    llm = AsyncLLM(checkpoint, max_model_len=256)
    stream = llm.generate(PROMPTS[0], SamplingParams(**_greedy(200)))
    await stream.__anext__()
    process = llm.engine_core.engine_set.process(0)
    assert process is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine never awaited would warn
        assert llm.shutdown() is None
        llm.shutdown()  # idempotent

    async def drain() -> None:
        async for _ in stream:
            pass

    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(drain(), timeout=5)
    with pytest.raises(EngineDeadError):
        await llm.generate(PROMPTS[1], GREEDY).__anext__()
    assert llm.engine_core.resources.is_closed
    process.join(10)
    assert not process.is_alive()


@pytest.mark.asyncio(loop_scope="function")
async def test_killed_engine_fails_every_stream_promptly(checkpoint: str) -> None:
    llm = AsyncLLM(checkpoint, max_model_len=256)
    params = SamplingParams(**_greedy(200))
    streams = [llm.generate(p, params) for p in PROMPTS]
    for stream in streams:
        await stream.__anext__()
    process = llm.engine_core.engine_set.process(0)
    assert process is not None
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    start = time.monotonic()

    async def drain(stream) -> None:  # type: ignore[no-untyped-def]
        async for _ in stream:
            pass

    results = await asyncio.wait_for(
        asyncio.gather(*(drain(s) for s in streams), return_exceptions=True), timeout=5
    )
    assert time.monotonic() - start < 2.0
    assert all(isinstance(r, EngineDeadError) for r in results), results
    with pytest.raises(EngineDeadError):
        await llm.generate(PROMPTS[0], params).__anext__()
    await llm.aclose()
