"""What the front end's grammar sandbox costs a constrained request, beside the engine's own
compile of the same constraint (`deploy/openai/grammar_sandbox.py`).

On SmolLM2's vocabulary, for a tool schema (`bench/structured.py`'s flight booking) and for
the longest chains the sandbox's 8 MiB stack holds: the engine's compile (its baseline), the
sandbox's first check (a child to start), a check of a constraint it has not seen (the child
compiles it), one it has (answered from memory), and the first check after a poison crashed
the child (a new child). Each figure is the median of --repeat.

    .venv/bin/python bench/grammar_sandbox.py [--repeat 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu import cpu_kind  # noqa: E402
from bench.structured import TOOL_SCHEMA  # noqa: E402
from shoal.deploy.openai.errors import OpenAIError  # noqa: E402
from shoal.deploy.openai.grammar_sandbox import GrammarSandbox  # noqa: E402
from shoal.engine.loader.builtin import smollm2_gguf_path  # noqa: E402
from shoal.engine.protocol import StructuredOutputsParams  # noqa: E402
from shoal.engine.structured_output import GrammarCompiler  # noqa: E402
from shoal.engine.tokenizer import load_tokenizer  # noqa: E402
from tests.security.poison_inputs import (  # noqa: E402
    CRASHING_SCHEMA_LENGTH,
    lark_chain,
    ref_chain_schema,
)


def _variant(schema: dict[str, Any], i: int) -> dict[str, Any]:
    """The schema with a distinct description: the same work, a digest the sandbox has not seen."""
    return {**schema, "description": f"variant {i}"}


async def _median_ms(repeat: int, make: Callable[[int], Awaitable[Any]]) -> float:
    times = []
    for i in range(repeat):
        start = time.perf_counter()
        await make(i)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


async def _after_a_crash_ms(sandbox: GrammarSandbox, i: int) -> float:
    """How long a new constraint's check takes right after a poison crashed the child."""
    poison = StructuredOutputsParams(json=ref_chain_schema(CRASHING_SCHEMA_LENGTH + i))
    with contextlib.suppress(OpenAIError):
        await sandbox.check(poison)
    start = time.perf_counter()
    await sandbox.check(StructuredOutputsParams(json=_variant(TOOL_SCHEMA, -i - 1)))
    return (time.perf_counter() - start) * 1e3


async def measure(name: str, schema: Any, compiler: GrammarCompiler, repeat: int) -> None:
    as_params = (
        (lambda i: StructuredOutputsParams(grammar=schema + f"\n// {i}"))
        if isinstance(schema, str)
        else (lambda i: StructuredOutputsParams(json=_variant(schema, i)))
    )
    engine_ms = await _median_ms(
        repeat, lambda i: asyncio.to_thread(compiler.compile, as_params(i))
    )
    sandbox = GrammarSandbox()
    start = time.perf_counter()
    await sandbox.check(as_params(-1))
    first_ms = (time.perf_counter() - start) * 1e3
    miss_ms = await _median_ms(repeat, lambda i: sandbox.check(as_params(i)))
    hit_ms = await _median_ms(repeat, lambda i: sandbox.check(as_params(0)))
    await sandbox.aclose()
    print(
        f"{name:<22} engine compile {engine_ms:8.2f} ms | sandbox: first {first_ms:7.1f} ms, "
        f"new constraint {miss_ms:8.2f} ms, seen {hit_ms * 1e3:6.1f} us"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print(cpu_kind(), flush=True)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{len(os.sched_getaffinity(0))} cores, load average {load}")
    tokenizer = load_tokenizer(smollm2_gguf_path())
    compiler = GrammarCompiler(
        str(tokenizer.backend.to_str()), tokenizer.vocab_size, tokenizer.eos_token_ids
    )
    await measure("tool schema", TOOL_SCHEMA, compiler, args.repeat)
    await measure("$ref chain of 900", ref_chain_schema(900), compiler, max(3, args.repeat // 5))
    await measure("Lark chain of 2,500", lark_chain(2_500), compiler, max(3, args.repeat // 5))
    sandbox = GrammarSandbox()
    await sandbox.check(StructuredOutputsParams(json=TOOL_SCHEMA))
    after = [await _after_a_crash_ms(sandbox, i) for i in range(max(3, args.repeat // 5))]
    await sandbox.aclose()
    print(f"{'after a crash':<22} the next new constraint {statistics.median(after):7.1f} ms")


if __name__ == "__main__":
    asyncio.run(main())
