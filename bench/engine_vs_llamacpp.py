"""shoal's engine against llama.cpp on the same GGUF file: one stream of greedy tokens.

Both read the demo's SmolLM2-135M-Instruct Q4_1 file (its projections Q4_1, its tied
embedding / LM head Q8_0), so the same bytes cross the memory bus every token; what differs is
the kernels and what runs between them. Each engine runs in its own fresh process, alternating
shoal and llama.cpp for `--rounds` rounds (the first of a round rotating), on one prompt of
`--prompt-tokens` random ids, `--max-tokens` greedy tokens with EOS ignored, `--threads`
threads each:

- shoal: `EngineCore.step` in a loop (the single stream of `bench/engine_vs_vllm.py`), each
  token stamped when the step that made it returns;
- llama.cpp: llama-cpp-python compiled for this CPU (`bench/setup_llamacpp_peer.sh`), its
  `Llama.generate` with greedy sampling and no repetition penalty, each token stamped when
  the generator yields it.

Printed per round and engine: tokens per second over the whole request (prompt included),
TTFT and the decode rate after the first token; then shoal / llama.cpp per round, the CPU and
the instruction sets llama.cpp's build reports, and how many leading tokens the two agree on
(their kernels round differently, so greedy paths may part after a near-tie).

    bench/setup_llamacpp_peer.sh
    .venv/bin/python bench/engine_vs_llamacpp.py [--rounds 3] [--threads 2] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import cpu_kind
from bench.engine_vs_vllm import worker_shoal
from bench.side_by_side import ROOT, alternate, load_average, run_worker, serve_job

# The venv bench/setup_llamacpp_peer.sh makes in its cache folder (LLAMACPP_CACHE, as there).
LLAMACPP_CACHE = Path(os.environ.get("LLAMACPP_CACHE", ROOT / ".bench"))
LLAMACPP_PYTHON = LLAMACPP_CACHE / "llamacpp-venv" / "bin" / "python"
ENGINES = ("shoal", "llama.cpp")


def worker_llamacpp(job: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp

    model = llama_cpp.Llama(
        model_path=job["gguf"],
        n_ctx=1024,
        n_batch=512,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        seed=0,
        verbose=False,
    )

    def greedy(prompt: list[int], count: int) -> tuple[float, list[float], list[int]]:
        tokens: list[int] = []
        times: list[float] = []
        start = time.perf_counter()
        for token in model.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            tokens.append(int(token))
            if len(tokens) == count:
                break
        return start, times, tokens

    greedy(job["prompt"][:16], 2)  # warm-up, as shoal's worker does
    model.reset()  # so the timed request finds no cached prefix (generate would reuse one)
    start, times, tokens = greedy(job["prompt"], job["max_tokens"])
    info = llama_cpp.llama_print_system_info().decode()
    return {"start": start, "times": times, "tokens": tokens, "system_info": info}


def run_round(engine: str, args: argparse.Namespace, prompt: list[int]) -> dict[str, Any]:
    if engine == "shoal":
        job = {
            "prompts": [prompt],
            "max_tokens": [args.max_tokens],
            "shoal_root": str(ROOT),
            "shoal_model": args.gguf,
            "engine_args": {"cpu_threads": args.threads},
        }
        result = run_worker(__file__, "shoal", job)
        times, tokens = result["times"]["0"], result.get("tokens", {}).get("0")
    else:
        job = {
            "gguf": args.gguf,
            "prompt": prompt,
            "max_tokens": args.max_tokens,
            "threads": args.threads,
        }
        result = run_worker(__file__, "llamacpp", job, python=LLAMACPP_PYTHON)
        times, tokens = result["times"], result["tokens"]
    assert len(times) == args.max_tokens, f"{engine}: {len(times)} tokens"
    start = result["start"]
    decode_s = times[-1] - times[0]
    return {
        "tokens_per_s": len(times) / (times[-1] - start),
        "ttft": times[0] - start,
        "decode_tokens_per_s": (len(times) - 1) / decode_s if decode_s > 0 else float("nan"),
        "tokens": tokens,
        "system_info": result.get("system_info"),
    }


def agreeing_prefix(a: list[int] | None, b: list[int] | None) -> str:
    if a is None or b is None:
        return "?"
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return str(n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gguf", help="default: the demo's SmolLM2-135M-Instruct Q4_1 file")
    parser.add_argument("--worker", choices=["shoal", "llamacpp"], help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    print(cpu_kind(), flush=True)
    if args.worker:
        serve_job(args.job, worker_shoal if args.worker == "shoal" else worker_llamacpp)
        return
    if not LLAMACPP_PYTHON.exists():
        sys.exit(f"no llama.cpp peer at {LLAMACPP_PYTHON}: run bench/setup_llamacpp_peer.sh")
    if args.gguf is None:
        from shoal.engine.loader import smollm2_gguf_path

        args.gguf = smollm2_gguf_path()
    rng = random.Random(args.seed)
    prompt = [rng.randrange(100, 49152) for _ in range(args.prompt_tokens)]
    print(
        f"{Path(args.gguf).name}: {args.prompt_tokens} prompt tokens, {args.max_tokens} greedy "
        f"tokens, {args.threads} threads each; load average before {load_average()}",
        flush=True,
    )

    def one_round(engine: str, r: int) -> dict[str, Any]:
        s = run_round(engine, args, prompt)
        print(
            f"  round {r + 1} {engine:9s} {s['tokens_per_s']:7.1f} tok/s   TTFT "
            f"{s['ttft'] * 1e3:6.1f} ms   decode {s['decode_tokens_per_s']:7.1f} tok/s",
            flush=True,
        )
        return s

    results = alternate(list(ENGINES), args.rounds, one_round)
    shoal, peer = results["shoal"], results["llama.cpp"]
    for r in range(args.rounds):
        print(
            f"  round {r + 1} shoal / llama.cpp: {shoal[r]['tokens_per_s'] / peer[r]['tokens_per_s']:.2f}x"
            f" (decode {shoal[r]['decode_tokens_per_s'] / peer[r]['decode_tokens_per_s']:.2f}x)"
        )
    mean = {e: statistics.mean(x["tokens_per_s"] for x in v) for e, v in results.items()}
    print(f"  mean shoal / llama.cpp: {mean['shoal'] / mean['llama.cpp']:.2f}x")
    print(
        f"  leading greedy tokens equal: {agreeing_prefix(shoal[0]['tokens'], peer[0]['tokens'])}"
    )
    print(f"llama.cpp build: {peer[0]['system_info'].strip()}")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
