"""Where an engine step's time goes on the offline workload of `bench/engine_vs_vllm.py`.

Runs the 32-request workload in-process under `torch.profiler` and splits the wall time of all
steps into: matmuls (projections and the LM head), prefill attention, decode attention, the
K/V writes into the pool, the other tensor ops of the forward (norms, rotary, activations,
embedding), sampling, input preparation, and the remainder (scheduler, output handling, Python
between ops). The profiler adds a few microseconds per op, so small-op categories read a
little high; the split, not the total, is the point.

    .venv/bin/python bench/profile_engine.py [--shoal-arg max_num_batched_tokens=1024 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.profiler import ProfilerActivity, profile

from bench.engine_vs_vllm import make_workload
from shoal.client import SamplingParams
from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.loader import smollm2_gguf_path
from shoal.engine.protocol import EngineCoreRequest

# Ranges named with torch.profiler.record_function in the model runner and attention.
RANGES = {
    "shoal::prepare_inputs": "input preparation",
    "shoal::sample": "sampling (logits + sampler)",
    "shoal::attn_prefill": "prefill attention",
    "shoal::attn_decode": "decode attention",
    "shoal::kv_write": "K/V writes into the pool",
}
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise"}
BLOCK_MATMUL = "shoal::quant_matmul"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shoal-arg", action="append", default=[], help="engine kwarg k=v")
    parser.add_argument(
        "--num-requests", type=int, default=32, help="the workload's first N requests"
    )
    args = parser.parse_args()
    kwargs: dict[str, Any] = {}
    for a in args.shoal_arg:
        k, _, v = a.partition("=")
        kwargs[k] = json.loads(v)
    config = EngineConfig.from_kwargs(
        smollm2_gguf_path(), dtype="float32", max_model_len=1024, **kwargs
    )
    core = EngineCore(config)
    prompts, max_tokens = make_workload("offline", 0)
    prompts, max_tokens = prompts[: args.num_requests], max_tokens[: args.num_requests]

    def submit(tag: str, ps: list[list[int]], ns: list[int]) -> None:
        for i, (p, n) in enumerate(zip(ps, ns, strict=True)):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            core.add_request(EngineCoreRequest(f"{tag}{i}", p, params, arrival_time=time.time()))

    submit("warm", [prompts[0][:64], prompts[1][:16]], [4, 4])
    while core.has_unfinished_requests():
        core.step()
    submit("", prompts, max_tokens)
    steps = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        while core.has_unfinished_requests():
            core.step()
            steps += 1
        wall = time.perf_counter() - start
    core.shutdown()

    totals: dict[str, float] = defaultdict(float)
    events = prof.events()
    # Self time of ops outside the named ranges, by category; ranges by their total time.
    for evt in events:
        if evt.name in RANGES:
            totals[RANGES[evt.name]] += evt.cpu_time_total / 1e6
    range_intervals = sorted(
        (e.time_range.start, e.time_range.end) for e in events if e.name in RANGES
    )
    # The GGUF-block matmuls (a C call in a named range): matmuls, unless a range above holds them.
    block_intervals = sorted(
        (e.time_range.start, e.time_range.end) for e in events if e.name == BLOCK_MATMUL
    )

    def inside(intervals: list[tuple[float, float]], start: float) -> bool:
        lo, hi = 0, len(intervals)
        while lo < hi:
            mid = (lo + hi) // 2
            if intervals[mid][0] <= start:
                lo = mid + 1
            else:
                hi = mid
        return lo > 0 and intervals[lo - 1][1] >= start

    for evt in events:
        if evt.name == BLOCK_MATMUL and not inside(range_intervals, evt.time_range.start):
            totals["matmuls (projections, LM head)"] += evt.cpu_time_total / 1e6
        if (
            evt.name in RANGES
            or evt.name.startswith("shoal::")
            or inside(range_intervals, evt.time_range.start)
            or inside(block_intervals, evt.time_range.start)
        ):
            continue
        if evt.name in MATMUL_OPS:
            totals["matmuls (projections, LM head)"] += evt.self_cpu_time_total / 1e6
        elif evt.name.startswith("aten::") or evt.name.startswith("mkldnn::"):
            totals["other tensor ops (norm, rotary, act., embed)"] += evt.self_cpu_time_total / 1e6
    accounted = sum(totals.values())
    totals["scheduler, outputs, Python between ops"] = wall - accounted
    print(f"{steps} steps, {wall:.2f} s wall under the profiler, {sum(max_tokens)} output tokens")
    print("| part | seconds | share |\n| --- | --- | --- |")
    for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {seconds:.2f} | {seconds / wall:.1%} |")


if __name__ == "__main__":
    main()
