"""Elastic resizes under load: a tiny expert-parallel MoE, two drivers streaming greedy requests,
and the cluster resized 2 → 4 → 2 while they run.

For each resize it prints the time from the call until the first token a new rank served (a
scale-up), the time until the resize committed and until the calling driver routed over the new
set, and the longest wait for the next token of any stream in flight across the switch, beside
the same streams' p99 wait between tokens at steady state (the baseline, measured in the same
run). It also counts the requests lost (an error, a missing token, or tokens that differ from
the same prompt's tokens before any resize) and prints the throughput at each size, the first
window at 2 ranks being the baseline.

    .venv/bin/python bench/elastic.py [--sizes 4,2] [--hold-s 6] [--max-tokens 32] \
        [--concurrency 3]

Targets on a 2-core machine: first token on a new rank within 10 s of the call, no stall
longer than 1 s, a scale-down within 3 s, no request lost.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import cpu_kind
from shoal.client import AsyncLLM
from shoal.cluster.launch import LaunchOptions, launch
from shoal.cluster.placement import RankResources
from shoal.engine.config import EngineConfig
from tests.cluster.elastic_load import Load, Served
from tests.factories import make_tiny_checkpoint

PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 17], [42] * 9, [7, 300, 11, 12], [9, 8, 7, 6, 5, 4]]


@dataclass
class Window:
    """A stretch of the run at one size."""

    label: str
    size: int
    start: float
    end: float


@dataclass
class Resize:
    from_size: int
    to_size: int
    called_at: float
    committed_s: float  # the scale call's own total
    routed_s: float  # until the calling driver routed over the new set
    phases: dict[str, float]


def _tokens_in(served: list[Served], window: Window) -> int:
    return sum(n for s in served for t, n, _ in s.events if window.start <= t < window.end)


def _itl_p99(served: list[Served], window: Window) -> float:
    gaps = [
        end - start
        for s in served
        for start, end in s.gaps()[1:]  # after the first token
        if window.start <= start and end < window.end
    ]
    return statistics.quantiles(gaps, n=100)[98] if len(gaps) >= 100 else max(gaps, default=0.0)


def _longest_stall(served: list[Served], resize: Resize) -> float:
    """The longest wait for a next output among streams in flight across the switch."""
    window_end = resize.called_at + resize.routed_s
    return max(
        (
            end - start
            for s in served
            for start, end in s.gaps()
            if start < window_end and end > resize.called_at
        ),
        default=0.0,
    )


def _first_new_rank_token_s(served: list[Served], resize: Resize) -> float | None:
    if resize.to_size <= resize.from_size:
        return None
    times = [
        t
        for s in served
        for t, n, rank in s.events
        if n and rank is not None and rank >= resize.from_size and t >= resize.called_at
    ]
    return min(times) - resize.called_at if times else None


def _lost(served: list[Served], max_tokens: int, before_end: float) -> int:
    reference: dict[tuple[int, ...], list[int]] = {}
    for s in served:
        if s.finished_at < before_end and s.error is None:
            reference.setdefault(tuple(s.prompt), s.token_ids)
    lost = 0
    for s in served:
        expected = reference.get(tuple(s.prompt))
        ok = s.error is None and len(s.token_ids) == max_tokens
        if not ok or (expected is not None and s.token_ids != expected):
            lost += 1
    return lost


async def _run(args: argparse.Namespace, checkpoint: str) -> None:
    config = EngineConfig.from_kwargs(
        checkpoint,
        data_parallel_size=2,
        enable_expert_parallel=True,
        num_gpu_blocks_override=256,
        max_model_len=256,
        max_num_batched_tokens=128,
    )
    options = LaunchOptions(RankResources(num_cpus=1), host="127.0.0.1")
    handle = launch(config, options, namespace="bench-elastic")
    drivers = [
        await AsyncLLM.connect(handle.namespace, host="127.0.0.1", name=f"driver {i}")
        for i in range(2)
    ]
    try:
        loads = [Load(d, PROMPTS, args.max_tokens, concurrency=args.concurrency) for d in drivers]
        tasks = [asyncio.create_task(load.run()) for load in loads]
        await asyncio.sleep(2.0)  # warm-up: every prompt served once
        windows = [Window("before", 2, time.monotonic(), time.monotonic() + args.hold_s)]
        await asyncio.sleep(args.hold_s)
        resizes: list[Resize] = []
        size = 2
        for to_size in args.sizes:
            called = time.monotonic()
            report = await drivers[0].scale_elastic_ep(to_size)
            routed = time.monotonic() - called
            resizes.append(
                Resize(size, to_size, called, report["total_s"], routed, report["phases"])
            )
            size = to_size
            hold_start = time.monotonic() + 1.0  # the second driver attaches meanwhile
            await asyncio.sleep(1.0 + args.hold_s)
            windows.append(Window(f"at {to_size}", to_size, hold_start, time.monotonic()))
        for load in loads:
            load.stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        served = [s for load in loads for s in load.served]
        _print(args, served, windows, resizes)
    finally:
        for d in drivers:
            await d.aclose()
        handle.shutdown()


def _print(
    args: argparse.Namespace, served: list[Served], windows: list[Window], resizes: list[Resize]
) -> None:
    baseline = windows[0]
    base_tps = _tokens_in(served, baseline) / (baseline.end - baseline.start)
    base_itl = _itl_p99(served, baseline)
    print(f"tiny MoE (8 experts), 2 drivers x {args.concurrency} streams, {args.max_tokens} tokens")
    print(f"baseline at 2 ranks: {base_tps:.0f} tokens/s, p99 inter-token {base_itl * 1e3:.0f} ms")
    print()
    header = ("resize", "1st token new rank", "committed", "routed", "longest stall", "vs p99 ITL")
    print("{:<8} {:>18} {:>10} {:>8} {:>14} {:>11}".format(*header))
    for r in resizes:
        first = _first_new_rank_token_s(served, r)
        stall = _longest_stall(served, r)
        print(
            "{:<8} {:>18} {:>9.2f}s {:>7.2f}s {:>13.3f}s {:>10.1f}x".format(
                f"{r.from_size}→{r.to_size}",
                "-" if first is None else f"{first:.2f} s",
                r.committed_s,
                r.routed_s,
                stall,
                stall / base_itl if base_itl else float("nan"),
            )
        )
        print("         phases: " + ", ".join(f"{k} {v:.2f}s" for k, v in r.phases.items()))
    print()
    for w in windows:
        tps = _tokens_in(served, w) / max(1e-9, w.end - w.start)
        print(
            f"throughput {w.label:<7} ({w.size} ranks): {tps:7.0f} tokens/s = "
            f"{tps / base_tps:.2f}x baseline"
        )
    lost = _lost(served, args.max_tokens, baseline.end)
    moved = sum(1 for s in served if len(s.ranks) > 1)
    print(f"requests: {len(served)} served, {moved} handed over between ranks, {lost} lost")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,2", help="the sizes to resize to, in order")
    parser.add_argument("--hold-s", type=float, default=6.0, help="seconds at each size")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=3, help="streams per driver")
    args = parser.parse_args()
    print(cpu_kind(), flush=True)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    ray.init(num_cpus=max(4, *args.sizes), include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny_checkpoint(tmp, "mixtral", num_experts=8, top_k=2, seed=5)
        asyncio.run(_run(args, checkpoint))
    ray.shutdown()


if __name__ == "__main__":
    main()
