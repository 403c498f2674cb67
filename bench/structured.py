"""Structured outputs: the grammar library's costs, and engine throughput with and without a schema.

1. The library, on SmolLM2's vocabulary (49,152 ids): building its tokenizer view, compiling
   a realistic tool schema (a flight-booking function, as `tool_choice: required` wraps it),
   and computing one token's mask while a valid answer is fed token by token. llguidance is
   what shoal uses; xgrammar is measured beside it when it is importable (it is not a
   dependency: `pip install --target DIR xgrammar apache-tvm-ffi --no-deps`, then
   PYTHONPATH=DIR).
2. The engine: SmolLM2-135M on the CPU, the same chat requests greedy, under a JSON schema and
   free (EOS ignored, each request as many tokens as its structured answer); output tokens/s
   of each (best of --rounds) and the ratio.

    .venv/bin/python bench/structured.py [--num-requests 16] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shoal.client import LLM, SamplingParams
from shoal.engine.loader import smollm2_gguf_path
from shoal.engine.protocol import StructuredOutputsParams
from shoal.engine.tokenizer import Tokenizer, load_tokenizer

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


def bench_engine(
    path: str, num_requests: int, max_tokens: int, rounds: int
) -> tuple[float, float, list[float], int]:
    """(free tokens/s, structured tokens/s, best of rounds; each round's structured / free
    ratio; structured outputs that validate).

    The free run of each round generates, per request, exactly as many tokens as its
    structured answer had (EOS ignored), so both runs compute the same batch shapes; the two
    runs of a round follow each other, so a round's ratio sees the same machine load.
    """
    import jsonschema

    llm = LLM(path, max_model_len=1024)
    prompts = [
        [
            {
                "role": "user",
                "content": f"Weather forecast for {CITIES[i % len(CITIES)]} as JSON, {i + 2} days.",
            }
        ]
        for i in range(num_requests)
    ]
    constraint = StructuredOutputsParams(json=WEATHER)
    structured = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs=constraint
    )
    llm.chat(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    best = {"free": 0.0, "structured": 0.0}
    ratios = []
    num_valid = 0
    for _ in range(rounds):
        start = time.perf_counter()
        outputs = llm.chat(prompts, structured, use_tqdm=False)
        elapsed = time.perf_counter() - start
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        structured_rate = sum(lengths) / elapsed
        num_valid = sum(_is_valid(o.outputs[0].text, jsonschema) for o in outputs)
        free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        start = time.perf_counter()
        llm.chat(prompts, free, use_tqdm=False)
        free_rate = sum(lengths) / (time.perf_counter() - start)
        ratios.append(structured_rate / free_rate)
        best["structured"] = max(best["structured"], structured_rate)
        best["free"] = max(best["free"], free_rate)
    llm.shutdown()
    return best["free"], best["structured"], ratios, num_valid


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
    args = parser.parse_args()
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
    free, structured, ratios, num_valid = bench_engine(
        path, args.num_requests, args.max_tokens, args.rounds
    )
    print(
        f"engine, {args.num_requests} greedy chat requests, SmolLM2-135M on CPU "
        f"(best of {args.rounds} rounds):\n"
        f"  free        {free:8.1f} output tokens/s\n"
        f"  JSON schema {structured:8.1f} output tokens/s  ({structured / free:.2f}x; "
        f"{num_valid}/{args.num_requests} outputs validate)\n"
        f"  structured / free per round: {', '.join(f'{r:.2f}' for r in ratios)} "
        f"(median {statistics.median(ratios):.2f}x)"
    )


if __name__ == "__main__":
    main()
