"""The control plane at scale, by simulation: N ranks whose model costs next to nothing and F
front ends (DPLB clients) on one machine, measuring what grows with N and F.

Each rank is a real shoal rank (`EngineCoreActor`: the busy loop, ZMQ IO with CURVE, stats
reports, KV events, the registry's watch) serving a random Llama of one layer and width 16
(`--hidden-size`), so every cost measured is the control plane's and the data plane's, not
the model's; each reserves `--cpus-per-rank` (0.1) CPUs, so many fit on one node. Measured,
with light traffic (each front end keeps `--concurrency` short greedy requests in flight):

- attach: how long `AsyncLLM.connect` takes, per front end, while the others are attached;
- stats: the snapshots (and their msgpack bytes) each front end receives per second;
- KV events: the batches and block keys each front end applies per second;
- registry calls per second, by method (Ray's task events; needs the dashboard);
- routing: the router's cost of one request's rank choice, in microseconds;
- resize: the time of N -> N+1 and N+1 -> N (`shoal.cluster.elastic.scale`).

    .venv/bin/python bench/control_plane.py [--ranks 8] [--front-ends 2] [--window-s 10]

On a 2-core machine keep it small (8 ranks x 2 front ends takes about 4 GB); the figures of a
run on a shared machine are marked by its load average in the header line.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prefix_routing import machine
from shoal.client import AsyncLLM, SamplingParams
from shoal.client.routing.lb_client import DPLBAsyncMPClient
from shoal.cluster.elastic import scale
from shoal.cluster.launch import LaunchOptions, launch
from shoal.cluster.placement import RankResources
from shoal.engine.config import EngineConfig
from shoal.engine.protocol import EngineCoreRequest
from shoal.engine.protocol import SamplingParams as EngineSamplingParams
from tests.factories import make_tiny_checkpoint


@dataclass
class Traffic:
    """What one front end received while it was counted."""

    snapshots: int = 0
    snapshot_bytes: int = 0
    kv_batches: int = 0
    kv_keys: int = 0


@dataclass
class FrontEnd:
    llm: AsyncLLM
    attach_s: float
    traffic: Traffic = field(default_factory=Traffic)

    @property
    def client(self) -> DPLBAsyncMPClient:
        assert isinstance(self.llm.engine_core, DPLBAsyncMPClient)
        return self.llm.engine_core

    def count_traffic(self) -> None:
        """Counts every stats snapshot and KV-events batch this client handles."""
        client, traffic = self.client, self.traffic
        on_snapshot, apply_events = client._on_stats_snapshot, client.kv_index.apply_events
        encoder = msgspec.msgpack.Encoder()

        def counted_snapshot(snapshot: Any) -> None:
            traffic.snapshots += 1
            traffic.snapshot_bytes += len(encoder.encode(snapshot))
            on_snapshot(snapshot)

        def counted_events(rank: int, batch: Any) -> bool:
            traffic.kv_batches += 1
            traffic.kv_keys += len(batch.stored) + len(batch.removed)
            return apply_events(rank, batch)

        client._on_stats_snapshot = counted_snapshot  # type: ignore[method-assign]
        client.kv_index.apply_events = counted_events  # type: ignore[method-assign]


async def _load(front_ends: list[FrontEnd], concurrency: int, stop: asyncio.Event) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    done = 0

    async def worker(llm: AsyncLLM, seed: int) -> None:
        nonlocal done
        i = 0
        while not stop.is_set():
            prompt = [(seed * 131 + i * 17 + j) % 400 + 1 for j in range(40)]
            async for _ in llm.generate({"prompt_token_ids": prompt}, params):
                pass
            done += 1
            i += 1

    workers = [worker(f.llm, n) for n, f in enumerate(front_ends) for _ in range(concurrency)]
    await asyncio.gather(*workers)
    return done


def _routing_cost_us(front_end: FrontEnd, num_calls: int = 2000) -> float:
    """The median cost of one rank choice for a 64-token prompt, in microseconds."""
    client = front_end.client
    params = EngineSamplingParams(max_tokens=8)
    request = EngineCoreRequest("route-probe", list(range(1, 65)), params)
    samples = []
    for _ in range(num_calls):
        start = time.perf_counter()
        client.route(request)
        samples.append(time.perf_counter() - start)
    return 1e6 * statistics.median(samples)


def _registry_calls(dashboard: str) -> Counter[str] | None:
    """Finished calls of the registry's methods so far (Ray's task events, from this run's
    own dashboard at `dashboard`), or None without the state API."""
    try:
        from ray.util.state import summarize_tasks

        summary = summarize_tasks(address=f"http://{dashboard}", raise_on_missing_output=False)
    except Exception as e:
        print(f"  (registry calls: no state API: {e})")
        return None
    calls: Counter[str] = Counter()
    for name, entry in summary["cluster"]["summary"].items():
        if name.startswith("RegistryActor."):
            calls[name.removeprefix("RegistryActor.")] = sum(entry["state_counts"].values())
    return calls


async def _measure(args: argparse.Namespace, namespace: str, dashboard: str) -> list[FrontEnd]:
    front_ends = []
    for i in range(args.front_ends):
        start = time.monotonic()
        llm = await AsyncLLM.connect(namespace, host="127.0.0.1", name=f"front end {i}")
        front_ends.append(FrontEnd(llm, time.monotonic() - start))
    for f in front_ends:
        f.count_traffic()
    before = _registry_calls(dashboard)
    stop = asyncio.Event()
    load = asyncio.create_task(_load(front_ends, args.concurrency, stop))
    start = time.monotonic()
    await asyncio.sleep(args.window_s)
    stop.set()
    served = await load
    window = time.monotonic() - start
    after = _registry_calls(dashboard)
    print(f"window: {window:.1f} s, {served} requests served ({served / window:.1f}/s)")
    _print_front_ends(front_ends, window)
    if before is not None and after is not None:
        rates = {m: (after[m] - before[m]) / window for m in after}
        total = sum(rates.values())
        top = ", ".join(f"{m} {r:.1f}" for m, r in sorted(rates.items(), key=lambda x: -x[1])[:5])
        print(f"registry calls: {total:.1f}/s ({top})")
    print(f"routing: {_routing_cost_us(front_ends[0]):.1f} us per request (median)")
    return front_ends


def _print_front_ends(front_ends: list[FrontEnd], window: float) -> None:
    for i, f in enumerate(front_ends):
        t = f.traffic
        print(
            f"front end {i}: attach {f.attach_s:.2f} s; stats {t.snapshots / window:.1f}/s, "
            f"{t.snapshot_bytes / window / 1024:.1f} KiB/s; KV events {t.kv_batches / window:.1f}"
            f" batches/s, {t.kv_keys / window:.0f} keys/s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--front-ends", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2, help="requests per front end")
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--cpus-per-rank", type=float, default=0.1)
    parser.add_argument("--hidden-size", type=int, default=16)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    print(f"{args.ranks} ranks x {args.front_ends} front ends")
    checkpoint = make_tiny_checkpoint(
        tempfile.mkdtemp(),
        "llama",
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
    )
    config = EngineConfig.from_kwargs(
        checkpoint, data_parallel_size=args.ranks, max_model_len=256, num_gpu_blocks_override=64
    )
    num_cpus = max(4, int(args.cpus_per_rank * (args.ranks + 1)) + 2)
    context = ray.init(num_cpus=num_cpus, include_dashboard=True, log_to_driver=False)
    namespace = f"bench-control-plane-{int(time.time())}"
    try:
        start = time.monotonic()
        options = LaunchOptions(RankResources(num_cpus=args.cpus_per_rank), host="127.0.0.1")
        handle = launch(config, options, namespace=namespace)
        print(f"launch of {args.ranks} ranks: {time.monotonic() - start:.1f} s")
        try:
            front_ends = asyncio.run(_with_front_ends(args, namespace, context.dashboard_url))
            del front_ends
            for size in (args.ranks + 1, args.ranks):
                report = scale(handle, size)
                phases = ", ".join(f"{k} {v:.2f} s" for k, v in report.phases.items())
                print(f"resize {report.from_size} -> {size}: {report.total_s:.2f} s ({phases})")
        finally:
            handle.shutdown()
    finally:
        ray.shutdown()


async def _with_front_ends(
    args: argparse.Namespace, namespace: str, dashboard: str
) -> list[FrontEnd]:
    front_ends = await _measure(args, namespace, dashboard)
    for f in front_ends:
        await f.llm.aclose()
    return front_ends


if __name__ == "__main__":
    main()
