"""The hops of shoal's client path, measured for `bench/transport.py`: (a) one request at a
time through AsyncMPClient and an engine process, beside an in-process EngineCore and the
bare hops with no work on them; (b) how many outputs/s the client's output task absorbs,
beside a bare PULL + decode loop. Also the constants and helpers (c) and (d) share."""

from __future__ import annotations

import gc
import multiprocessing
import queue
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from shoal.client import AsyncMPClient
from shoal.engine.config import EngineConfig
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
LATENCY_BLOCK = 100  # requests per turn when (a) alternates in-process and remote


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


async def remote_latency(client: AsyncMPClient, i: int) -> float:
    """Seconds from adding one max_tokens=1 request to its finished output."""
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
        except zmq.ContextTerminated:  # term() below: the socket is this thread's to close
            router.close(linger=0)

    threading.Thread(target=receive, daemon=True).start()
    ready.send(router.getsockopt_string(zmq.LAST_ENDPOINT))
    while (payload := inbox.get()) != b"stop":
        push.send(payload)
    # Not destroy(): closing the ROUTER under the thread blocked in its recv fails that recv
    # with ENOTSOCK. term() wakes the recv with ContextTerminated and waits for the close.
    push.close(linger=0)
    ctx.term()


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
            num_blocks = 1 + max(1, num_requests // LATENCY_BLOCK)
            for block in range(num_blocks):
                first = block * LATENCY_BLOCK
                ids = range(first, first + LATENCY_BLOCK)
                block_inproc = [_inproc_latency(core, i) for i in ids]
                block_remote = [await remote_latency(client, i) for i in ids]
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
