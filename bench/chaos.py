"""Chaos under sustained load: two drivers and one HTTP front end stream greedy requests over a
tiny dense cluster on a simulated multi-node Ray cluster while a fault is injected every 15-30 s.
Ray runs as a head with no CPUs (this process, the control actors) and `--nodes` worker
raylets of `--node-cpus` CPUs that hold the ranks, spread (bench/chaos_cluster.py).

Faults (`--faults`, all by default): `kill` SIGKILLs a rank's actor process; `hang` SIGSTOPs
one past the clients' hang detection (`--hang-s`, then SIGCONT); `coordinator` kills the
coordinator actor (Ray restarts it); `resize` scales the cluster one rank up or down (between 2
and 4); `front_end` stops the HTTP front end abruptly and starts a new one; `node` SIGKILLs
every process of a worker node that holds ranks (not all: else it is skipped) and starts a
new node, as Kubernetes would recreate the pod, where the lost ranks restart if none has room.

It prints the requests started, finished, failed, duplicated (more tokens than the reference,
which it starts with) and wrong (any other difference from the greedy reference computed before
the run); the requests in flight through a front end that was itself killed, apart (that loss
is the HTTP client's to retry); the migrations; per fault kind the longest wait for the next
output of any stream in flight when it struck; and the drivers' output tokens/s before the
first fault, in the 10 s after each, and after the last.

    .venv/bin/python bench/chaos.py [--minutes 10] [--faults kill,hang,coordinator,resize,
        front_end,node] [--nodes 2] [--node-cpus 2] [--max-tokens 48] [--concurrency 3] [--seed 0]

Targets: 0 requests lost or wrong among those not on a killed front end; longest stall <= 3 s
for a killed rank or node, <= the hang detection (about 4 s) + 2 s for a hung one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import openai
import ray
import uvicorn
from chaos_cluster import SimulatedCluster
from chaos_report import Fault, Stream, print_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import cpu_kind
from shoal.actors.membership import RankState
from shoal.client import AsyncLLM, SamplingParams
from shoal.cluster.launch import ClusterHandle, LaunchOptions, launch
from shoal.cluster.placement import RankResources
from shoal.deploy.openai.app import build_app
from shoal.deploy.openai.state import ServerState
from shoal.engine.config import EngineConfig
from shoal.engine.errors import EngineDeadError, RequestError
from shoal.engine.protocol import RequestOutputKind
from tests.factories import make_tiny_checkpoint
from tests.ray_utils import free_port

PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 17], [42] * 9, [7, 300, 11, 12], [9, 8, 7, 6, 5, 4]]
MODEL = "tiny"
NAMESPACE = "bench-chaos"
FAULTS = ("kill", "hang", "coordinator", "resize", "front_end", "node")


class NoTarget(Exception):
    """A fault that found nothing it may strike (it is skipped, not counted)."""


class FrontEnd:
    """The HTTP front end: uvicorn over an `AsyncLLM.connect` in this process; `kill` drops it
    abruptly (its open streams break) and `start` serves again, on a new port (as a new pod
    behind a Service would)."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.port = free_port()
        self.generation = 0
        self.is_down = True  # between a kill and the next start
        self.migrated = 0  # of the front ends killed so far
        self._llm: AsyncLLM | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.port = free_port()
        self._llm = await AsyncLLM.connect(self.namespace, host="127.0.0.1", name="chaos http")
        app = build_app(ServerState.make(self._llm, MODEL, None))
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical")
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(_serve(self._server))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it did not start
            await asyncio.sleep(0.02)
        self.generation += 1
        self.is_down = False

    async def kill(self) -> None:
        assert self._server is not None and self._task is not None and self._llm is not None
        self.is_down = True
        self.migrated += _migrated(self._llm)
        self._server.should_exit = self._server.force_exit = True
        with contextlib.suppress(TimeoutError, RuntimeError):
            await asyncio.wait_for(self._task, 10)  # open streams are cut, not waited for
        await self._llm.aclose()

    def migrations(self) -> int:
        return self.migrated + (_migrated(self._llm) if self._llm is not None else 0)


def _params(max_tokens: int) -> SamplingParams:
    """Greedy, every output a delta: a stream's deltas joined are what its caller got."""
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )


async def _serve(server: uvicorn.Server) -> None:
    try:
        await server.serve()
    except SystemExit as e:  # uvicorn's way to say it could not start: not this process's end
        raise RuntimeError(f"the front end did not start (uvicorn exit {e.code})") from None


def _migrated(llm: AsyncLLM) -> int:
    stats = llm.routing_stats()
    return sum(stats.migrated.values()) if stats is not None else 0


async def _driver_load(
    llm: AsyncLLM, name: str, max_tokens: int, stop: asyncio.Event, out: list[Stream]
) -> None:
    params = _params(max_tokens)
    index = 0
    while not stop.is_set():
        stream = Stream(name, index % len(PROMPTS), time.monotonic())
        index += 1
        out.append(stream)
        try:
            prompt = {"prompt_token_ids": PROMPTS[stream.prompt]}
            async for output in llm.generate(prompt, params):
                new = output.outputs[0].token_ids
                stream.events.append((time.monotonic(), len(new)))
                stream.token_ids.extend(new)
        except (EngineDeadError, RequestError) as e:
            stream.error = str(e)
        stream.finished_at = time.monotonic()
        if llm.errored:  # the client is dead for good: every further request would fail at once
            print(f"{name}: the client is dead ({stream.error}); this driver stops", flush=True)
            return


async def _http_load(
    front: FrontEnd, max_tokens: int, stop: asyncio.Event, out: list[Stream]
) -> None:
    index = 0
    while not stop.is_set():
        stream = Stream("http", index % len(PROMPTS), time.monotonic())
        index += 1
        out.append(stream)
        generation = front.generation
        api = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{front.port}/v1", api_key="-", max_retries=0, timeout=60
        )
        try:
            chunks = await api.completions.create(
                model=MODEL,
                prompt=PROMPTS[stream.prompt],
                max_tokens=max_tokens,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in chunks:
                for choice in chunk.choices:
                    stream.events.append((time.monotonic(), 1))
                    stream.text += choice.text
        except openai.OpenAIError as e:
            stream.error = str(e)
            stream.on_killed_front_end = front.is_down or front.generation != generation
            if stream.on_killed_front_end:
                await asyncio.sleep(0.2)  # until the front end serves again
        finally:
            await api.close()
        stream.finished_at = time.monotonic()


async def _rank_pids(handle: ClusterHandle) -> dict[int, int]:
    membership = await asyncio.to_thread(handle.membership)
    ready = [r for r, info in membership.ranks.items() if info.state == RankState.READY]
    pids: dict[int, int] = {}
    for rank in ready:
        with contextlib.suppress(Exception):
            pids[rank] = int((await handle.engine(rank).health.remote())["pid"])
    return pids


class Chaos:
    """The fault injectors, over one cluster."""

    def __init__(
        self,
        handle: ClusterHandle,
        driver: AsyncLLM,
        front: FrontEnd,
        cluster: SimulatedCluster,
        args: argparse.Namespace,
    ) -> None:
        self.handle, self.driver, self.front, self.args = handle, driver, front, args
        self.cluster = cluster
        self.rng = random.Random(args.seed)
        self.size = args.ranks

    def injectors(self) -> dict[str, Callable[[], Awaitable[str]]]:
        return {
            "kill": self.kill_rank,
            "hang": self.hang_rank,
            "coordinator": self.kill_coordinator,
            "resize": self.resize,
            "front_end": self.restart_front_end,
            "node": self.lose_node,
        }

    async def kill_rank(self) -> str:
        pids = await _rank_pids(self.handle)
        rank = self.rng.choice(sorted(pids))
        os.kill(pids[rank], signal.SIGKILL)
        return f"rank {rank}"

    async def hang_rank(self) -> str:
        pids = await _rank_pids(self.handle)
        rank = self.rng.choice(sorted(pids))
        os.kill(pids[rank], signal.SIGSTOP)
        await asyncio.sleep(self.args.hang_s)
        with contextlib.suppress(ProcessLookupError):  # the registry had it killed
            os.kill(pids[rank], signal.SIGCONT)
        return f"rank {rank} for {self.args.hang_s:g} s"

    async def kill_coordinator(self) -> str:
        ray.kill(cast(Any, self.handle.coordinator), no_restart=False)
        return ""

    async def resize(self) -> str:
        to = self.size + (
            1 if self.size <= 2 or (self.size < 4 and self.rng.random() < 0.5) else -1
        )
        try:
            await self.driver.scale_elastic_ep(to)
        except Exception as e:  # refused or rolled back (a rank was restarting, say)
            return f"{self.size} -> {to} failed: {type(e).__name__}: {e}"
        self.size, old = to, self.size
        return f"{old} -> {to}"

    async def restart_front_end(self) -> str:
        await self.front.kill()
        await self.front.start()
        return ""

    async def lose_node(self) -> str:
        """Loses a worker node that holds serving ranks, never all of them (with no survivor
        every stream fails: an outage, not a failover), and adds a new one."""
        held = self.cluster.ranks_by_node(await _rank_pids(self.handle))
        if len(held) < 2:
            raise NoTarget("every serving rank is on one node")
        node = self.rng.choice(sorted(held, key=lambda n: n.name))
        await asyncio.to_thread(self.cluster.lose, node)
        lost_at = time.monotonic()
        new = await asyncio.to_thread(self.cluster.add_node)
        joined_s = time.monotonic() - lost_at
        serve_s = await self._until_all_serve(lost_at, timeout_s=120.0)
        serve = f"{serve_s:.1f} s" if serve_s is not None else "over 120 s"
        return (
            f"{node.name} (ranks {held[node]}); "
            f"{new.name} up in {joined_s:.1f} s, all serve in {serve}"
        )

    async def _until_all_serve(self, since: float, timeout_s: float) -> float | None:
        """Seconds from `since` until every rank of the cluster is READY; None past timeout."""
        while time.monotonic() < since + timeout_s:
            try:
                membership = await asyncio.to_thread(self.handle.membership)
            except ray.exceptions.RayActorError:  # the registry was on the lost node: restarting
                await asyncio.sleep(0.5)
                continue
            states = [info.state for info in membership.ranks.values()]
            if len(states) == self.size and all(s == RankState.READY for s in states):
                return time.monotonic() - since
            await asyncio.sleep(0.5)
        return None


async def _reference(
    llm: AsyncLLM, front: FrontEnd, max_tokens: int
) -> tuple[dict[int, list[int]], dict[int, str]]:
    params = _params(max_tokens)
    tokens: dict[int, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        async for output in llm.generate({"prompt_token_ids": prompt}, params):
            tokens.setdefault(i, []).extend(output.outputs[0].token_ids)
    api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{front.port}/v1", api_key="-")
    texts = {}
    for i, prompt in enumerate(PROMPTS):
        completion = await api.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        texts[i] = completion.choices[0].text
    await api.close()
    return tokens, texts


async def _run(args: argparse.Namespace, checkpoint: str, cluster: SimulatedCluster) -> None:
    config = EngineConfig.from_kwargs(
        checkpoint,
        data_parallel_size=args.ranks,
        num_gpu_blocks_override=256,
        max_model_len=256,
        max_num_batched_tokens=128,
    )
    # Detached: the ranks' placement groups and actors outlive any one node but the head.
    options = LaunchOptions(
        RankResources(num_cpus=1), placement_strategy="spread", host="127.0.0.1", detached=True
    )
    handle = launch(config, options, namespace=NAMESPACE)
    drivers = [
        await AsyncLLM.connect(handle.namespace, host="127.0.0.1", name=f"chaos driver {i}")
        for i in range(2)
    ]
    front = FrontEnd(handle.namespace)
    await front.start()
    streams: list[Stream] = []
    faults: list[Fault] = []
    try:
        references, texts = await _reference(drivers[0], front, args.max_tokens)
        stop = asyncio.Event()
        loads = [
            _driver_load(d, f"driver {i}", args.max_tokens, stop, streams)
            for i, d in enumerate(drivers)
            for _ in range(args.concurrency)
        ] + [_http_load(front, args.max_tokens, stop, streams) for _ in range(args.concurrency)]
        tasks = [asyncio.create_task(load) for load in loads]
        chaos = Chaos(handle, drivers[0], front, cluster, args)
        injectors = chaos.injectors()
        kinds = args.faults.split(",")
        started = time.monotonic()
        end = started + args.minutes * 60 - args.tail_s
        await asyncio.sleep(args.rng_min_s)
        while time.monotonic() < end:
            kind = chaos.rng.choice(kinds)
            fault = Fault(kind, time.monotonic())
            print(f"{fault.at - started:7.1f} s  {kind:<12}", end=" ", flush=True)
            try:
                fault.note = await injectors[kind]()
            except NoTarget as e:
                print(f"skipped: {e}", flush=True)
                continue
            except ray.exceptions.RayActorError as e:  # the registry restarts after a node loss
                print(f"skipped: the cluster's control plane did not answer ({e!r:.80})")
                continue
            faults.append(fault)
            print(fault.note, flush=True)
            await asyncio.sleep(chaos.rng.uniform(args.rng_min_s, args.rng_max_s))
        last = time.monotonic()
        await asyncio.sleep(args.tail_s)
        stop.set()
        stopped = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), 180)
        migrations = sum(_migrated(d) for d in drivers) + front.migrations()
        print_report(args, streams, faults, references, texts, migrations, (started, last, stopped))
    finally:
        for d in drivers:
            await d.aclose()
        with contextlib.suppress(Exception):
            await front.kill()
        handle.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2, help="worker nodes (the head holds none)")
    parser.add_argument("--node-cpus", type=int, default=2, help="CPUs (ranks) per worker node")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=3, help="streams per client")
    parser.add_argument("--hang-s", type=float, default=6.0, help="how long a hung rank stops")
    parser.add_argument(
        "--tail-s", type=float, default=20.0, help="quiet time after the last fault"
    )
    parser.add_argument("--rng-min-s", type=float, default=15.0, help="least time between faults")
    parser.add_argument("--rng-max-s", type=float, default=30.0, help="most time between faults")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(cpu_kind(), flush=True)
    unknown = set(args.faults.split(",")) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; known: {','.join(FAULTS)}")
    if args.nodes * args.node_cpus < max(args.ranks, 4):
        parser.error("the worker nodes must hold --ranks and 4 ranks (the largest resize)")
    with (
        SimulatedCluster(args.nodes, args.node_cpus, NAMESPACE) as cluster,
        tempfile.TemporaryDirectory() as tmp,
    ):
        checkpoint = make_tiny_checkpoint(tmp, "llama")
        asyncio.run(_run(args, checkpoint, cluster))


if __name__ == "__main__":
    main()
