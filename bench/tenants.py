"""Tenants sharing one cluster through `shoal serve --port`: isolation from a flood, and
throughput shares against weights under saturation.

    .venv/bin/python bench/tenants.py [--model smollm2|tiny] [--flood-streams 1000]
        [--shares a:1,b:1,c:2] [--share-streams 48] [--window-s 60] [--front-ends 1|2]
        [--admission-scope cluster|front-end] [--max-num-seqs 32] [--parts isolation,shares]

1. Isolation. The victim tenant sends one streamed completion after another (32-token prompt,
   16 tokens out), first alone (its unloaded TTFT), then while the flood tenant holds
   `--flood-streams` streams open (each re-sent as it ends; after a 429 or 503 it waits the
   `Retry-After` it got). Printed: the victim's TTFT p50 / p90 alone and under the flood, their
   ratio (target: p90 within 3x), the flood's tokens/s and how often it was refused. With
   `--front-ends 2` a second front end (`shoal api-server`) attaches; the flood's streams are
   split over both, and the victim goes through the second: run it with each
   `--admission-scope` to see how the front ends' admissions add up (the engines' waiting
   requests are sampled from `/metrics`).
2. Shares. Every tenant of `--shares NAME:WEIGHT,...` keeps `--share-streams` streams busy
   (16 tokens out) for `--window-s` after a warm-up; printed per tenant: TTFT p50 / p90, tokens
   generated in the window (the server's `shoal:tenant_generation_tokens_total`), its share of
   them against its weight's share (target: within 10% of it), and its 429s.

The engine runs with `--max-num-seqs 32` unless told otherwise: on a CPU a step's time grows
with its batch, and the seats bound the batch (and with it, through the admission capacity,
the flood's share of each step). The flood runs in a process of its own and the client is a
minimal asyncio HTTP/1.1 reader, as the machine's cores are the server's too. Figures depend
on the machine: the CPU model and flags are printed first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:  # imported where used: the flood's process needs none of them (nor Ray)
    from tests.deploy.openai_utils import FrontEnd

VICTIM_BODY = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
LOAD_BODY = {"max_tokens": 64, "temperature": 0.0, "ignore_eos": True}
# Short, so that many finish in the window: tokens are counted as their requests end.
SHARE_BODY = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}


@dataclass
class Reply:
    status: int
    ttft_s: float | None = None
    retry_after_s: float = 0.0


async def post_stream(port: int, key: str, body: dict[str, Any]) -> Reply:
    """POSTs a streamed completion and reads it to its end; TTFT is the first data event's."""
    payload = json.dumps({**body, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    try:
        writer.write(head + payload)
        status = int((await reader.readline()).split()[1])
        retry_after = 0.0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "retry-after":
                retry_after = float(value)
        reply = Reply(status, retry_after_s=retry_after)
        while line := await reader.readline():
            if line.startswith(b"data: ") and reply.ttft_s is None:
                reply.ttft_s = time.monotonic() - start
        return reply
    finally:
        writer.close()


@dataclass
class Tally:
    """One tenant's replies."""

    ttfts: list[float] = field(default_factory=list)
    refused: dict[int, int] = field(default_factory=dict)
    num_ok: int = 0

    def add(self, reply: Reply) -> None:
        if reply.status == 200 and reply.ttft_s is not None:
            self.num_ok += 1
            self.ttfts.append(reply.ttft_s)
        else:
            self.refused[reply.status] = self.refused.get(reply.status, 0) + 1

    def p(self, q: float) -> float:
        if not self.ttfts:
            return float("nan")
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def keep_busy(
    port: int, key: str, num_streams: int, body: dict[str, Any], stop: asyncio.Event, tally: Tally
) -> None:
    """`num_streams` streams, each sent again as it ends (after `Retry-After` when refused)."""

    async def one(i: int) -> None:
        while not stop.is_set():
            try:
                reply = await post_stream(port, key, {**body, "prompt": f"stream {i} says"})
            except (OSError, ValueError, IndexError):  # reset, or cut off mid-answer
                reply = Reply(0, retry_after_s=1.0)
            tally.add(reply)
            if reply.status != 200:
                await asyncio.sleep(max(reply.retry_after_s, 0.2))

    tasks = [asyncio.create_task(one(i)) for i in range(num_streams)]
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def victim_loop(port: int, key: str, num_requests: int) -> Tally:
    tally = Tally()
    prompt = " ".join(["word"] * 30)
    for i in range(num_requests):
        tally.add(await post_stream(port, key, {**VICTIM_BODY, "prompt": f"{i} {prompt}"}))
    return tally


def _load_process(
    port: int, key: str, num_streams: int, started: Any, stop: Any, results: Any
) -> None:
    """`keep_busy` in a process of its own, so that reading the flood's streams does not
    delay the victim's client; sets `started`, and sends its `Tally` back once `stop` is set."""

    async def main() -> Tally:
        done, tally = asyncio.Event(), Tally()
        busy = asyncio.create_task(keep_busy(port, key, num_streams, LOAD_BODY, done, tally))
        started.set()
        while not stop.is_set():
            await asyncio.sleep(0.2)
        done.set()
        await busy
        return tally

    tally = asyncio.run(main())
    results.put((tally.num_ok, tally.refused))


async def _sample_waiting(base_url: str, stop: asyncio.Event, peaks: list[float]) -> None:
    from tests.deploy.openai_utils import scrape, total

    while not stop.is_set():
        samples = await asyncio.to_thread(scrape, base_url)
        peaks.append(total(samples, "vllm:num_requests_waiting"))
        await asyncio.sleep(0.5)


class _Floods:
    """The flood tenant's streams, split evenly over `front_ends`, each part in a process."""

    def __init__(self, front_ends: list[FrontEnd], num_streams: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.stop, self.results = context.Event(), context.Queue()
        self.started = [context.Event() for _ in front_ends]
        self.processes = [
            context.Process(
                target=_load_process,
                args=(
                    fe.port,
                    "k-flood",
                    num_streams // len(front_ends),
                    started,
                    self.stop,
                    self.results,
                ),
            )
            for fe, started in zip(front_ends, self.started, strict=True)
        ]

    async def start(self) -> None:
        for process in self.processes:
            process.start()
        for started in self.started:
            await asyncio.to_thread(started.wait)

    async def finish(self) -> tuple[int, dict[int, int]]:
        """Stops the streams; returns how many were served and refused (by status)."""
        self.stop.set()
        num_ok, refused = 0, {}
        for _ in self.processes:
            ok, by_status = await asyncio.to_thread(self.results.get)
            num_ok += ok
            for status, count in by_status.items():
                refused[status] = refused.get(status, 0) + count
        for process in self.processes:
            process.join()
        return num_ok, refused


async def isolation(args: argparse.Namespace, front_ends: list[FrontEnd]) -> None:
    victim_fe = front_ends[-1]
    alone = await victim_loop(victim_fe.port, "k-victim", args.victim_requests)
    floods = _Floods(front_ends, args.flood_streams)
    await floods.start()
    stop, waiting = asyncio.Event(), [0.0]
    sampler = asyncio.create_task(_sample_waiting(victim_fe.base_url, stop, waiting))
    await asyncio.sleep(args.warmup_s)  # the flood fills the cluster and its queue
    start, tokens_before = time.monotonic(), _generated(front_ends, "flood")
    loaded = await victim_loop(victim_fe.port, "k-victim", args.victim_requests)
    elapsed = time.monotonic() - start
    tokens = _generated(front_ends, "flood") - tokens_before
    victim_waits = _series(victim_fe, "shoal:tenant_requests_queued_total", "victim")
    stop.set()
    await sampler
    num_flood_ok, flood_refused = await floods.finish()
    ratio = loaded.p(0.9) / alone.p(0.9)
    print(
        f"isolation ({args.flood_streams} flood streams over {len(front_ends)} front end(s), "
        f"the victim on the last; scope {args.admission_scope}):\n"
        f"  victim TTFT alone   p50 {alone.p(0.5) * 1000:7.0f} ms  p90 {alone.p(0.9) * 1000:7.0f} ms\n"
        f"  victim TTFT flooded p50 {loaded.p(0.5) * 1000:7.0f} ms  p90 {loaded.p(0.9) * 1000:7.0f} ms"
        f"  -> p90 {ratio:.2f}x unloaded (target <= 3x){'' if ratio <= 3 else '  NOT MET'}\n"
        f"  victim refused {loaded.refused or 0}, waited for admission {victim_waits:.0f} "
        f"times; flood {tokens / elapsed:.1f} tokens/s, "
        f"{num_flood_ok} streams served, refused {flood_refused}; engines' waiting requests "
        f"peak {max(waiting):.0f}"
    )


def _series(front_end: FrontEnd, name: str, tenant: str) -> float:
    from tests.deploy.openai_utils import scrape, total

    return total(scrape(front_end.base_url), name, tenant=tenant)


def _generated(front_ends: list[FrontEnd], tenant: str) -> float:
    return sum(_series(fe, "shoal:tenant_generation_tokens_total", tenant) for fe in front_ends)


async def shares(args: argparse.Namespace, front_end: FrontEnd) -> None:
    weights = {name: float(w) for name, _, w in (s.partition(":") for s in args.shares.split(","))}
    stop, tallies = asyncio.Event(), {name: Tally() for name in weights}
    loads = [
        asyncio.create_task(
            keep_busy(front_end.port, f"k-{n}", args.share_streams, SHARE_BODY, stop, tallies[n])
        )
        for n in weights
    ]
    await asyncio.sleep(args.warmup_s)
    before = {n: _generated([front_end], n) for n in weights}
    for tally in tallies.values():
        tally.ttfts.clear()
    await asyncio.sleep(args.window_s)
    generated = {n: _generated([front_end], n) - before[n] for n in weights}
    stop.set()
    await asyncio.gather(*loads)
    all_tokens, all_weight = sum(generated.values()), sum(weights.values())
    print(f"shares ({args.share_streams} streams each, {args.window_s:.0f} s window):")
    for name, weight in weights.items():
        share, target = generated[name] / max(all_tokens, 1), weight / all_weight
        off = abs(share - target) / target
        print(
            f"  {name:<8} weight {weight:<4g} TTFT p50 {tallies[name].p(0.5) * 1000:7.0f} ms "
            f"p90 {tallies[name].p(0.9) * 1000:7.0f} ms  {generated[name] / args.window_s:7.1f} "
            f"tokens/s  share {share:6.1%} vs {target:6.1%} ({off:.0%} off; target <= 10%"
            f"{'' if off <= 0.1 else ', NOT MET'})  refused {tallies[name].refused}"
        )


def _key_file(args: argparse.Namespace) -> str:
    lines = ["victim k-victim", "flood k-flood"]
    for spec in args.shares.split(","):
        name, _, weight = spec.partition(":")
        lines.append(f"{name} k-{name} weight={weight}")
    return "\n".join(lines) + "\n"


def _serve_args(args: argparse.Namespace, root: Path, namespace: str) -> list[str]:
    from tests.factories import make_tiny_checkpoint

    if args.model == "tiny":
        model = make_tiny_checkpoint(root / "tiny-llama", "llama", max_position_embeddings=512)
        engine = ["--max-model-len", "512", "--num-gpu-blocks-override", "1024"]
    else:
        from shoal.engine.loader import smollm2_gguf_path

        model, engine = smollm2_gguf_path(), ["--max-model-len", "1024", "--dtype", "float32"]
    if args.max_num_seqs:
        engine += ["--max-num-seqs", str(args.max_num_seqs)]
    return [
        "serve", "--model", model, "--namespace", namespace, "--host", "127.0.0.1",
        "--data-parallel-address", "127.0.0.1", "--api-key-file", str(root / "api.keys"),
        "--admission-scope", args.admission_scope, *engine,
    ]  # fmt: skip


async def run(args: argparse.Namespace, front_ends: list[FrontEnd]) -> None:
    if "isolation" in args.parts:
        await isolation(args, front_ends)
    if "shares" in args.parts:
        await shares(args, front_ends[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--flood-streams", type=int, default=1000)
    parser.add_argument("--victim-requests", type=int, default=30)
    parser.add_argument("--shares", default="a:1,b:1,c:2")
    parser.add_argument("--share-streams", type=int, default=48)
    parser.add_argument("--window-s", type=float, default=120.0)
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument("--front-ends", type=int, choices=(1, 2), default=1)
    parser.add_argument("--admission-scope", choices=("cluster", "front-end"), default="cluster")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--parts", default="isolation,shares")
    args = parser.parse_args()
    from bench.cpu import cpu_kind
    from tests.deploy.openai_utils import start_shoal
    from tests.ray_utils import start_ray_head, stop_ray_head, unique_namespace

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a socket per stream
    print(f"{cpu_kind()}; model {args.model}")
    root = Path(tempfile.mkdtemp(prefix="shoal-tenants-"))
    (root / "api.keys").write_text(_key_file(args))
    namespace = unique_namespace("tenants")
    head = start_ray_head()
    front_ends: list[FrontEnd] = []
    try:
        front_ends.append(start_shoal(head, _serve_args(args, root, namespace), root / "serve.log"))
        if args.front_ends == 2:
            attach = [
                "api-server", "--namespace", namespace, "--host", "127.0.0.1",
                "--api-key-file", str(root / "api.keys"), "--admission-scope", args.admission_scope,
            ]  # fmt: skip
            front_ends.append(start_shoal(head, attach, root / "api-server.log"))
        asyncio.run(run(args, front_ends))
    finally:
        for front_end in reversed(front_ends):
            front_end.stop()
        stop_ray_head(head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
