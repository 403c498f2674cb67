"""The multi-turn shared-prefix workload of `bench/prefix_routing.py`, and its figures.

Owns what every system is measured on: the conversations (documents, questions, scripted
answers) and how they arrive (`run_conversations`), what one replay records (`Run`), the ideal
hit rate and the printed rows. It knows nothing of servers, clusters or policies.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from shoal.engine.block_hash import prompt_routing_keys

TOKEN_IDS = (3, 500)  # the bench tokenizer's ordinary ids (0-2 are special)


@dataclass(frozen=True)
class Workload:
    """The conversations to replay: documents, turns, lengths.

    Conversation i is about document i % num_documents. Turn k's prompt is the document, the
    questions and answers of turns 0..k-1, then question k. `scripted_prompts` puts a fixed
    answer of `answer_tokens` ids into the history (not what the model said), so every system
    gets exactly the same prompts whatever it generates.
    """

    num_documents: int = 4
    document_tokens: int = 1024
    num_conversations: int = 24
    num_turns: int = 4
    question_tokens: int = 32
    answer_tokens: int = 16
    seed: int = 3

    def documents(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [
            [rng.randrange(*TOKEN_IDS) for _ in range(self.document_tokens)]
            for _ in range(self.num_documents)
        ]

    def questions(self, conversation: int) -> list[list[int]]:
        rng = random.Random(self.seed * 1000 + conversation)
        return [
            [rng.randrange(*TOKEN_IDS) for _ in range(self.question_tokens)]
            for _ in range(self.num_turns)
        ]

    def scripted_prompts(self, docs: list[list[int]], conversation: int) -> list[list[int]]:
        """Every turn's prompt of one conversation, with scripted answers in the history."""
        rng = random.Random(self.seed * 2000 + conversation)
        history = list(docs[conversation % len(docs)])
        prompts = []
        for question in self.questions(conversation):
            prompts.append([*history, *question])
            answer = [rng.randrange(*TOKEN_IDS) for _ in range(self.answer_tokens)]
            history = [*history, *question, *answer]
        return prompts


async def run_conversations(
    workload: Workload,
    variant: str,
    rate: float,
    concurrency: int,
    conversation: Callable[[int], Coroutine[Any, Any, None]],
) -> float:
    """Runs `conversation(i)` for every conversation i of `workload`; returns the seconds taken.

    "open-loop": conversation i starts at its arrival in a Poisson process of `rate` per
    second (drawn from the workload's seed, so every system gets the same times), whatever is
    in flight. "closed-loop": `concurrency` conversations at a time, in order, each followed by
    the next at once.
    """
    started = time.monotonic()
    if variant == "open-loop":
        rng = random.Random(workload.seed)
        tasks: list[asyncio.Task[None]] = []
        at = 0.0
        for i in range(workload.num_conversations):
            await asyncio.sleep(max(0.0, started + at - time.monotonic()))
            tasks.append(asyncio.create_task(conversation(i)))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    else:
        queue = list(range(workload.num_conversations))

        async def worker() -> None:
            while queue:
                await conversation(queue.pop(0))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.monotonic() - started


@dataclass
class Run:
    """What one replay measured.

    The hit rate is `num_hit_tokens / num_query_tokens`: from the requests' own cached-token
    counts in process, from the servers' `vllm:prefix_cache_{hits,queries}_total` over HTTP.
    `prompts` holds (prompt, tokens computed after it) in the order they were sent; the ideal
    hit rate is replayed from it.
    """

    ttfts: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    seconds: float = 0.0
    num_hit_tokens: int = 0
    num_query_tokens: int = 0
    num_failed: int = 0
    prompts: list[tuple[list[int], list[int]]] = field(default_factory=list)


def ideal_hits(prompts: list[tuple[list[int], list[int]]], block_size: int) -> tuple[int, int]:
    """(hit tokens, prompt tokens) for one rank with an unlimited cache seeing `prompts` in
    order, with the engines' rule: whole blocks only, never the prompt's last token."""
    cached: set[int] = set()
    hits = queries = 0
    for prompt, answer in prompts:
        keys = prompt_routing_keys(prompt, block_size)
        num = 0
        while num < len(keys) and keys[num] in cached:
            num += 1
        hits += num * block_size
        queries += len(prompt)
        # The full blocks of what the engine computed: the prompt and the answer but its last
        # token (sampled, never fed back); a padding id makes every full block count.
        computed = [*prompt, *answer[:-1], 0]
        cached.update(prompt_routing_keys(computed, block_size))
    return hits, queries


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def hit_rate(run: Run) -> float:
    return run.num_hit_tokens / max(1, run.num_query_tokens)


def ideal_rate(runs: list[Run], block_size: int) -> float:
    """The ideal hit rate over several replays, each from an empty cache."""
    totals = [ideal_hits(run.prompts, block_size) for run in runs]
    return sum(h for h, _ in totals) / max(1, sum(q for _, q in totals))


def merge(runs: list[Run]) -> Run:
    merged = Run()
    for run in runs:
        merged.ttfts += run.ttfts
        merged.num_output_tokens += run.num_output_tokens
        merged.seconds += run.seconds
        merged.num_hit_tokens += run.num_hit_tokens
        merged.num_query_tokens += run.num_query_tokens
        merged.num_failed += run.num_failed
        merged.prompts += run.prompts
    return merged


HEADER = (
    f"{'TTFT p50':>9}{'p90':>9}{'mean':>9}{'out tok/s':>10}{'hit rate':>9}{'ideal':>9}"
    f"{'of ideal':>10}{'failed':>8}   (TTFT in ms)"
)


def row(name: str, run: Run, ideal: float) -> str:
    if not run.ttfts:
        return f"{name:<22}   no request completed ({run.num_failed} failed)"
    rate = hit_rate(run)
    return (
        f"{name:<22}{statistics.median(run.ttfts) * 1e3:>9.0f}"
        f"{percentile(run.ttfts, 90) * 1e3:>9.0f}{statistics.fmean(run.ttfts) * 1e3:>9.0f}"
        f"{run.num_output_tokens / max(run.seconds, 1e-9):>10.1f}{100 * rate:>8.1f}%"
        f"{100 * ideal:>8.1f}%{100 * rate / max(ideal, 1e-9):>9.0f}%{run.num_failed:>8}"
    )
