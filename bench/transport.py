"""Transport overhead: what AsyncMPClient + ZMQ add on top of an in-process EngineCore.

(a) Latency: one request at a time, max_tokens=1, on a tiny random Llama whose step is cheap;
    p50/p99 of add → finished output through an engine process, minus the in-process figure.
(b) Output throughput: a producer process pushes prebuilt EngineCoreOutputs batches of 64
    outputs into the client's output socket; outputs/s the output task delivers to a consumer,
    against a bare zmq PULL + msgspec decode loop on the same stream (the ceiling).

    .venv/bin/python bench/transport.py [--num-requests 2000] [--num-batches 20000] [--num-runs 3] [--transport tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Before torch loads (the engine process inherits it): idle OpenMP workers spin on the cores
# the IO threads need, which here turned a 0.4 ms p99 into tens of milliseconds.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import msgspec
import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.core_client import AsyncMPClient
from engine.config import EngineConfig
from engine.core_proc import start_engine_process, stop_engine_process
from engine.engine_core import EngineCore
from engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SamplingParams,
    SchedulerStats,
)
from engine.serial import MsgpackEncoder

OUTPUTS_PER_BATCH = 64
PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_request(i: int) -> EngineCoreRequest:
    return EngineCoreRequest(f"r{i}", [1 + i % 100, 2, 3, 4], PARAMS)


# --- (a) latency ------------------------------------------------------------------------------


def inproc_latencies(config: EngineConfig, num_requests: int) -> list[float]:
    core = EngineCore(config)
    latencies = []
    for i in range(num_requests):
        started = time.perf_counter()
        core.add_request(make_request(i))
        while not any(o.finished for out in core.step().values() for o in out.outputs):
            pass
        latencies.append(time.perf_counter() - started)
    return latencies


async def zmq_latencies(config: EngineConfig, num_requests: int, transport: str) -> list[float]:
    process, endpoint = start_engine_process(config, transport=transport)
    client = AsyncMPClient([endpoint], processes={0: process}, transport=transport)
    latencies = []
    try:
        for i in range(num_requests):
            started = time.perf_counter()
            await client.add_request_async(make_request(i))
            while not any(o.finished for o in (await client.get_output_async()).outputs):
                pass
            latencies.append(time.perf_counter() - started)
    finally:
        client.shutdown()
        stop_engine_process(process)
    return latencies


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--num-batches", type=int, default=20000)
    parser.add_argument("--num-runs", type=int, default=3, help="throughput runs; best is kept")
    parser.add_argument("--transport", choices=["tcp", "ipc"], default="tcp", help="for (a)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from tests.factories import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as directory:
        path = make_tiny_checkpoint(directory, "llama", hidden_size=32, num_layers=1)
        config = EngineConfig.from_kwargs(path, num_gpu_blocks_override=64, max_model_len=128)
        inproc = inproc_latencies(config, args.num_requests)
        remote = asyncio.run(zmq_latencies(config, args.num_requests, args.transport))
    ceiling = best_of(args.num_runs, lambda: ceiling_outputs_per_s(args.num_batches))
    absorbed = best_of(args.num_runs, lambda: asyncio.run(client_outputs_per_s(args.num_batches)))

    ms = 1000.0
    print(f"(a) latency, max_tokens=1, {args.num_requests} sequential requests, {args.transport}")
    print(f"    {'path':<28}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for name, values in (("in-process EngineCore", inproc), ("AsyncMPClient + ZMQ", remote)):
        print(
            f"    {name:<28}{percentile(values, 0.5) * ms:>10.3f}"
            f"{percentile(values, 0.99) * ms:>10.3f}{statistics.mean(values) * ms:>10.3f}"
        )
    added_p50 = (percentile(remote, 0.5) - percentile(inproc, 0.5)) * ms
    added_p99 = (percentile(remote, 0.99) - percentile(inproc, 0.99)) * ms
    print(f"    {'added by the transport':<28}{added_p50:>10.3f}{added_p99:>10.3f}")
    print(
        f"(b) output throughput, batches of {OUTPUTS_PER_BATCH} outputs, {args.num_batches} batches"
    )
    print(f"    {'bare PULL + decode':<28}{ceiling:>14,.0f} outputs/s")
    print(f"    {'AsyncMPClient output task':<28}{absorbed:>14,.0f} outputs/s")
    print(f"    {'ratio':<28}{absorbed / ceiling:>14.0%}")


if __name__ == "__main__":
    main()
