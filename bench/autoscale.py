"""Autoscaling against fixed sizes: one diurnal-plus-burst trace replayed against a cluster
fixed at the minimum, one fixed at the maximum, and `--autoscale` between the two.

The trace is Poisson arrivals whose rate follows one compressed "day" (a sine from the base
rate to the peak and back over the run) with a burst on top (the burst rate added during
[0.55, 0.70] of the run); every request is greedy, its prompt of random token ids. For each
setup it prints the requests served, TTFT p50 and p90, the SLO attainment (TTFT at most
--slo-s) and the rank-seconds used (serving ranks integrated over the run, sampled twice a
second), beside the fixed maximum's (the baseline, measured in the same run). Target:
autoscale within 10% of the fixed maximum's SLO attainment at at most 60% of its
rank-seconds.

    .venv/bin/python bench/autoscale.py [--duration-s 240] [--min-size 1] [--max-size 2] \
        [--base-rate 2] [--peak-rate 8] [--burst-rate 12] [--slo-s 1.0] [--model PATH] \
        [--autoscaling-config JSON]

Without --model it serves a tiny random Llama (made here) with --max-num-seqs 2, so that one
rank queues at the peak; figures taken on a shared or busy machine say so in the header line
(its load average).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prefix_routing import machine
from shoal.client import AsyncLLM, SamplingParams
from shoal.cluster.autoscale_policy import AutoscalerConfig
from shoal.cluster.autoscaler import start_autoscaler
from shoal.cluster.launch import ClusterHandle, LaunchOptions, launch
from shoal.cluster.placement import RankResources
from shoal.engine.config import EngineConfig
from tests.factories import make_tiny_checkpoint


@dataclass(frozen=True)
class Trace:
    """Arrival times (seconds from the start) and each request's prompt."""

    arrivals: list[float]
    prompts: list[list[int]]

    @classmethod
    def diurnal_with_burst(cls, args: argparse.Namespace, seed: int = 0) -> Trace:
        rng = random.Random(seed)
        duration = args.duration_s

        def rate(t: float) -> float:
            day = (
                args.base_rate
                + (args.peak_rate - args.base_rate) * math.sin(math.pi * t / duration) ** 2
            )
            burst = args.burst_rate if 0.55 * duration <= t < 0.70 * duration else 0.0
            return day + burst

        peak = args.peak_rate + args.burst_rate
        arrivals, t = [], 0.0
        while True:  # thinning: Poisson at the top rate, kept with probability rate/top
            t += rng.expovariate(peak)
            if t >= duration:
                break
            if rng.random() < rate(t) / peak:
                arrivals.append(t)
        prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(8, 48))] for _ in arrivals]
        return cls(arrivals, prompts)


@dataclass
class Run:
    """One setup's replay."""

    name: str
    ttfts: list[float] = field(default_factory=list)
    num_failed: int = 0
    rank_seconds: float = 0.0
    sizes_seen: set[int] = field(default_factory=set)

    def attainment(self, slo_s: float) -> float:
        total = len(self.ttfts) + self.num_failed
        return sum(t <= slo_s for t in self.ttfts) / max(1, total)

    def p(self, q: int) -> float:
        if len(self.ttfts) < 2:
            return max(self.ttfts, default=float("nan"))
        return statistics.quantiles(self.ttfts, n=100)[q - 1]


class RankSeconds(threading.Thread):
    """Integrates the cluster's serving ranks over time (sampled twice a second)."""

    def __init__(self, handle: ClusterHandle, run: Run) -> None:
        super().__init__(daemon=True)
        self._handle, self._run = handle, run
        self.stop = threading.Event()

    def run(self) -> None:
        last = time.monotonic()
        while not self.stop.wait(0.5):
            ranks = self._handle.membership().ranks.values()
            serving = sum(info.is_routable for info in ranks)
            now = time.monotonic()
            self._run.rank_seconds += serving * (now - last)
            self._run.sizes_seen.add(serving)
            last = now


async def _one(llm: AsyncLLM, prompt: list[int], max_tokens: int, run: Run) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.monotonic()
    first = None
    try:
        async for output in llm.generate({"prompt_token_ids": prompt}, params):
            if first is None and output.outputs[0].token_ids:
                first = time.monotonic() - start
            if output.error is not None:
                raise RuntimeError(output.error)
    except Exception:
        run.num_failed += 1
        return
    if first is None:
        run.num_failed += 1
    else:
        run.ttfts.append(first)


async def _replay(namespace: str, trace: Trace, max_tokens: int, run: Run) -> None:
    llm = await AsyncLLM.connect(namespace, host="127.0.0.1", name="bench")
    try:
        start = time.monotonic()
        tasks = []
        for at, prompt in zip(trace.arrivals, trace.prompts, strict=True):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            tasks.append(asyncio.create_task(_one(llm, prompt, max_tokens, run)))
        await asyncio.gather(*tasks)
    finally:
        await llm.aclose()


def _setup(
    name: str, args: argparse.Namespace, model: str, trace: Trace, autoscaling: AutoscalerConfig
) -> Run:
    size = args.max_size if name == "fixed-max" else args.min_size
    config = EngineConfig.from_kwargs(
        model, data_parallel_size=size, max_num_seqs=args.max_num_seqs, max_model_len=512
    )
    namespace = f"bench-autoscale-{name}-{int(time.time())}"
    handle = launch(
        config, LaunchOptions(RankResources(num_cpus=1), host="127.0.0.1"), namespace=namespace
    )
    run = Run(name)
    try:
        if name == "autoscale":
            start_autoscaler(handle, autoscaling)
        sampler = RankSeconds(handle, run)
        sampler.start()
        asyncio.run(_replay(namespace, trace, args.max_tokens, run))
        sampler.stop.set()
        sampler.join()
    finally:
        handle.shutdown()
    return run


def _report(runs: list[Run], slo_s: float) -> None:
    base = next(r for r in runs if r.name == "fixed-max")
    print(
        f"{'setup':<11}{'served':>8}{'failed':>8}{'TTFT p50':>10}{'TTFT p90':>10}"
        f"{'SLO met':>9}{'rank-s':>9}{'vs max: SLO':>13}{'rank-s':>8}  sizes"
    )
    for r in runs:
        slo = r.attainment(slo_s)
        print(
            f"{r.name:<11}{len(r.ttfts):>8}{r.num_failed:>8}{r.p(50):>9.3f}s{r.p(90):>9.3f}s"
            f"{100 * slo:>8.1f}%{r.rank_seconds:>9.0f}"
            f"{slo / max(1e-9, base.attainment(slo_s)):>12.2f}x"
            f"{r.rank_seconds / max(1e-9, base.rank_seconds):>7.2f}x  {sorted(r.sizes_seen)}"
        )
    print("target: autoscale SLO >= 0.90x the fixed maximum's, rank-seconds <= 0.60x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=240.0)
    parser.add_argument("--min-size", type=int, default=1)
    parser.add_argument("--max-size", type=int, default=2)
    parser.add_argument("--base-rate", type=float, default=2.0, help="requests/s at night")
    parser.add_argument("--peak-rate", type=float, default=8.0, help="requests/s at noon")
    parser.add_argument("--burst-rate", type=float, default=12.0, help="requests/s added")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=2)
    parser.add_argument("--slo-s", type=float, default=1.0, help="the TTFT objective")
    parser.add_argument("--model", default=None, help="default: a tiny random Llama")
    parser.add_argument("--autoscaling-config", default="{}", help="the policy's JSON")
    parser.add_argument("--setups", default="fixed-min,fixed-max,autoscale")
    args = parser.parse_args()
    autoscaling = AutoscalerConfig(
        min_size=args.min_size, max_size=args.max_size, **json.loads(args.autoscaling_config)
    )
    trace = Trace.diurnal_with_burst(args)
    print(f"machine: {machine()}")
    print(
        f"trace: {len(trace.arrivals)} requests over {args.duration_s:.0f} s (base "
        f"{args.base_rate}/s, peak {args.peak_rate}/s, burst +{args.burst_rate}/s), "
        f"{args.max_tokens} tokens each; SLO: TTFT <= {args.slo_s} s; autoscaler {autoscaling}"
    )
    model = args.model or make_tiny_checkpoint(tempfile.mkdtemp(), "llama", seed=3)
    ray.init(num_cpus=max(4, args.max_size + 1), include_dashboard=False, log_to_driver=False)
    try:
        runs = [_setup(name, args, model, trace, autoscaling) for name in args.setups.split(",")]
    finally:
        ray.shutdown()
    _report(runs, args.slo_s)


if __name__ == "__main__":
    main()
