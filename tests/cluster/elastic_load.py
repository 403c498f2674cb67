"""A steady streaming load for resize tests and the elastic benchmark: drivers that keep
greedy requests in flight and record, per request, its tokens and every streamed output
(when, how many tokens, from which rank)."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from shoal.client import AsyncLLM, SamplingParams


@dataclass
class Served:
    """One finished request as its driver saw it."""

    prompt: list[int]
    token_ids: list[int]
    ranks: list[int]  # every rank that sent it outputs, in order of first appearance
    finish_reason: str | None
    error: str | None
    started_at: float
    finished_at: float
    # Every streamed output that carried tokens or the finish: (monotonic time, tokens, rank).
    events: list[tuple[float, int, int | None]] = field(default_factory=list)

    def gaps(self) -> list[tuple[float, float]]:
        """(start, end) of each wait for the next output, from the request's start."""
        times = [self.started_at] + [t for t, _, _ in self.events]
        return list(itertools.pairwise(times))


@dataclass
class Load:
    """Keeps `concurrency` requests in flight on `llm` until `stop` is set."""

    llm: AsyncLLM
    prompts: list[list[int]]
    max_tokens: int
    concurrency: int = 3
    served: list[Served] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        prompts = itertools.cycle(self.prompts)
        params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)

        async def worker() -> None:
            while not self.stop.is_set():
                self.served.append(await self._one(next(prompts), params))

        await asyncio.gather(*(worker() for _ in range(self.concurrency)))

    async def _one(self, prompt: list[int], params: SamplingParams) -> Served:
        return await stream_one(self.llm, prompt, params)


async def stream_one(
    llm: AsyncLLM,
    prompt: list[int],
    params: SamplingParams,
    first_rank: asyncio.Future[int | None] | None = None,
) -> Served:
    """Streams one request to its end; `first_rank`, if given, learns the rank of its first
    output as soon as it arrives."""
    start = time.monotonic()
    ranks: list[int] = []
    events: list[tuple[float, int, int | None]] = []
    final = None
    async for output in llm.generate({"prompt_token_ids": prompt}, params):
        rank = output.data_parallel_rank
        if output.new_token_ids or output.finished:
            events.append((time.monotonic(), len(output.new_token_ids), rank))
        if rank is not None and rank not in ranks:
            ranks.append(rank)
        if first_rank is not None and not first_rank.done():
            first_rank.set_result(rank)
        final = output
    assert final is not None
    completion = final.outputs[0]
    return Served(
        prompt,
        list(completion.token_ids),
        ranks,
        completion.finish_reason,
        final.error,
        start,
        time.monotonic(),
        events,
    )


async def hold_on_ranks(
    llm: AsyncLLM,
    prompts: list[list[int]],
    max_tokens: int,
    ranks: set[int],
    *,
    attempts: int = 16,
) -> list[asyncio.Task[Served]]:
    """Starts long greedy requests on `llm`, one after another, until one streams from a rank
    in `ranks` (the policy picks the rank: a pinned request would not move). Returns every
    started request's task; the last one is the request held on one of `ranks`."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tasks: list[asyncio.Task[Served]] = []
    for prompt in itertools.islice(itertools.cycle(prompts), attempts):
        first_rank: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        tasks.append(asyncio.create_task(stream_one(llm, prompt, params, first_rank)))
        if await first_rank in ranks:
            return tasks
    raise AssertionError(f"no request of {attempts} reached a rank in {sorted(ranks)}")
