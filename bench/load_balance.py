"""Load balancing across four ranks: one recorded bursty, heavy-tailed trace, three policies.

Replays `bench/traces/bursty_heavy_tail.json` (arrival offsets, prompt and output lengths)
through `DPLBAsyncMPClient` with shoal's least-loaded policy, with round-robin, and with
vLLM's published score (4 * waiting + running), against the same four-rank cluster in the
same run, and prints p50/p99 time to first token and end-to-end latency for each.

    .venv/bin/python bench/load_balance.py [--rounds 2] [--speed 1.0] [--num-ranks 4] [--record]

`--record` regenerates the trace from its seed (it is committed so every run replays the
same arrivals).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client import AsyncLLM, SamplingParams
from cluster.launch import launch
from cluster.placement import RankResources
from engine.config import EngineConfig
from tests.factories import make_tiny_checkpoint

TRACE = Path(__file__).with_name("traces") / "bursty_heavy_tail.json"
POLICIES = {
    "shoal least-loaded": "least_loaded",
    "round-robin": "round_robin",
    "vLLM 4*waiting+running": "queue_length",
}


@dataclass(frozen=True)
class TraceEntry:
    at: float  # seconds after the start of the replay
    prompt_tokens: int
    output_tokens: int


def record_trace(
    seed: int = 7, num_requests: int = 300, duration_s: float = 20.0
) -> list[TraceEntry]:
    """Poisson background traffic plus four bursts; Pareto prompts, log-normal outputs."""
    rng = random.Random(seed)
    num_background = int(num_requests * 0.6)
    times: list[float] = []
    t = 0.0
    while len(times) < num_background:
        t += rng.expovariate(num_background / duration_s)
        times.append(t)
    burst_size = (num_requests - num_background) // 4
    for burst_at in (3.0, 8.0, 12.5, 17.0):
        times.extend(burst_at + rng.uniform(0, 0.2) for _ in range(burst_size))
    times.sort()
    return [
        TraceEntry(
            at=round(at, 4),
            prompt_tokens=int(min(1800, 24 * rng.paretovariate(1.2))),
            output_tokens=int(min(256, max(4, rng.lognormvariate(3.2, 0.9)))),
        )
        for at in times
    ]


def load_trace() -> list[TraceEntry]:
    return [TraceEntry(**e) for e in json.loads(TRACE.read_text())]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def replay(
    namespace: str, policy: str, trace: list[TraceEntry]
) -> tuple[list[float], list[float]]:
    llm = await AsyncLLM.connect(namespace, host="127.0.0.1", policy=policy, name=f"bench {policy}")
    rng = random.Random(0)
    ttfts: list[float] = []
    e2es: list[float] = []

    async def one(entry: TraceEntry, start: float) -> None:
        await asyncio.sleep(max(0.0, start + entry.at - time.monotonic()))
        arrival = time.monotonic()
        prompt = [rng.randrange(1, 500) for _ in range(entry.prompt_tokens)]
        params = SamplingParams(temperature=0.0, max_tokens=entry.output_tokens, ignore_eos=True)
        first = None
        async for _ in llm.generate({"prompt_token_ids": prompt}, params):
            if first is None:
                first = time.monotonic()
        assert first is not None
        ttfts.append(first - arrival)
        e2es.append(time.monotonic() - arrival)

    start = time.monotonic() + 0.5
    await asyncio.gather(*(one(e, start) for e in trace))
    await llm.shutdown()
    return ttfts, e2es


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="replays per policy, interleaved")
    parser.add_argument("--record", action="store_true", help="regenerate the trace file")
    parser.add_argument(
        "--speed", type=float, default=1.0, help="replay the arrivals this many times faster"
    )
    parser.add_argument(
        "--num-ranks", type=int, default=4, help="data-parallel ranks (the target is for four)"
    )
    parser.add_argument("--hidden-size", type=int, default=512, help="the bench model's width")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=256,
        help="each rank's token budget per step",
    )
    args = parser.parse_args()
    if args.record or not TRACE.exists():
        TRACE.parent.mkdir(exist_ok=True)
        TRACE.write_text(json.dumps([e.__dict__ for e in record_trace()], indent=0))
    trace = load_trace()
    print(
        f"trace: {len(trace)} requests over {trace[-1].at:.0f} s, prompt tokens "
        f"p50 {statistics.median(e.prompt_tokens for e in trace):.0f} max "
        f"{max(e.prompt_tokens for e in trace)}, output tokens p50 "
        f"{statistics.median(e.output_tokens for e in trace):.0f} max "
        f"{max(e.output_tokens for e in trace)}"
    )
    trace = [TraceEntry(e.at / args.speed, e.prompt_tokens, e.output_tokens) for e in trace]
    ray.init(num_cpus=args.num_ranks, include_dashboard=False, log_to_driver=False)
    # Big enough that a step's cost grows with the tokens in it (prefill is real work), small
    # enough for four ranks on a laptop-class CPU.
    checkpoint = make_tiny_checkpoint(
        Path("/tmp/shoal-bench-lb"),
        "llama",
        hidden_size=args.hidden_size,
        num_layers=6,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=3 * args.hidden_size,
        max_position_embeddings=2048,
    )
    config = EngineConfig.from_kwargs(
        checkpoint,
        data_parallel_size=args.num_ranks,
        enable_prefix_caching=False,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_gpu_blocks_override=1024,
    )
    cluster = launch(
        config, namespace="shoal-bench-lb", resources=RankResources(num_cpus=1), host="127.0.0.1"
    )
    results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in POLICIES}
    try:
        for _ in range(args.rounds):
            for name, policy in POLICIES.items():
                ttfts, e2es = asyncio.run(replay(cluster.namespace, policy, trace))
                results[name][0].extend(ttfts)
                results[name][1].extend(e2es)
    finally:
        cluster.shutdown()
        ray.shutdown()
    print(f"\n{'policy':<26}{'TTFT p50':>10}{'TTFT p99':>10}{'E2E p50':>10}{'E2E p99':>10}   (ms)")
    p99_ttft = {}
    for name, (ttfts, e2es) in results.items():
        p99_ttft[name] = percentile(ttfts, 99)
        print(
            f"{name:<26}{statistics.median(ttfts) * 1e3:>10.0f}{p99_ttft[name] * 1e3:>10.0f}"
            f"{statistics.median(e2es) * 1e3:>10.0f}{percentile(e2es, 99) * 1e3:>10.0f}"
        )
    ours = p99_ttft["shoal least-loaded"]
    print(
        f"\np99 TTFT: round-robin / shoal = {p99_ttft['round-robin'] / ours:.2f}x (target >= 2x), "
        f"vLLM score / shoal = {p99_ttft['vLLM 4*waiting+running'] / ours:.2f}x (target >= 1x)"
    )


if __name__ == "__main__":
    main()
