"""A steady streaming load for resize tests and the elastic benchmark: drivers that keep
greedy requests in flight and record, per request, its tokens, the ranks that served it, and
its longest gap between two streamed outputs."""

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
    num_outputs: int
    started_at: float
    finished_at: float
    longest_gap_s: float
    output_times: list[float] = field(default_factory=list)


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
        start = last = time.monotonic()
        ranks: list[int] = []
        times: list[float] = []
        gap, final = 0.0, None
        async for output in self.llm.generate({"prompt_token_ids": prompt}, params):
            now = time.monotonic()
            if output.new_token_ids or output.finished:
                gap = max(gap, now - last)
                last = now
                times.append(now)
            rank = output.data_parallel_rank
            if rank is not None and rank not in ranks:
                ranks.append(rank)
            final = output
        assert final is not None
        completion = final.outputs[0]
        return Served(
            prompt,
            list(completion.token_ids),
            ranks,
            completion.finish_reason,
            final.error,
            len(times),
            start,
            time.monotonic(),
            gap,
            times,
        )
