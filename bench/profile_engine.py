"""Where an engine step's time goes: the offline workload of `bench/engine_vs_vllm.py`, or one
cold prefill on the tiny model of `bench/prefix_routing.py`.

Default: the 32-request workload on SmolLM2-135M (`--arch A`: on the random realistic-width
checkpoint of architecture A that `engine_vs_vllm.py --arch A` serves) in-process under
`torch.profiler`, the wall time of all steps split into: matmuls (projections and the LM head), prefill attention, decode
attention, the K/V writes into the pool, the other tensor ops of the forward (norms, rotary,
activations, embedding), sampling, input preparation, and the remainder (scheduler, output
handling, Python between ops). The profiler adds a few microseconds per op, so small-op
categories read a little high; the split, not the total, is the point.

`--prefill-tokens N`: one prompt of N tokens that no cache holds, on the 512-wide random
Llama the prefix-routing bench serves (`--hidden-size`), one thread and a 512-token step budget
as each of that bench's ranks: first `--repeats` timed prefills without the profiler (each a
new prompt; min and median), then one under it, split as above.

    .venv/bin/python bench/profile_engine.py [--arch qwen3_moe] [--shoal-arg k=v ...]
    .venv/bin/python bench/profile_engine.py --prefill-tokens 900 [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.profiler import ProfilerActivity, profile

from bench.cpu import cpu_kind
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
MATMULS = "matmuls (projections, LM head)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shoal-arg", action="append", default=[], help="engine kwarg k=v")
    parser.add_argument(
        "--num-requests", type=int, default=32, help="the workload's first N requests"
    )
    parser.add_argument("--arch", help="the offline workload on a random realistic checkpoint")
    parser.add_argument("--prefill-tokens", type=int, help="profile one cold prefill instead")
    parser.add_argument("--hidden-size", type=int, default=512, help="with --prefill-tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed cold prefills")
    args = parser.parse_args()
    print(cpu_kind(), flush=True)
    kwargs: dict[str, Any] = {}
    for a in args.shoal_arg:
        k, _, v = a.partition("=")
        kwargs[k] = json.loads(v)
    if args.prefill_tokens:
        cold_prefill(args, kwargs)
    else:
        offline(args, kwargs)


def submit(core: EngineCore, tag: str, prompts: list[list[int]], max_tokens: list[int]) -> None:
    for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        core.add_request(EngineCoreRequest(f"{tag}{i}", p, params, arrival_time=time.time()))


def drain(core: EngineCore) -> int:
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    return steps


def offline(args: argparse.Namespace, kwargs: dict[str, Any]) -> None:
    model, vocab_size = smollm2_gguf_path(), 49152
    if args.arch:
        from bench.engine_throughput import REALISTIC, random_checkpoint

        model, vocab_size = random_checkpoint(args.arch), int(REALISTIC["vocab_size"])
    config = EngineConfig.from_kwargs(model, dtype="float32", max_model_len=1024, **kwargs)
    core = EngineCore(config)
    prompts, max_tokens = make_workload("offline", 0, vocab_size=vocab_size)
    prompts, max_tokens = prompts[: args.num_requests], max_tokens[: args.num_requests]
    submit(core, "warm", [prompts[0][:64], prompts[-1][:16]], [4, 4])
    drain(core)
    submit(core, "", prompts, max_tokens)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        steps = drain(core)
        wall = time.perf_counter() - start
    core.shutdown()
    print(f"{steps} steps, {wall:.2f} s wall under the profiler, {sum(max_tokens)} output tokens")
    print_split(prof, wall)


def cold_prefill(args: argparse.Namespace, kwargs: dict[str, Any]) -> None:
    from bench.prefix_routing import model_path
    from bench.prefix_routing_workload import TOKEN_IDS

    torch.set_num_threads(1)
    options: dict[str, Any] = {
        "cpu_threads": 1,
        "block_size": 32,
        "max_num_batched_tokens": 512,
        "max_model_len": 2048,
    }
    config = EngineConfig.from_kwargs(model_path(args.hidden_size), **{**options, **kwargs})
    core = EngineCore(config)
    rng = random.Random(0)

    def prefill(tag: str) -> float:
        prompt = [rng.randrange(*TOKEN_IDS) for _ in range(args.prefill_tokens)]
        submit(core, tag, [prompt], [1])
        start = time.perf_counter()
        steps = drain(core)
        assert steps > 1, "the prompt was refused"
        return time.perf_counter() - start

    prefill("warm")
    times = [prefill(f"timed{i}-") for i in range(args.repeats)]
    print(
        f"cold prefill of {args.prefill_tokens} tokens, hidden {args.hidden_size}, one thread: "
        f"min {min(times) * 1e3:.0f} ms, median {statistics.median(times) * 1e3:.0f} ms "
        f"over {len(times)}"
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = prefill("profiled")
    core.shutdown()
    print(f"under the profiler: {wall * 1e3:.0f} ms")
    print_split(prof, wall)


def print_split(prof: profile, wall: float) -> None:
    """The profiled wall time by part (see the module docstring)."""
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
    for evt in events:
        if evt.name == BLOCK_MATMUL and not inside(range_intervals, evt.time_range.start):
            totals[MATMULS] += evt.cpu_time_total / 1e6
        if (
            evt.name in RANGES
            or evt.name.startswith("shoal::")
            or inside(range_intervals, evt.time_range.start)
            or inside(block_intervals, evt.time_range.start)
        ):
            continue
        if evt.name in MATMUL_OPS:
            totals[MATMULS] += evt.self_cpu_time_total / 1e6
        elif evt.name.startswith("aten::") or evt.name.startswith("mkldnn::"):
            totals["other tensor ops (norm, rotary, act., embed)"] += evt.self_cpu_time_total / 1e6
    accounted = sum(totals.values())
    totals["scheduler, outputs, Python between ops"] = wall - accounted
    print("| part | seconds | share |\n| --- | --- | --- |")
    for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {seconds:.3f} | {seconds / wall:.1%} |")


def inside(intervals: list[tuple[float, float]], start: float) -> bool:
    """Whether `start` falls in one of the sorted, non-nested `intervals`."""
    lo, hi = 0, len(intervals)
    while lo < hi:
        mid = (lo + hi) // 2
        if intervals[mid][0] <= start:
            lo = mid + 1
        else:
            hi = mid
    return lo > 0 and intervals[lo - 1][1] >= start


if __name__ == "__main__":
    main()
