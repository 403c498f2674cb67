"""`bench/prefix_routing.py --in-process`: shoal's policies only, through `AsyncLLM` in process.

One DP=2 cluster, launched in this process's Ray; each replay swaps the client's policy and
resets both ranks' prefix caches first, so policies (and cache-aware balances, `load_weight`)
are compared without server restarts. The history holds what the model really answered, and
the hit rate is the prompt tokens each request found cached, as its engine reported with its
first output (the engines' cumulative counters also count the re-admissions of preempted
requests, which flatters the policies that preempt most).
"""

from __future__ import annotations

import asyncio
import time

import ray
from prefix_routing_workload import Run, Workload, run_conversations

from shoal.client import AsyncLLM, SamplingParams
from shoal.client.routing.lb_client import DPLBAsyncMPClient
from shoal.client.routing.lb_policy import (
    CacheAwarePolicy,
    LoadBalancePolicy,
    SessionAffinityPolicy,
    make_policy,
)
from shoal.cluster.launch import LaunchOptions, launch
from shoal.cluster.placement import RankResources
from shoal.engine.config import EngineConfig


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
        run.num_query_tokens += len(prompt)
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
    client.policy = _policy(policy.removeprefix("shoal "))
    docs = workload.documents()
    run = Run()
    try:
        assert all((await client.call_utility_all_async("reset_prefix_cache")).values())
        await asyncio.sleep(0.3)  # the resets' KV events reach the index
        run.seconds = await run_conversations(
            workload,
            variant,
            rate,
            concurrency,
            lambda i: _conversation(llm, workload, docs, i, run),
        )
    finally:
        await llm.aclose()
    return run


def run_in_process(
    model: str,
    policies: list[str],
    workloads: dict[str, Workload],
    *,
    rounds: int,
    rate: float,
    concurrency: int,
    block_size: int,
    kv_blocks: int,
    max_num_batched_tokens: int,
) -> dict[tuple[str, str], list[Run]]:
    """Every (variant, policy) replayed `rounds` times; policies take turns going first."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = EngineConfig.from_kwargs(
        model,
        data_parallel_size=2,
        cpu_threads=1,
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        num_gpu_blocks_override=kv_blocks,
        max_model_len=2048,
    )
    options = LaunchOptions(RankResources(num_cpus=1), host="127.0.0.1")
    cluster = launch(config, options, namespace="shoal-bench-prefix")
    results: dict[tuple[str, str], list[Run]] = {}
    try:
        for round_index in range(rounds):
            for variant, workload in workloads.items():
                shift = round_index % len(policies)
                for policy in policies[shift:] + policies[:shift]:
                    run = asyncio.run(
                        replay(cluster.namespace, policy, workload, variant, rate, concurrency)
                    )
                    results.setdefault((variant, policy), []).append(run)
    finally:
        cluster.shutdown()
        ray.shutdown()
    return results
