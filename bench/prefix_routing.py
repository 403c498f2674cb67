"""Prefix-cache routing on two ranks: multi-turn chats over shared documents, three policies.

Conversations over a few long documents arrive in a Poisson process; each turn repeats the
conversation so far (document, earlier questions and answers) plus a new question, and is sent
once the previous answer has arrived. Each rank's KV cache holds fewer blocks than all the
documents need, so where a turn lands decides whether its prefix is still cached. The same
workload is replayed, in one run and against one DP=2 cluster (one thread per rank), through
shoal's cache-aware, least-loaded and round-robin policies, in two variants:

- open-loop: conversations arrive at `--rate` per second, whatever is in flight;
- closed-loop: `--concurrency` conversations at a time, each followed by the next at once,
  enough to keep both ranks busy.

For each it prints TTFT p50 / p90 / mean, output tokens per second, and the cluster's
prefix-cache hit rate beside the ideal: one rank with an unlimited cache seeing the same
prompts in the same order. The hit rate is the prompt tokens each request found cached, as
its engine reported with its first output, over all prompt tokens (the engines' cumulative
counters also count the re-admissions of preempted requests, which flatters the policies
that preempt most). Every replay starts from empty caches, and the policies take turns going
first. `--load-weights` adds cache-aware variants with other balances (`load_weight`).

    .venv/bin/python bench/prefix_routing.py [--rounds 1] [--rate 4] [--concurrency 6] \
        [--load-weights 2,4]

vLLM's own DP load balancer is not part of this run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shoal.client import AsyncLLM, SamplingParams
from shoal.client.dp_client import DPLBAsyncMPClient
from shoal.client.lb_policy import (
    CacheAwarePolicy,
    LoadBalancePolicy,
    SessionAffinityPolicy,
    make_policy,
)
from shoal.cluster.launch import launch
from shoal.cluster.placement import RankResources
from shoal.engine.block_hash import prompt_routing_keys
from shoal.engine.config import EngineConfig
from tests.factories import make_tiny_checkpoint

POLICIES = ("cache-aware", "least-loaded", "round-robin")
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Workload:
    """The conversations to replay: documents, turns, lengths."""

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
            [rng.randrange(3, 500) for _ in range(self.document_tokens)]
            for _ in range(self.num_documents)
        ]

    def questions(self, conversation: int) -> list[list[int]]:
        rng = random.Random(self.seed * 1000 + conversation)
        return [
            [rng.randrange(3, 500) for _ in range(self.question_tokens)]
            for _ in range(self.num_turns)
        ]


@dataclass
class Run:
    """What one replay measured."""

    ttfts: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    seconds: float = 0.0
    num_hit_tokens: int = 0  # prompt tokens the engines found cached, per request
    num_prompt_tokens: int = 0
    prompts: list[tuple[list[int], list[int]]] = field(default_factory=list)  # sent order


async def _conversation(
    llm: AsyncLLM, workload: Workload, docs: list[list[int]], index: int, run: Run
) -> None:
    history = list(docs[index % len(docs)])
    params = SamplingParams(temperature=0.0, max_tokens=workload.answer_tokens, ignore_eos=True)
    for question in workload.questions(index):
        prompt = [*history, *question]
        sent = time.monotonic()
        first = None
        answer: list[int] = []
        hit = 0
        async for output in llm.generate({"prompt_token_ids": prompt}, params):
            if first is None:
                first = time.monotonic() - sent
            answer = list(output.outputs[0].token_ids)
            hit = output.num_cached_tokens
        assert first is not None
        run.ttfts.append(first)
        run.num_hit_tokens += hit
        run.num_prompt_tokens += len(prompt)
        run.num_output_tokens += len(answer)
        run.prompts.append((prompt, answer))
        history = [*prompt, *answer]


def _policy(name: str) -> LoadBalancePolicy:
    """A policy by name; "cache-aware w=X" is cache-aware with `load_weight` X."""
    if name.startswith("cache-aware w="):
        weight = float(name.removeprefix("cache-aware w="))
        return SessionAffinityPolicy(inner=CacheAwarePolicy(load_weight=weight))
    return make_policy(name)


async def replay(
    namespace: str, policy: str, workload: Workload, variant: str, rate: float, concurrency: int
) -> Run:
    llm = await AsyncLLM.connect(namespace, host="127.0.0.1", name=f"bench {policy}")
    client = llm.engine_core
    assert isinstance(client, DPLBAsyncMPClient)
    client.policy = _policy(policy)
    docs = workload.documents()
    run = Run()
    try:
        assert all((await client.call_utility_all_async("reset_prefix_cache")).values())
        await asyncio.sleep(0.3)  # the resets' KV events reach the index
        started = time.monotonic()
        if variant == "open-loop":
            rng = random.Random(workload.seed)
            tasks = []
            at = 0.0
            for i in range(workload.num_conversations):
                delay = max(0.0, started + at - time.monotonic())
                await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(_conversation(llm, workload, docs, i, run)))
                at += rng.expovariate(rate)
            await asyncio.gather(*tasks)
        else:
            queue = list(range(workload.num_conversations))

            async def worker() -> None:
                while queue:
                    await _conversation(llm, workload, docs, queue.pop(0), run)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        run.seconds = time.monotonic() - started
    finally:
        await llm.aclose()
    return run


def ideal_hit_rate(prompts: list[tuple[list[int], list[int]]]) -> float:
    """One rank, unlimited cache, the same prompts in the same order: hit tokens / prompt
    tokens, with the engine's rule (full blocks, never the last prompt token)."""
    cached: set[int] = set()
    hits = queries = 0
    for prompt, answer in prompts:
        keys = prompt_routing_keys(prompt, BLOCK_SIZE)
        num = 0
        while num < len(keys) and keys[num] in cached:
            num += 1
        hits += num * BLOCK_SIZE
        queries += len(prompt)
        # The full blocks of what the engine computed: the prompt and the answer but its last
        # token (sampled, never fed back); a padding token makes every full block count.
        computed = [*prompt, *answer[:-1], 0]
        cached.update(prompt_routing_keys(computed, BLOCK_SIZE))
    return hits / max(1, queries)


def p90(run: Run) -> float:
    ttfts = sorted(run.ttfts)
    return ttfts[min(len(ttfts) - 1, round(0.9 * (len(ttfts) - 1)))]


def _row(name: str, run: Run, ideal: float) -> str:
    hit_rate = run.num_hit_tokens / max(1, run.num_prompt_tokens)
    return (
        f"{name:<18}{statistics.median(run.ttfts) * 1e3:>9.0f}{p90(run) * 1e3:>9.0f}"
        f"{statistics.fmean(run.ttfts) * 1e3:>9.0f}{run.num_output_tokens / run.seconds:>10.1f}"
        f"{100 * hit_rate:>8.1f}%{100 * ideal:>8.1f}%{100 * hit_rate / ideal:>9.0f}%"
    )


def _merge(runs: list[Run]) -> Run:
    merged = Run()
    for run in runs:
        merged.ttfts += run.ttfts
        merged.num_output_tokens += run.num_output_tokens
        merged.seconds += run.seconds
        merged.prompts += run.prompts
        merged.num_hit_tokens += run.num_hit_tokens
        merged.num_prompt_tokens += run.num_prompt_tokens
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="replays per policy and variant")
    parser.add_argument("--rate", type=float, default=4.0, help="open-loop conversations/s")
    parser.add_argument("--concurrency", type=int, default=6, help="closed-loop conversations")
    parser.add_argument(
        "--load-weights", default="", help="more cache-aware balances to compare, e.g. 2,4"
    )
    parser.add_argument("--hidden-size", type=int, default=256, help="the bench model's width")
    parser.add_argument(
        "--kv-blocks", type=int, default=192, help="each rank's KV blocks (of 16 tokens)"
    )
    args = parser.parse_args()
    policies = [*POLICIES]
    policies += [f"cache-aware w={w}" for w in args.load_weights.split(",") if w]
    workload = Workload()
    need = workload.num_documents * workload.document_tokens // BLOCK_SIZE
    print(
        f"{workload.num_conversations} conversations x {workload.num_turns} turns over "
        f"{workload.num_documents} documents of {workload.document_tokens} tokens; each rank "
        f"caches {args.kv_blocks} blocks, the documents need {need}"
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    checkpoint = make_tiny_checkpoint(
        Path("/tmp/shoal-bench-prefix"),
        "llama",
        hidden_size=args.hidden_size,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=3 * args.hidden_size,
        max_position_embeddings=2048,
    )
    config = EngineConfig.from_kwargs(
        checkpoint,
        data_parallel_size=2,
        cpu_threads=1,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=512,
        num_gpu_blocks_override=args.kv_blocks,
        max_model_len=2048,
    )
    cluster = launch(
        config,
        namespace="shoal-bench-prefix",
        resources=RankResources(num_cpus=1),
        host="127.0.0.1",
    )
    results: dict[tuple[str, str], list[Run]] = {}
    try:
        for round_index in range(args.rounds):
            for variant in ("open-loop", "closed-loop"):
                shift = round_index % len(policies)
                for policy in policies[shift:] + policies[:shift]:
                    run = asyncio.run(
                        replay(
                            cluster.namespace,
                            policy,
                            workload,
                            variant,
                            args.rate,
                            args.concurrency,
                        )
                    )
                    results.setdefault((variant, policy), []).append(run)
    finally:
        cluster.shutdown()
        ray.shutdown()
    figures: dict[tuple[str, str], Run] = {}
    for variant in ("open-loop", "closed-loop"):
        print(
            f"\n{variant + ':':<18}{'TTFT p50':>9}{'p90':>9}{'mean':>9}{'out tok/s':>10}"
            f"{'hit rate':>9}{'ideal':>9}{'of ideal':>10}   (TTFT in ms)"
        )
        for policy in policies:
            run = _merge(results[(variant, policy)])
            figures[(variant, policy)] = run
            print(_row(policy, run, max(ideal_hit_rate(run.prompts), 1e-9)))
    print("ideal: one rank with an unlimited cache, the same prompts in the same order")
    ours = figures[("open-loop", "cache-aware")]
    theirs = figures[("open-loop", "least-loaded")]
    print(
        f"\nopen-loop p90 TTFT: cache-aware / least-loaded = {p90(ours) / p90(theirs):.2f}x "
        "(target <= 0.5x)"
    )


if __name__ == "__main__":
    main()
