"""Transport overhead: what shoal's client path costs on top of an in-process EngineCore.

(a) Latency: one request at a time, max_tokens=1, on a tiny random Llama whose step is cheap;
    p50/p99 of add → finished output through AsyncMPClient and an engine process, minus the
    in-process EngineCore figure. Beside them, the floor of the same hops with no work on
    them: a process whose input thread reads a ROUTER and queues each message to its main
    thread, which pushes it back to an asyncio PULL. The three alternate in blocks, so all
    see the same machine.
(b) Output throughput: a producer process pushes prebuilt EngineCoreOutputs batches of 64
    outputs into the client's output socket; outputs/s the output task delivers to a consumer,
    against a bare zmq PULL + msgspec decode loop on the same stream (the ceiling).
(c) Streaming: 400 concurrent streams of 16 tokens through AsyncLLM (tiny model, engine in a
    child process), against Ray Serve streaming the same 16 chunks per request.
    Per chunk, shoal runs a real engine step share (scheduling, the model, sampling), sends the
    token over ZMQ, decodes it, detokenizes it, builds a RequestOutput (DELTA: the new text and
    token id) and wakes the request's stream. Ray Serve runs no model: a one-replica deployment
    whose async generator yields (token_id, text) 16 times, called through a DeploymentHandle
    with `.options(stream=True)`. Both are driven by one asyncio loop in this process that
    starts all 400 streams at once and consumes every chunk; both get a warm-up run first and
    both report the best of `--num-runs` runs. Ray (ray[serve], the `bench` extra) is started
    locally with Serve bound to 127.0.0.1 and shut down after; shoal's engine is stopped
    before Ray starts. shoal's engine runs with cpu_threads=1, and this process freezes its
    startup heap after the warm-up, as a server does once it has started. A stream whose
    consumer falls behind receives merged deltas (fewer, larger chunks), so shoal's figure
    counts tokens and also reports the chunks received.

(d) CURVE on and off: (a)'s per-request latency and (c)'s 400 streams of 16 tokens through
    AsyncMPClient and an engine process, once with every data-plane socket CURVE-authenticated
    (as a cluster and a local AsyncLLM run) and once with open sockets. Both are up at once
    and measured in alternating turns so both see the same machine; best of `--num-runs` for
    the streams, p50/p99 for the latency.

    .venv/bin/python bench/transport.py [--parts abcd] [--num-requests 2000] [--num-batches 20000] \
        [--num-runs 3] [--transport tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing
import os
import queue
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

# Before torch loads (the engine process inherits it): idle OpenMP workers spin on the cores
# the IO threads need, which here turned a 0.4 ms p99 into tens of milliseconds.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import msgspec
import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shoal.client.async_llm import AsyncLLM
from shoal.client.core_client import AsyncMPClient
from shoal.engine.config import EngineConfig
from shoal.engine.core.curve import CurveKeyPair, EngineKeys
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.core.engine_process import start_engine_process, stop_engine_process
from shoal.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestOutputKind,
    SamplingParams,
    SchedulerStats,
)
from shoal.engine.serial import MsgpackEncoder

OUTPUTS_PER_BATCH = 64
PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
NUM_STREAMS = 400
TOKENS_PER_STREAM = 16
STREAM_PARAMS = SamplingParams(
    max_tokens=TOKENS_PER_STREAM,
    temperature=0.0,
    ignore_eos=True,
    output_kind=RequestOutputKind.DELTA,
)
_LATENCY_BLOCK = 100  # requests per turn when (a) alternates in-process and remote


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_request(i: int) -> EngineCoreRequest:
    return EngineCoreRequest(f"r{i}", [1 + i % 100, 2, 3, 4], PARAMS)


def freeze_startup_heap() -> None:
    """What a server does once it has started: keep the startup heap out of GC passes."""
    gc.collect()
    gc.freeze()


# --- (a) latency ------------------------------------------------------------------------------


def _inproc_latency(core: EngineCore, i: int) -> float:
    started = time.perf_counter()
    core.add_request(make_request(i))
    while not any(o.finished for out in core.step().values() for o in out.outputs):
        pass
    return time.perf_counter() - started


async def _remote_latency(client: AsyncMPClient, i: int) -> float:
    started = time.perf_counter()
    await client.add_request_async(make_request(i))
    while not any(o.finished for o in (await client.get_output_async()).outputs):
        pass
    return time.perf_counter() - started


def echo_hops(address: str, pull_address: str, ready: Connection) -> None:
    """An engine process's hops with no engine: ROUTER → input thread → queue → PUSH."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    push = ctx.socket(zmq.PUSH)
    push.connect(pull_address)
    inbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()

    def receive() -> None:
        try:
            while True:
                _identity, payload = router.recv_multipart()
                inbox.put(payload)
        except zmq.ContextTerminated:
            return

    threading.Thread(target=receive, daemon=True).start()
    ready.send(router.getsockopt_string(zmq.LAST_ENDPOINT))
    while (payload := inbox.get()) != b"stop":
        push.send(payload)
    ctx.destroy(linger=0)


class HopFloor:
    """Round trips through `echo_hops` from an asyncio DEALER and PULL, as the client's."""

    def __init__(self, transport: str, directory: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._dealer = self._ctx.socket(zmq.DEALER)
        if transport == "tcp":
            address = "tcp://127.0.0.1:*"
            port = self._pull.bind_to_random_port("tcp://127.0.0.1")
            pull_address = f"tcp://127.0.0.1:{port}"
        else:
            address, pull_address = f"ipc://{directory}/floor-in", f"ipc://{directory}/floor-out"
            self._pull.bind(pull_address)
        context = multiprocessing.get_context("spawn")
        reader, writer = context.Pipe(duplex=False)
        self._process = context.Process(
            target=echo_hops, args=(address, pull_address, writer), daemon=True
        )
        self._process.start()
        self._dealer.connect(reader.recv())

    async def round_trip(self) -> float:
        started = time.perf_counter()
        await self._dealer.send(b"x" * 64)
        await self._pull.recv()
        return time.perf_counter() - started

    async def close(self) -> None:
        await self._dealer.send(b"stop")
        self._process.join(timeout=5)
        self._ctx.destroy(linger=0)


@dataclass
class Latencies:
    """Per-request seconds for each path of (a)."""

    inproc: list[float]
    remote: list[float]
    floor: list[float]


async def latencies(config: EngineConfig, num_requests: int, transport: str) -> Latencies:
    """All three paths, measured in alternating blocks after one warm-up block."""
    core = EngineCore(config)
    process, endpoint = start_engine_process(config, transport=transport)
    client = AsyncMPClient([endpoint], processes={0: process}, transport=transport)
    with tempfile.TemporaryDirectory() as directory:
        floor = HopFloor(transport, directory)
        freeze_startup_heap()
        result = Latencies([], [], [])
        try:
            num_blocks = 1 + max(1, num_requests // _LATENCY_BLOCK)
            for block in range(num_blocks):
                first = block * _LATENCY_BLOCK
                ids = range(first, first + _LATENCY_BLOCK)
                block_inproc = [_inproc_latency(core, i) for i in ids]
                block_remote = [await _remote_latency(client, i) for i in ids]
                block_floor = [await floor.round_trip() for _ in ids]
                if block:  # the first block warms every path up
                    result.inproc += block_inproc
                    result.remote += block_remote
                    result.floor += block_floor
        finally:
            await floor.close()
            client.shutdown()
            stop_engine_process(process)
    return result


# --- (b) output throughput --------------------------------------------------------------------


def produce(address: str, num_batches: int, go: Any) -> None:
    """Pushes one warm-up batch, waits for `go`, then pushes the batch `num_batches` times."""
    outputs = EngineCoreOutputs(
        engine_index=0,
        outputs=[
            EngineCoreOutput(f"request-{i:04d}", [1000 + i]) for i in range(OUTPUTS_PER_BATCH)
        ],
        scheduler_stats=SchedulerStats(num_running_reqs=OUTPUTS_PER_BATCH, step_counter=7),
        timestamp=time.time(),
    )
    frames = MsgpackEncoder().encode(outputs)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(address)
    push.send_multipart(frames)
    go.wait()
    for _ in range(num_batches):
        push.send_multipart(frames)
    push.close(linger=-1)
    ctx.term()


class Producer:
    """A producer process; `start()` releases the bulk once the consumer saw the warm-up batch."""

    def __init__(self, address: str, num_batches: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._go = context.Event()
        self._process = context.Process(
            target=produce, args=(address, num_batches, self._go), daemon=True
        )
        self._process.start()

    def start(self) -> float:
        self._go.set()
        return time.perf_counter()

    def join(self) -> None:
        self._process.join()


def ceiling_outputs_per_s(num_batches: int) -> float:
    """A bare PULL + typed msgspec decode loop: the most one Python thread absorbs."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
    producer = Producer(f"tcp://127.0.0.1:{port}", num_batches)
    decoder.decode(pull.recv())
    started = producer.start()
    num_outputs = 0
    for _ in range(num_batches):
        num_outputs += len(decoder.decode(pull.recv_multipart(copy=False)[0].buffer).outputs)
    elapsed = time.perf_counter() - started
    producer.join()
    ctx.destroy(linger=0)
    return num_outputs / elapsed


async def client_outputs_per_s(num_batches: int) -> float:
    """The same stream through AsyncMPClient's output task and `get_output_async`."""
    client = AsyncMPClient([])  # no engine: the producer plays one
    try:
        producer = Producer(client.output_address, num_batches)
        await client.get_output_async()
        started = producer.start()
        num_outputs = 0
        for _ in range(num_batches):
            num_outputs += len((await client.get_output_async()).outputs)
        elapsed = time.perf_counter() - started
        producer.join()
    finally:
        client.shutdown()
    return num_outputs / elapsed


def best_of(num_runs: int, measure: Callable[[], float]) -> float:
    """The best of a few runs: other load on the machine only ever slows a run down."""
    return max(measure() for _ in range(num_runs))


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
            for i in range(_LATENCY_BLOCK):
                await _remote_latency(client, i)
            await _stream_tokens_per_s(client, -1)
        freeze_startup_heap()
        for block in range(max(1, num_requests // _LATENCY_BLOCK)):
            for curve, (client, _) in clients.items():
                first = block * _LATENCY_BLOCK
                for i in range(first, first + _LATENCY_BLOCK):
                    result[curve].latencies_s.append(await _remote_latency(client, i))
        for run in range(num_runs):
            for curve, (client, _) in clients.items():
                tokens_per_s = await _stream_tokens_per_s(client, run)
                result[curve].tokens_per_s = max(result[curve].tokens_per_s, tokens_per_s)
    finally:
        for client, process in clients.values():
            client.shutdown()
            stop_engine_process(process)
    return result


# --- report -----------------------------------------------------------------------------------


def report_latency(result: Latencies, transport: str) -> None:
    ms = 1000.0
    inproc, remote, floor = result.inproc, result.remote, result.floor
    print(f"(a) latency, max_tokens=1, {len(remote)} sequential requests, {transport}")
    print(f"    {'path':<34}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for name, values in (
        ("in-process EngineCore", inproc),
        ("AsyncMPClient + ZMQ", remote),
        ("bare hops, no work (floor)", floor),
    ):
        print(
            f"    {name:<34}{percentile(values, 0.5) * ms:>10.3f}"
            f"{percentile(values, 0.99) * ms:>10.3f}{statistics.mean(values) * ms:>10.3f}"
        )
    added_p50 = (percentile(remote, 0.5) - percentile(inproc, 0.5)) * ms
    added_p99 = (percentile(remote, 0.99) - percentile(inproc, 0.99)) * ms
    print(f"    {'added by the transport':<34}{added_p50:>10.3f}{added_p99:>10.3f}")
    above_p50 = added_p50 - percentile(floor, 0.5) * ms
    above_p99 = added_p99 - percentile(floor, 0.99) * ms
    print(f"    {'  of which above the floor':<34}{above_p50:>10.3f}{above_p99:>10.3f}")


def report_throughput(ceiling: float, absorbed: float, num_batches: int) -> None:
    print(f"(b) output throughput, batches of {OUTPUTS_PER_BATCH} outputs, {num_batches} batches")
    print(f"    {'bare PULL + decode':<28}{ceiling:>14,.0f} outputs/s")
    print(f"    {'AsyncMPClient output task':<28}{absorbed:>14,.0f} outputs/s")
    print(f"    {'ratio':<28}{absorbed / ceiling:>14.0%}")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="abcd", help="which parts to run, e.g. 'ab'")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--num-batches", type=int, default=20000)
    parser.add_argument("--num-runs", type=int, default=3, help="throughput runs; best is kept")
    parser.add_argument("--transport", choices=["tcp", "ipc"], default="tcp", help="for (a)")
    args = parser.parse_args()

    from tests.factories import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as directory:
        path = make_tiny_checkpoint(directory, "llama", hidden_size=32, num_layers=1)
        if "a" in args.parts:
            config = EngineConfig.from_kwargs(
                path, num_gpu_blocks_override=64, max_model_len=128, cpu_threads=1
            )
            result = asyncio.run(latencies(config, args.num_requests, args.transport))
            report_latency(result, args.transport)
        if "b" in args.parts:
            ceiling = best_of(args.num_runs, lambda: ceiling_outputs_per_s(args.num_batches))
            absorbed = best_of(
                args.num_runs, lambda: asyncio.run(client_outputs_per_s(args.num_batches))
            )
            report_throughput(ceiling, absorbed, args.num_batches)
        if "c" in args.parts:
            shoal = asyncio.run(shoal_streams(path, NUM_STREAMS, args.num_runs))
            ray_serve = ray_serve_streams(NUM_STREAMS, args.num_runs)
            report_streams(shoal, ray_serve)
        if "d" in args.parts:
            runs = asyncio.run(curve_runs(path, args.num_requests, args.num_runs))
            report_curve(runs)


if __name__ == "__main__":
    main()
