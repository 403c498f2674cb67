"""Streams through shoal's client path, measured for `bench/transport.py`: (c) AsyncLLM's
concurrent streams against Ray Serve streaming the same chunks; (d) latency and streams with
every data-plane socket CURVE-authenticated, against open sockets."""

from __future__ import annotations

import asyncio
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from bench.transport_hops import (
    LATENCY_BLOCK,
    NUM_STREAMS,
    STREAM_PARAMS,
    TOKENS_PER_STREAM,
    freeze_startup_heap,
    percentile,
    remote_latency,
)
from shoal.client import AsyncMPClient
from shoal.client.api.async_llm import AsyncLLM
from shoal.engine.config import EngineConfig
from shoal.engine.core.curve import CurveKeyPair, EngineKeys
from shoal.engine.core.engine_process import start_engine_process, stop_engine_process
from shoal.engine.protocol import EngineCoreRequest

# --- (c) streaming: AsyncLLM against Ray Serve ----------------------------------------------


@dataclass
class StreamRun:
    """One run of concurrent streams."""

    elapsed_s: float
    num_tokens: int
    num_chunks: int
    latencies_s: list[float]  # per stream: start → last chunk
    first_chunk_s: list[float]  # per stream: start → first chunk

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s


StreamFn = Callable[[int, str], AsyncIterator[int]]  # yields the number of tokens per chunk


async def run_streams(stream: StreamFn, num_streams: int, tag: str) -> StreamRun:
    async def consume(i: int) -> tuple[int, int, float, float]:
        started = time.perf_counter()
        num_tokens = num_chunks = 0
        first = 0.0
        async for tokens in stream(i, f"{tag}-{i}"):
            if not num_chunks:
                first = time.perf_counter() - started
            num_tokens += tokens
            num_chunks += 1
        return num_tokens, num_chunks, time.perf_counter() - started, first

    started = time.perf_counter()
    results = await asyncio.gather(*(consume(i) for i in range(num_streams)))
    elapsed = time.perf_counter() - started
    return StreamRun(
        elapsed,
        sum(r[0] for r in results),
        sum(r[1] for r in results),
        [r[2] for r in results],
        [r[3] for r in results],
    )


async def shoal_streams(path: str, num_streams: int, num_runs: int) -> StreamRun:
    llm = AsyncLLM(
        path,
        max_model_len=128,
        num_gpu_blocks_override=num_streams * 2,
        max_num_seqs=num_streams,
        max_num_batched_tokens=num_streams * 8,
        cpu_threads=1,
    )

    async def stream(i: int, request_id: str) -> AsyncIterator[int]:
        prompt = [1 + i % 100, 2, 3, 4, 5, 6, 7, 8]
        async for output in llm.generate(prompt, STREAM_PARAMS, request_id=request_id):
            yield len(output.outputs[0].token_ids)

    try:
        await run_streams(stream, num_streams, "warm-up")
        freeze_startup_heap()
        runs = [await run_streams(stream, num_streams, f"run{r}") for r in range(num_runs)]
    finally:
        await llm.aclose()
    return max(runs, key=lambda run: run.tokens_per_s)


def ray_serve_streams(num_streams: int, num_runs: int) -> StreamRun:
    try:
        import ray
        from ray import serve
    except ImportError:
        sys.exit("(c) needs Ray Serve: .venv/bin/pip install 'ray[serve]' (the bench extra)")

    class TokenStream:
        async def generate(self, request_id: str, num_chunks: int) -> AsyncIterator[Any]:
            for i in range(num_chunks):
                yield (1000 + i, f" tok{i}")

    deployment = serve.deployment(num_replicas=1, max_ongoing_requests=num_streams * 2)

    async def measure() -> StreamRun:
        app = serve.run(deployment(TokenStream).bind(), name="transport-bench", route_prefix=None)
        handle = app.options(stream=True, method_name="generate")

        async def stream(i: int, request_id: str) -> AsyncIterator[int]:
            chunks: Any = handle.remote(request_id, TOKENS_PER_STREAM)  # a response generator
            async for _chunk in chunks:
                yield 1

        await run_streams(stream, num_streams, "warm-up")
        runs = [await run_streams(stream, num_streams, f"run{r}") for r in range(num_runs)]
        return max(runs, key=lambda run: run.tokens_per_s)

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})
        return asyncio.run(measure())
    finally:
        serve.shutdown()
        ray.shutdown()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# --- (d) CURVE on and off ---------------------------------------------------------------------


@dataclass
class CurveRun:
    """(d) for one setting: per-request seconds and the best streaming tokens/s."""

    latencies_s: list[float]
    tokens_per_s: float


async def _stream_tokens_per_s(client: AsyncMPClient, run: int) -> float:
    params = STREAM_PARAMS
    started = time.perf_counter()
    for i in range(NUM_STREAMS):
        request = EngineCoreRequest(f"s{run}-{i}", [1 + i % 100, 2, 3, 4, 5, 6, 7, 8], params)
        await client.add_request_async(request)
    num_tokens, unfinished = 0, NUM_STREAMS
    while unfinished:
        for output in (await client.get_output_async()).outputs:
            num_tokens += len(output.new_token_ids)
            unfinished -= output.finished
    return num_tokens / (time.perf_counter() - started)


async def _curve_client(path: str, curve: bool) -> tuple[AsyncMPClient, Any]:
    """An engine process and its client, with CURVE on both ends or on neither."""
    config = EngineConfig.from_kwargs(
        path,
        max_model_len=128,
        num_gpu_blocks_override=NUM_STREAMS * 2,
        max_num_seqs=NUM_STREAMS,
        max_num_batched_tokens=NUM_STREAMS * 8,
        cpu_threads=1,
    )
    engine_kwargs: dict[str, Any] = {}
    client_kwargs: dict[str, Any] = {}
    if curve:
        client_keys = CurveKeyPair.generate()
        engine_kwargs["keys"] = EngineKeys(CurveKeyPair.generate(), {0: client_keys.public})
        client_kwargs["curve_keys"] = client_keys
    process, endpoint = start_engine_process(config, **engine_kwargs)
    return AsyncMPClient([endpoint], processes={0: process}, **client_kwargs), process


async def curve_runs(path: str, num_requests: int, num_runs: int) -> dict[bool, CurveRun]:
    """Both settings served at once (an idle engine blocks, taking no CPU) and measured in
    alternating turns — latency in blocks of requests, then one streaming run each — so that
    both see the same machine; each keeps its pooled latencies and its best throughput."""
    clients = {curve: await _curve_client(path, curve) for curve in (False, True)}
    result = {curve: CurveRun([], 0.0) for curve in clients}
    try:
        for client, _ in clients.values():  # warm-up
            for i in range(LATENCY_BLOCK):
                await remote_latency(client, i)
            await _stream_tokens_per_s(client, -1)
        freeze_startup_heap()
        for block in range(max(1, num_requests // LATENCY_BLOCK)):
            for curve, (client, _) in clients.items():
                first = block * LATENCY_BLOCK
                for i in range(first, first + LATENCY_BLOCK):
                    result[curve].latencies_s.append(await remote_latency(client, i))
        for run in range(num_runs):
            for curve, (client, _) in clients.items():
                tokens_per_s = await _stream_tokens_per_s(client, run)
                result[curve].tokens_per_s = max(result[curve].tokens_per_s, tokens_per_s)
    finally:
        for client, process in clients.values():
            client.shutdown()
            stop_engine_process(process)
    return result


def report_streams(shoal: StreamRun, ray_serve: StreamRun) -> None:
    ms = 1000.0
    print(f"(c) {NUM_STREAMS} concurrent streams of {TOKENS_PER_STREAM} tokens")
    header = f"{'tokens/s':>12}{'chunks':>8}{'p50 ms':>9}{'p99 ms':>9}{'first p50':>11}"
    print(f"    {'path':<28}{header}")
    for name, run in (("AsyncLLM (shoal)", shoal), ("Ray Serve streaming handle", ray_serve)):
        print(
            f"    {name:<28}{run.tokens_per_s:>12,.0f}{run.num_chunks:>8}"
            f"{percentile(run.latencies_s, 0.5) * ms:>9.1f}"
            f"{percentile(run.latencies_s, 0.99) * ms:>9.1f}"
            f"{percentile(run.first_chunk_s, 0.5) * ms:>11.1f}"
        )
    print(f"    {'throughput ratio':<28}{shoal.tokens_per_s / ray_serve.tokens_per_s:>11.1f}x")


def report_curve(runs: dict[bool, CurveRun]) -> None:
    ms = 1000.0
    off, on = runs[False], runs[True]
    print(
        f"(d) CURVE on and off: max_tokens=1 latency; {NUM_STREAMS} streams of {TOKENS_PER_STREAM}"
    )
    print(f"    {'sockets':<24}{'p50 ms':>10}{'p99 ms':>10}{'stream tokens/s':>18}")
    for name, run in (("open", off), ("CURVE + ZAP", on)):
        print(
            f"    {name:<24}{percentile(run.latencies_s, 0.5) * ms:>10.3f}"
            f"{percentile(run.latencies_s, 0.99) * ms:>10.3f}{run.tokens_per_s:>18,.0f}"
        )
    p50_ratio = percentile(on.latencies_s, 0.5) / percentile(off.latencies_s, 0.5)
    print(
        f"    {'CURVE / open':<24}{p50_ratio:>10.2f}{'':>10}{on.tokens_per_s / off.tokens_per_s:>18.2f}"
    )
