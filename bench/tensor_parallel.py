"""Tensor parallelism on the CPU: what splitting a rank over two worker processes buys and costs.

Part 1, the model. A random Llama (hidden 1024, 8 layers, 16 heads / 8 KV heads, MLP 4096,
vocab 8192: ~0.2 B parameters, float32) served by one `EngineCore`: per-step decode latency at
batch 1 and 8, and prefill throughput over one 512-token prompt; TP=2 (two workers, one torch
thread each) against TP=1 with two threads (the same cores) and TP=1 with one thread, taken in
turns over several rounds.

Part 2, the broadcast. The per-step cost of handing the scheduler's step to the other worker,
with an empty model step: two processes that each step only meet in one 1-element all-reduce
(where a real step's first collective would sync them); the baseline is the all-reduce alone,
against the driver first writing the msgspec `StepInput` frame on the worker's pipe (what
`MultiprocExecutor` does) or broadcasting it over gloo (length, then payload).

    .venv/bin/python bench/tensor_parallel.py [--steps 32] [--rounds 3] [--part model|broadcast]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import torch
from torch.distributed import TCPStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.model.step_input import StepInput
from shoal.engine.parallel.distributed import ProcessGroups, Rendezvous
from shoal.engine.protocol import EngineCoreRequest, SamplingParams
from tests.factories import make_tiny_checkpoint

MODEL = dict(
    hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8, intermediate_size=4096,
    vocab_size=8192, max_position_embeddings=1024,
)  # fmt: skip
PREFILL_TOKENS = 512


def _engine(path: str, tp: int) -> EngineCore:
    config = EngineConfig.from_kwargs(
        path, max_model_len=1024, tensor_parallel_size=tp, cpu_threads=1,
        num_gpu_blocks_override=512, enable_prefix_caching=False,
    )  # fmt: skip
    return EngineCore(config)


def _step_times(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """Seconds of each step that runs `prompts` together until each has `max_tokens`."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{time.monotonic_ns()}-{i}", prompt, params))
    times = []
    while core.scheduler.has_unfinished_requests():
        started = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - started)
    return times


def _measure(core: EngineCore, steps: int) -> tuple[float, float, float]:
    """(decode step ms at batch 1, at batch 8, prefill tokens/s of one 512-token prompt)."""
    decode = []
    for batch in (1, 8):
        times = _step_times(core, [[7 + i] * 16 for i in range(batch)], steps + 1)
        decode.append(statistics.median(times[1:]) * 1e3)  # after the prefill step
    prefill = PREFILL_TOKENS / _step_times(core, [[9] * PREFILL_TOKENS], 1)[0]
    return decode[0], decode[1], prefill


def bench_model(steps: int, rounds: int) -> None:
    """The three setups in turns, `rounds` times (the machine's load moves; the medians of the
    turns are compared). One TP=1 engine serves both thread counts (set before its turn)."""
    path = make_tiny_checkpoint(tempfile.mkdtemp(), "llama", **MODEL)  # type: ignore[arg-type]
    print(f"model: {MODEL}, float32; {rounds} rounds of {steps} decode steps")
    one, two = _engine(path, 1), _engine(path, 2)
    setups = {
        "TP=1, 1 thread": (one, 1),
        "TP=1, 2 threads": (one, 2),
        "TP=2, 1 thread/worker": (two, 1),
    }
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in setups}
    try:
        for core in (one, two):
            _step_times(core, [[5] * 16], 4)  # warm-up
        for _ in range(rounds):
            for name, (core, threads) in setups.items():
                torch.set_num_threads(threads)
                results[name].append(_measure(core, steps))
    finally:
        one.shutdown()
        two.shutdown()
    print(f"{'setup':<24}{'decode b=1 ms':>14}{'decode b=8 ms':>14}{'prefill tok/s':>15}")
    medians = {
        n: [statistics.median(r[i] for r in runs) for i in range(3)] for n, runs in results.items()
    }
    for name, (b1, b8, prefill) in medians.items():
        print(f"{name:<24}{b1:>14.2f}{b8:>14.2f}{prefill:>15.0f}")
    tp2, same = medians["TP=2, 1 thread/worker"], medians["TP=1, 2 threads"]
    print(
        f"TP=2 vs TP=1 on the same 2 threads: decode b=1 {tp2[0] / same[0]:.2f}x, "
        f"b=8 {tp2[1] / same[1]:.2f}x the step time; prefill {tp2[2] / same[2]:.2f}x the throughput"
    )


def _broadcast_peer(rank: int, port: int, mode: str, iters: int, conn: Connection | None) -> float:
    """Runs `iters` empty steps; returns the median step in microseconds."""
    torch.set_num_threads(1)
    groups = ProcessGroups.join(
        Rendezvous("127.0.0.1", port, group_name=mode), rank, 2,
        device=torch.device("cpu"), timeout_s=60,
    )  # fmt: skip
    step = StepInput([40] * 8, [1] * 8, list(range(8)), [[1, 2, 3]] * 8, list(range(8)))
    frame = msgspec.msgpack.encode(step)
    decoder = msgspec.msgpack.Decoder(StepInput)
    one = torch.zeros(1)
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        if conn is not None:  # the pipe
            if rank == 0:
                conn.send_bytes(frame)
            else:
                decoder.decode(conn.recv_bytes())
        elif mode == "gloo":
            header = torch.tensor([len(frame)], dtype=torch.int64)
            groups.cpu.broadcast([header]).wait()
            payload = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
            if rank != 0:
                payload = torch.empty(int(header.item()), dtype=torch.uint8)
            groups.cpu.broadcast([payload]).wait()
            if rank != 0:
                decoder.decode(payload.numpy().tobytes())
        groups.device.allreduce([one]).wait()
        times.append(time.perf_counter() - started)
    groups.destroy()
    return statistics.median(times[10:]) * 1e6


def bench_broadcast(iters: int) -> None:
    context = multiprocessing.get_context("spawn")
    print("per-step handoff of a batch-8 decode StepInput, then one 1-element all-reduce (us)")
    results = {}
    for mode in ("none", "pipe", "gloo"):
        store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
        reader, writer = context.Pipe(duplex=False) if mode == "pipe" else (None, None)
        worker = context.Process(target=_broadcast_peer, args=(1, store.port, mode, iters, reader))
        worker.start()
        results[mode] = _broadcast_peer(0, store.port, mode, iters, writer)
        worker.join()
    base = results["none"]
    for mode, label in (
        ("none", "all-reduce alone"),
        ("pipe", "pipe + msgspec"),
        ("gloo", "gloo broadcast"),
    ):
        extra = f"   {results[mode] - base:+.0f}" if mode != "none" else ""
        print(f"  {label:<20}{results[mode]:>8.0f}{extra}")


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "?"
    model = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if "model name" in ln), "?"
    )
    flags = next(
        (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []
    )
    simd = [f for f in flags if f.startswith(("avx512", "avx2", "amx")) or f == "fma"]
    return f"{model}; {' '.join(sorted(simd)[:8])}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--part", choices=("model", "broadcast"))
    args = parser.parse_args()
    print(f"cpu: {_cpu_flags()}; {os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}")
    if args.part in (None, "broadcast"):
        bench_broadcast(max(200, 10 * args.steps))
    if args.part in (None, "model"):
        bench_model(args.steps, args.rounds)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
