"""Transport overhead: what shoal's client path costs on top of an in-process EngineCore.

(a) Latency: one request at a time, max_tokens=1, on a tiny random Llama whose step is cheap;
    p50/p99 of add → finished output through AsyncMPClient and an engine process, minus the
    in-process EngineCore figure. Beside them, the floor of the same hops with no work on
    them: a process whose input thread reads a ROUTER and queues each message to its main
    thread, which pushes it back to an asyncio PULL. The three alternate in blocks, so all
    see the same machine.
(b) Output throughput: a producer process pushes prebuilt EngineCoreOutputs batches of 64
    outputs into the client's output socket; outputs/s the output task delivers to a consumer,
    against a bare zmq PULL + msgspec decode loop on the same stream (the ceiling). The two
    alternate, `--num-runs` times each; the ratio is given of the bests and as the median of
    each back-to-back pair.
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
import os
import statistics
import sys
import tempfile
from pathlib import Path

# Before torch loads (the engine process inherits it): idle OpenMP workers spin on the cores
# the IO threads need, which here turned a 0.4 ms p99 into tens of milliseconds.
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import cpu_kind
from bench.transport_hops import (
    NUM_STREAMS,
    OUTPUTS_PER_BATCH,
    Latencies,
    ceiling_outputs_per_s,
    client_outputs_per_s,
    latencies,
    percentile,
)
from bench.transport_streams import (
    curve_runs,
    ray_serve_streams,
    report_curve,
    report_streams,
    shoal_streams,
)
from shoal.engine.config import EngineConfig


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


def report_throughput(ceilings: list[float], absorbed: list[float], num_batches: int) -> None:
    """Best of each side, and the median of the ratios of runs made back to back."""
    print(f"(b) output throughput, batches of {OUTPUTS_PER_BATCH} outputs, {num_batches} batches")
    print(f"    {'bare PULL + decode':<28}{max(ceilings):>14,.0f} outputs/s (best)")
    print(f"    {'AsyncMPClient output task':<28}{max(absorbed):>14,.0f} outputs/s (best)")
    print(f"    {'ratio of the bests':<28}{max(absorbed) / max(ceilings):>14.0%}")
    pairs = [a / c for a, c in zip(absorbed, ceilings, strict=True)]
    print(f"    {'median ratio of each pair':<28}{statistics.median(pairs):>14.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="abcd", help="which parts to run, e.g. 'ab'")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--num-batches", type=int, default=20000)
    parser.add_argument("--num-runs", type=int, default=3, help="runs of each side of (b) to (d)")
    parser.add_argument("--transport", choices=["tcp", "ipc"], default="tcp", help="for (a)")
    args = parser.parse_args()
    print(cpu_kind(), flush=True)

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
            # Alternating, so a machine that drifts between runs moves both alike.
            ceilings, absorbed = [], []
            for _ in range(args.num_runs):
                ceilings.append(ceiling_outputs_per_s(args.num_batches))
                absorbed.append(asyncio.run(client_outputs_per_s(args.num_batches)))
            report_throughput(ceilings, absorbed, args.num_batches)
        if "c" in args.parts:
            shoal = asyncio.run(shoal_streams(path, NUM_STREAMS, args.num_runs))
            ray_serve = ray_serve_streams(NUM_STREAMS, args.num_runs)
            report_streams(shoal, ray_serve)
        if "d" in args.parts:
            runs = asyncio.run(curve_runs(path, args.num_requests, args.num_runs))
            report_curve(runs)


if __name__ == "__main__":
    main()
