"""`shoal generate`: a driver that attaches to a running cluster and streams prompts through it.

    shoal generate --namespace NS [--chat] [--max-tokens N] "prompt one" "prompt two" ...

Every prompt is streamed concurrently through `AsyncLLM.connect`; each answer is printed with
the rank that served it (or, with --json, one JSON document for all of them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from shoal.client import AsyncLLM, SamplingParams
from shoal.client.api.outputs import RequestOutput
from shoal.client.api.prompts import PromptType, chat_prompt
from shoal.deploy.ray_connection import add_ray_args, connect_ray


@dataclass
class Answer:
    prompt: str
    text: str
    token_ids: list[int]
    rank: int | None
    finish_reason: str | None
    seconds: float


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy"
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of every prompt's draws (default: unseeded)"
    )
    parser.add_argument(
        "--chat", action="store_true", help="wrap each prompt in the model's chat template"
    )


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)


async def stream_prompts(
    llm: AsyncLLM,
    prompts: Sequence[str],
    params: SamplingParams,
    *,
    chat: bool = False,
    on_answer: Callable[[Answer], None] | None = None,
) -> list[Answer]:
    """Streams every prompt at once; returns the answers in prompt order.

    Raises:
        RequestError, EngineDeadError: from the first request that failed.
    """
    tokenizer = llm.get_tokenizer()

    async def one(prompt: str) -> Answer:
        request: PromptType = (
            chat_prompt(tokenizer, [{"role": "user", "content": prompt}]) if chat else prompt
        )
        start = time.monotonic()
        final: RequestOutput | None = None
        async for output in llm.generate(request, params):
            final = output
        assert final is not None
        completion = final.outputs[0]
        answer = Answer(
            prompt,
            completion.text,
            completion.token_ids,
            final.data_parallel_rank,
            completion.finish_reason,
            time.monotonic() - start,
        )
        if on_answer is not None:
            on_answer(answer)
        return answer

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def print_answer(answer: Answer) -> None:
    print(
        f"\n[rank {answer.rank}] {answer.prompt}\n"
        f"  → {answer.text.strip()}\n"
        f"  ({len(answer.token_ids)} tokens, {answer.finish_reason}, {answer.seconds:.1f} s)",
        flush=True,
    )


async def _run(args: argparse.Namespace) -> int:
    llm = await AsyncLLM.connect(
        args.namespace,
        address=args.address,
        host=args.host,
        name="shoal generate",
        ready_timeout_s=args.ready_timeout,
    )
    try:
        answers = await stream_prompts(
            llm,
            args.prompts,
            sampling_params_from_args(args),
            chat=args.chat,
            on_answer=None if args.json else print_answer,
        )
    finally:
        await llm.aclose()
    if args.json:
        print(json.dumps([asdict(a) for a in answers], indent=2))
    return 0


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    add_ray_args(parser)
    parser.add_argument(
        "--host", default=None, help="this machine's address as engines reach it (default: node IP)"
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for a cluster still being launched to serve (default: 0)",
    )
    add_sampling_args(parser)
    parser.add_argument("--json", action="store_true", help="print all answers as JSON")
    parser.add_argument("prompts", nargs="+", help="prompts to stream concurrently")


def run(args: argparse.Namespace) -> int:
    try:  # here, where an unreachable address fails at once, rather than in ray.init's retries
        connect_ray(args.address, args.namespace, can_start_local=False)
    except ConnectionError as e:
        print(f"shoal generate: no Ray cluster at {args.address!r} ({e})", file=sys.stderr)
        return 1
    try:
        return asyncio.run(_run(args))
    except Exception as e:
        print(f"shoal generate: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
