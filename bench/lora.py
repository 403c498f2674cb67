"""Multi-LoRA serving on two ranks: 16 adapters of Zipf popularity, shoal against vLLM.

Requests arrive in a Poisson process (`--rate` per second, `--num-requests` of them, the same
times, prompts and adapters for every system); each asks for adapter i of 16 with probability
proportional to 1 / (i + 1)^`--zipf`, with a random prompt of 64-256 tokens (no shared
prefixes: only the adapters decide where a request is best served) and `--max-tokens` output
tokens, streamed through the official `openai` client. Each rank has `--max-loras` adapter
slots and keeps all 16 in CPU memory (`--max-cpu-loras 16`), so an adapter new to a slot is
copied in from memory, pushing out the least recently used one.

Systems, each an OpenAI server with two data-parallel ranks of one thread each, the same tiny
random Llama (512 wide, 6 layers, head size 64), the same adapters (PEFT, rank 8, on every
projection), KV blocks and step budget (see `prefix_routing_peers.py`):

- "shoal lora-aware": `shoal serve --enable-lora`, cache-aware routing with its default cost
  of loading an adapter, which gathers an adapter's requests on the ranks that hold it;
- "shoal cache-aware": the same with `--routing-lora-load-cost 0`: routing blind to adapters;
- "vllm": vLLM's CPU build (the one installed beside shoal) with `--enable-lora` and its own
  DP=2 load balancer.

A system is started fresh per round, warmed up (base requests, then the two least popular
adapters), then replays the trace; each round starts with the next system. Printed per
system: output tokens per second, TTFT p50 / p90, and the adapter loads and evictions per
1,000 requests, summed over the ranks' `shoal:lora_adapter_{loads,evictions}_total` (vLLM
exports no such counter); then the ratios the targets name, the CPU and the load average.

    .venv/bin/python bench/lora.py [--rounds 1] [--rate 3] [--num-requests 240] \
        [--systems "shoal lora-aware,shoal cache-aware,vllm"] [--max-loras 4] \
        [--lora-load-cost TOKENS]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefix_routing import model_path
from prefix_routing_peers import (
    SERVED_NAME,
    ServerConfig,
    metric_totals,
    new_log_dir,
    serving,
    stream_completion,
)
from prefix_routing_workload import TOKEN_IDS, percentile

from bench.cpu import cpu_kind

LORA_AWARE, CACHE_AWARE, VLLM = "shoal lora-aware", "shoal cache-aware", "vllm"
NUM_ADAPTERS = 16
LORA_RANK = 8


@dataclass
class Request:
    at: float  # seconds after the replay's start
    adapter: str
    prompt: list[int]


@dataclass
class Run:
    """What one replay measured."""

    ttfts: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    seconds: float = 0.0
    num_failed: int = 0
    num_loads: float | None = None  # None: the server exports no load counter
    num_evictions: float | None = None


def make_trace(num_requests: int, rate: float, zipf: float, seed: int) -> list[Request]:
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** zipf for i in range(NUM_ADAPTERS)]
    names = adapter_names()
    trace, at = [], 0.0
    for _ in range(num_requests):
        adapter = rng.choices(names, weights)[0]
        prompt = [rng.randrange(*TOKEN_IDS) for _ in range(rng.randint(64, 256))]
        trace.append(Request(at, adapter, prompt))
        at += rng.expovariate(rate)
    return trace


def adapter_names() -> list[str]:
    return [f"adapter{i:02d}" for i in range(NUM_ADAPTERS)]


def make_adapters(base: str) -> dict[str, str]:
    """16 PEFT adapters of the base (rank 8 on every projection), made once."""
    from tests.lora_factories import make_lora_adapter

    root = Path(base).parent / f"{Path(base).name}-adapters"
    paths = {}
    for seed, name in enumerate(adapter_names()):
        path = root / name
        if not (path / "adapter_config.json").exists():
            make_lora_adapter(path, base, rank=LORA_RANK, alpha=16.0, seed=seed, scale=0.05)
        paths[name] = str(path)
    return paths


def lora_counters(port: int) -> tuple[float | None, float | None]:
    """(loads, evictions) summed over a server's engines, or None where it has no counter."""
    loads, evictions = "shoal:lora_adapter_loads_total", "shoal:lora_adapter_evictions_total"
    totals = metric_totals(port, (loads, evictions))
    return totals.get(loads), totals.get(evictions)


async def _one(client: Any, model: str, prompt: list[int], max_tokens: int, run: Run) -> None:
    first, num_tokens = await stream_completion(client, model, prompt, max_tokens)
    run.num_output_tokens += num_tokens
    if first is None:
        run.num_failed += 1
    else:
        run.ttfts.append(first)


def _client(port: int) -> Any:
    import openai

    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=900
    )


async def warm_up(port: int) -> None:
    """Base requests of several lengths, then the two least popular adapters (so the LoRA
    path has run), twice."""
    client = _client(port)
    rng = random.Random(99)
    run = Run()
    for _ in range(2):
        prompts = [[rng.randrange(*TOKEN_IDS) for _ in range(n)] for n in (256, 64, 8)]
        await asyncio.gather(*(_one(client, SERVED_NAME, p, 8, run) for p in prompts))
        await asyncio.gather(
            *(_one(client, name, prompts[1], 8, run) for name in adapter_names()[-2:])
        )
    await client.close()
    if run.num_failed:
        raise RuntimeError(f"{run.num_failed} warm-up requests failed")


async def replay(port: int, trace: list[Request], max_tokens: int) -> Run:
    client = _client(port)
    run = Run()
    loads_before, evictions_before = lora_counters(port)
    started = time.monotonic()
    tasks = []
    for request in trace:
        await asyncio.sleep(max(0.0, started + request.at - time.monotonic()))
        tasks.append(
            asyncio.create_task(_one(client, request.adapter, request.prompt, max_tokens, run))
        )
    await asyncio.gather(*tasks)
    run.seconds = time.monotonic() - started
    await client.close()
    await asyncio.sleep(1.5)  # the engines' last stats reach the front end's /metrics
    loads_after, evictions_after = lora_counters(port)
    if loads_before is not None and loads_after is not None:
        run.num_loads = loads_after - loads_before
    if evictions_before is not None and evictions_after is not None:
        run.num_evictions = evictions_after - evictions_before
    return run


def _per_1000(count: float | None, run: Run) -> str:
    if count is None:
        return "n/a"
    return f"{1000 * count / max(1, len(run.ttfts) + run.num_failed):.0f}"


def _row(system: str, run: Run) -> str:
    tps = run.num_output_tokens / run.seconds if run.seconds else 0.0
    ttft = (percentile(run.ttfts, 50) * 1e3, percentile(run.ttfts, 90) * 1e3)
    return (
        f"{system:<18} {tps:>8.1f} {ttft[0]:>9.0f} {ttft[1]:>9.0f} "
        f"{_per_1000(run.num_loads, run):>11} {_per_1000(run.num_evictions, run):>11} "
        f"{run.num_failed:>6}"
    )


def report(results: dict[str, list[Run]]) -> None:
    print(
        f"\n{'system':<18} {'tokens/s':>8} {'TTFT p50':>9} {'TTFT p90':>9} "
        f"{'loads/1000':>11} {'evict/1000':>11} {'failed':>6}"
    )
    for system, runs in results.items():
        for run in runs:
            print(_row(system, run))
    if LORA_AWARE not in results:
        return
    ours = results[LORA_AWARE]
    for other, label in ((VLLM, "vLLM"), (CACHE_AWARE, "plain cache-aware")):
        if other not in results:
            continue
        for i, (a, b) in enumerate(zip(ours, results[other], strict=False)):
            tput = (a.num_output_tokens / a.seconds) / max(1e-9, b.num_output_tokens / b.seconds)
            p90 = percentile(a.ttfts, 90) / max(1e-9, percentile(b.ttfts, 90))
            line = f"round {i + 1}: lora-aware vs. {label}: throughput {tput:.2f}x, "
            line += f"TTFT p90 {p90:.2f}x"
            if a.num_loads is not None and b.num_loads:
                line += f", adapter loads {a.num_loads / b.num_loads:.2f}x"
            print(line)


def shoal_flags(system: str, lora_load_cost: float | None) -> tuple[str, ...]:
    if system == CACHE_AWARE:
        return ("--routing-lora-load-cost", "0")
    if system == LORA_AWARE and lora_load_cost is not None:
        return ("--routing-lora-load-cost", str(lora_load_cost))
    return ()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--rate", type=float, default=3.0, help="requests per second")
    parser.add_argument("--num-requests", type=int, default=240)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--zipf", type=float, default=1.0, help="popularity exponent")
    parser.add_argument("--max-loras", type=int, default=4, help="adapter slots per rank")
    parser.add_argument("--systems", default=f"{LORA_AWARE},{CACHE_AWARE},{VLLM}")
    parser.add_argument(
        "--lora-load-cost",
        type=float,
        help="lora-aware's --routing-lora-load-cost (default: shoal's)",
    )
    parser.add_argument("--kv-blocks", type=int, default=256, help="per rank, 32 tokens each")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    systems = [s.strip() for s in args.systems.split(",")]
    unknown = set(systems) - {LORA_AWARE, CACHE_AWARE, VLLM}
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}")

    base = model_path(512)
    adapters = make_adapters(base)
    modules = [f"{name}={path}" for name, path in adapters.items()]
    lora_flags = (
        "--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank", str(LORA_RANK),
        "--max-cpu-loras", str(NUM_ADAPTERS), "--lora-modules", *modules,
    )  # fmt: skip
    trace = make_trace(args.num_requests, args.rate, args.zipf, args.seed)
    counts = {name: sum(r.adapter == name for r in trace) for name in adapter_names()}
    print(cpu_kind())
    print(
        f"{len(trace)} requests over {trace[-1].at:.0f} s, {NUM_ADAPTERS} adapters (requests "
        f"each: {', '.join(str(c) for c in counts.values())}), {args.max_loras} slots per rank",
        flush=True,
    )
    log_dir = new_log_dir()
    print(f"server logs in {log_dir}", flush=True)
    results: dict[str, list[Run]] = {s: [] for s in systems}
    for round_index in range(args.rounds):
        shift = round_index % len(systems)
        for system in systems[shift:] + systems[:shift]:
            config = ServerConfig(
                model=base,
                block_size=32,
                kv_blocks=args.kv_blocks,
                max_num_batched_tokens=512,
                max_num_seqs=32,
                max_model_len=2048,
                start_timeout_s=args.start_timeout,
                extra_flags=lora_flags,
                shoal_flags=shoal_flags(system, args.lora_load_cost),
                vllm_python=sys.executable,
            )
            peer = "vllm" if system == VLLM else "shoal cache-aware"
            with serving(peer, config, log_dir) as port:
                asyncio.run(warm_up(port))
                run = asyncio.run(replay(port, trace, args.max_tokens))
            results[system].append(run)
            print(f"  round {round_index + 1} {system}: {_row(system, run)}", flush=True)
    report(results)
    print(cpu_kind())


if __name__ == "__main__":
    main()
