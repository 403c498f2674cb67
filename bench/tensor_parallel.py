"""Tensor parallelism on the CPU: what splitting a rank over two worker processes buys and costs.

Part 1, the model. A random Llama (hidden 1024, 8 layers, 16 heads / 8 KV heads, MLP 4096,
vocab 8192: ~0.14 B parameters, float32, a safetensors checkpoint both engines load) served by
one `EngineCore`: per-step decode latency at batch 1 and 8, and prefill throughput over one
512-token prompt; TP=2 (two workers, one torch thread each) against TP=1 with two threads (the
same cores) and TP=1 with one thread. With `--vllm`, vLLM's CPU build with
`tensor_parallel_size=2` on the same checkpoint joins them (`bench/tensor_parallel_peer.py`: one
long-lived process of `.bench/vllm-venv`, one OpenMP thread per worker, worker i bound to core
i, prefix caching off as on shoal's side). The setups take turns, the first rotating each
round; the medians over the rounds are compared.

Every engine is measured the same way (`tensor_parallel_peer.measure`): driven step by step,
each token stamped when its step returns; the same prompt tokens, greedy, EOS ignored, the
same output lengths. A decode step is (a request's last token's time - its first's) / N for
N + 1 tokens (mean over the batch), prefill throughput 512 tokens over the time from adding
the prompt to its token. vLLM's figures include the hops between its processes (front end,
engine core, workers), as any vLLM user's do.

Part 2, the broadcast. The per-step cost of handing the scheduler's step to the other worker,
with an empty model step: two processes that each step only meet in one 1-element all-reduce
(where a real step's first collective would sync them); the baseline is the all-reduce alone,
against the driver first writing the msgspec `StepInput` frame on the worker's link (what
`MultiprocExecutor` does: a pipe to a spawned child, a loopback ZMQ socket to a Ray worker
actor) or broadcasting it over gloo (length, then payload).

    .venv/bin/python bench/tensor_parallel.py [--steps 32] [--rounds 3] [--part model|broadcast]
        [--vllm]    # the peer: bench/setup_vllm_peer.sh
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
from typing import Any, cast

import msgspec
import torch
import zmq
from torch.distributed import TCPStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.side_by_side import TokenEvents, alternate, cpu_summary, require_vllm_peer
from bench.tensor_parallel_peer import MAX_MODEL_LEN, Figures, VllmPeer, measure
from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.model.step_input import StepInput
from shoal.engine.model.tp_links import ZmqDriverLink, ZmqWorkerLink
from shoal.engine.parallel.distributed import ProcessGroups, Rendezvous
from shoal.engine.protocol import EngineCoreRequest, SamplingParams
from tests.factories import make_tiny_checkpoint

MODEL = dict(
    hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=8, intermediate_size=4096,
    vocab_size=8192, max_position_embeddings=MAX_MODEL_LEN,
)  # fmt: skip
MODEL_DIR = Path(tempfile.gettempdir()) / "shoal-bench-tensor-parallel"
TP2, TP1_SAME_CORES, TP1_ONE_THREAD, VLLM_TP2 = (
    "shoal TP=2", "shoal TP=1, 2 threads", "shoal TP=1, 1 thread", "vLLM TP=2",
)  # fmt: skip


def _engine(path: str, tp: int) -> EngineCore:
    config = EngineConfig.from_kwargs(
        path, max_model_len=MAX_MODEL_LEN, tensor_parallel_size=tp, cpu_threads=1,
        num_gpu_blocks_override=512, enable_prefix_caching=False,
    )  # fmt: skip
    return EngineCore(config)


class _ShoalEngine:
    """`tensor_parallel_peer.SteppedEngine` over an `EngineCore` in this process, run with
    `num_threads` torch threads in this process."""

    def __init__(self, core: EngineCore, num_threads: int) -> None:
        self.core = core
        self.num_threads = num_threads

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.core.add_request(EngineCoreRequest(request_id, prompt, params))

    def step(self) -> TokenEvents:
        return [
            (o.request_id, len(o.new_token_ids), o.finished)
            for outputs in self.core.step().values()
            for o in outputs.outputs
        ]

    def measure(self, steps: int) -> Figures:
        torch.set_num_threads(self.num_threads)
        return measure(self, steps)


def bench_model(steps: int, rounds: int, with_vllm: bool) -> None:
    """The setups in turns, `rounds` times (the machine's load moves; the medians of the turns
    are compared). One TP=1 engine serves both thread counts (set before its turn)."""
    path = make_tiny_checkpoint(MODEL_DIR, "llama", **MODEL)  # type: ignore[arg-type]
    print(f"model: {path} {MODEL}, float32; {rounds} rounds of {steps} decode steps")
    one, two = _engine(path, 1), _engine(path, 2)
    shoal = {
        TP1_ONE_THREAD: _ShoalEngine(one, 1),
        TP1_SAME_CORES: _ShoalEngine(one, 2),
        TP2: _ShoalEngine(two, 1),
    }
    setups: dict[str, _ShoalEngine | VllmPeer] = dict(shoal)
    peer = None
    try:
        for name in (TP1_SAME_CORES, TP2):
            shoal[name].measure(4)  # warm-up, as the peer's
        if with_vllm:
            log = MODEL_DIR / "vllm.log"
            print(f"starting vLLM with tensor_parallel_size=2 (log {log})", flush=True)
            peer = VllmPeer(path, 2, log, start_timeout_s=1800)
            setups[VLLM_TP2] = peer

        def turn(name: str, round_index: int) -> Figures:
            figures = setups[name].measure(steps)
            print(
                f"  round {round_index + 1} {name:<22} decode b=1 {figures.decode_b1_ms:7.2f} ms,"
                f" b=8 {figures.decode_b8_ms:7.2f} ms, prefill "
                f"{figures.prefill_tokens_per_s:6.0f} tok/s (load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
            return figures

        results = alternate(list(setups), rounds, turn)
    finally:
        one.shutdown()
        two.shutdown()
        if peer is not None:
            peer.close()
    _report(results)


def _median(runs: list[Figures]) -> Figures:
    return Figures(
        statistics.median(f.decode_b1_ms for f in runs),
        statistics.median(f.decode_b8_ms for f in runs),
        statistics.median(f.prefill_tokens_per_s for f in runs),
    )


def _report(results: dict[str, list[Figures]]) -> None:
    print(f"{'setup (median)':<24}{'decode b=1 ms':>14}{'decode b=8 ms':>14}{'prefill tok/s':>15}")
    medians = {name: _median(runs) for name, runs in results.items()}
    for name, m in medians.items():
        print(
            f"{name:<24}{m.decode_b1_ms:>14.2f}{m.decode_b8_ms:>14.2f}{m.prefill_tokens_per_s:>15.0f}"
        )
    tp2 = medians[TP2]
    for other, target in ((TP1_SAME_CORES, " (target <= 0.7x at b=1)"), (TP1_ONE_THREAD, "")):
        print(f"{TP2} / {other}: {_ratios(tp2, medians[other])}{target}")
    if VLLM_TP2 in medians:
        print(f"{TP2} / {VLLM_TP2}: {_ratios(tp2, medians[VLLM_TP2])} (target <= 1.2x at b=1)")
        paired = [
            a.decode_b1_ms / b.decode_b1_ms
            for a, b in zip(results[TP2], results[VLLM_TP2], strict=True)
        ]
        print(f"  decode b=1 step, shoal / vLLM per round: {', '.join(f'{x:.2f}' for x in paired)}")


def _ratios(ours: Figures, theirs: Figures) -> str:
    return (
        f"decode step b=1 {ours.decode_b1_ms / theirs.decode_b1_ms:.2f}x, "
        f"b=8 {ours.decode_b8_ms / theirs.decode_b8_ms:.2f}x the time; prefill "
        f"{ours.prefill_tokens_per_s / theirs.prefill_tokens_per_s:.2f}x the throughput"
    )


def _broadcast_peer(
    rank: int,
    port: int,
    mode: str,
    iters: int,
    conn: Connection | ZmqWorkerLink | None,
    zmq_address: str = "",
    driver_pid: int = 0,
) -> float:
    """Runs `iters` empty steps; returns the median step in microseconds."""
    torch.set_num_threads(1)
    if mode == "zmq" and rank == 1:  # a Ray TP worker's end of its link
        conn = cast(Any, ZmqDriverLink(zmq_address, driver_pid))
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
        if conn is not None:  # the pipe, or the loopback ZMQ link
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
    zmq_context: zmq.Context[Any] = zmq.Context()
    for mode in ("none", "pipe", "zmq", "gloo"):
        store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
        reader, writer = context.Pipe(duplex=False) if mode == "pipe" else (None, None)
        driver_end: Connection | ZmqWorkerLink | None = writer
        address = ""
        if mode == "zmq":
            driver_end = ZmqWorkerLink(zmq_context, on_stop=lambda: None)
            address = driver_end.address
        worker = context.Process(
            target=_broadcast_peer,
            args=(1, store.port, mode, iters, reader, address, os.getpid()),
        )
        worker.start()
        if isinstance(driver_end, ZmqWorkerLink):
            driver_end.attach(cast(int, worker.pid))
        results[mode] = _broadcast_peer(0, store.port, mode, iters, driver_end)
        worker.join()
        if isinstance(driver_end, ZmqWorkerLink):
            driver_end.stop(0.0)
    zmq_context.term()
    base = results["none"]
    for mode, label in (
        ("none", "all-reduce alone"),
        ("pipe", "pipe + msgspec"),
        ("zmq", "loopback ZMQ + msgspec"),
        ("gloo", "gloo broadcast"),
    ):
        extra = f"   {results[mode] - base:+.0f}" if mode != "none" else ""
        print(f"  {label:<20}{results[mode]:>8.0f}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--part", choices=("model", "broadcast"))
    parser.add_argument(
        "--vllm", action="store_true", help="also vLLM's CPU build with tensor_parallel_size=2"
    )
    args = parser.parse_args()
    if args.vllm:
        require_vllm_peer(with_model=False)
    print(cpu_summary())
    if args.part in (None, "broadcast"):
        bench_broadcast(max(200, 10 * args.steps))
    if args.part in (None, "model"):
        bench_model(args.steps, args.rounds, args.vllm)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
