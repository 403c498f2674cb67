"""OpenAI-API serving: `shoal serve --data-parallel-size 2` against vLLM's server, same load.

Each server is started fresh, waited for on `/health`, warmed up with a few requests, then
driven by the same async `openai` client with the same random dataset: `--num-requests`
prompts of ~`--input-len` random token ids (±25 %) and `--output-len` output tokens (EOS
ignored, greedy), sent to `/v1/completions` with Poisson arrivals at `--request-rate`, each
streamed. TTFT is the time to the first chunk with text; ITL every gap between two chunks
with text of one request. Printed per server: request throughput, output tokens/s, TTFT and
ITL p50/p99, and the ratios shoal / vLLM.

Both serve SmolLM2-135M in float32: shoal the GGUF, vLLM (`.bench/vllm-venv`, made by
`bench/setup_vllm_peer.sh`) the safetensors directory converted from it, with
`VLLM_CPU_OMP_THREADS_BIND=0|1` (a CPU list per DP rank; "0-1" fails with DP=2),
`VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=4`; shoal runs on a Ray head of its
own with 2 CPUs, one per rank.

    .venv/bin/python bench/serving.py [--num-requests 200] [--request-rate 2]
        [--vllm-enforce-eager] [--only shoal|vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu import cpu_kind  # noqa: E402
from tests.ray_utils import ray_env, start_ray_head, stop_ray_head  # noqa: E402

VLLM_PYTHON = ROOT / ".bench" / "vllm-venv" / "bin" / "python"
VLLM_MODEL = ROOT / ".bench" / "smollm2-135m"
# One CPU per DP rank, as shoal's ranks reserve: with DP > 1 vLLM wants one list per rank.
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "4",
}
MAX_MODEL_LEN = 1024
VOCAB = (100, 49152)


@dataclass
class RequestResult:
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


def make_dataset(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    low, high = int(args.input_len * 0.75), int(args.input_len * 1.25)
    return [
        [rng.randrange(*VOCAB) for _ in range(rng.randint(low, high))]
        for _ in range(args.num_requests)
    ]


def start_shoal(port: int, log: Path, ray_address: str) -> subprocess.Popen[bytes]:
    from shoal.engine.loader import smollm2_gguf_path

    cmd = [
        sys.executable, "-m", "deploy", "serve", "--model", smollm2_gguf_path(),
        "--data-parallel-size", "2", "--namespace", f"bench-{uuid.uuid4().hex[:6]}",
        "--data-parallel-address", "127.0.0.1", "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", "smollm2", "--max-model-len", str(MAX_MODEL_LEN),
        "--dtype", "float32", "--address", ray_address,
    ]  # fmt: skip
    env = ray_env()
    return subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip


def start_vllm(port: int, log: Path, enforce_eager: bool) -> subprocess.Popen[bytes]:
    cmd = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(VLLM_MODEL),
        "--served-model-name", "smollm2", "--data-parallel-size", "2", "--host", "127.0.0.1",
        "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32",
    ]  # fmt: skip
    if enforce_eager:
        cmd.append("--enforce-eager")
    env = dict(os.environ, **VLLM_ENV)
    return subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip


def wait_healthy(proc: subprocess.Popen[bytes], port: int, log: Path, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"no /health within {timeout_s} s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def one_request(client: object, prompt: list[int], output_len: int) -> RequestResult:
    result = RequestResult()
    start = time.perf_counter()
    last = start
    try:
        stream = await client.completions.create(  # type: ignore[attr-defined]
            model="smollm2",
            prompt=prompt,
            max_tokens=output_len,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
            if chunk.usage is not None:
                result.output_tokens = chunk.usage.completion_tokens
    except Exception as e:
        result.error = repr(e)
    return result


async def run_load(
    port: int, prompts: list[list[int]], args: argparse.Namespace
) -> tuple[float, list[RequestResult]]:
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600
    )
    await asyncio.gather(*(one_request(client, p, 8) for p in prompts[:4]))  # warm-up
    rng = random.Random(args.seed + 1)
    tasks = []
    start = time.perf_counter()
    for prompt in prompts:
        tasks.append(asyncio.create_task(one_request(client, prompt, args.output_len)))
        if args.request_rate > 0:
            await asyncio.sleep(rng.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    return time.perf_counter() - start, list(results)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1] if q < 100 else max(values)
    )


def summarize(elapsed: float, results: list[RequestResult]) -> dict[str, float]:
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [gap for r in ok for gap in r.itls]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "req_per_s": len(ok) / elapsed,
        "out_tok_per_s": sum(r.output_tokens for r in ok) / elapsed,
        "ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "itl_p50_ms": 1000 * percentile(itls, 50),
        "itl_p99_ms": 1000 * percentile(itls, 99),
    }


def bench_server(name: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    port = 18000 + random.randrange(1000)
    log = Path(tempfile.mkdtemp(prefix=f"bench-{name}-")) / "server.log"
    head = None
    if name == "shoal":
        # A Ray head of its own on 127.0.0.1: never another user's cluster on this machine.
        head = start_ray_head(num_cpus=2)
        proc = start_shoal(port, log, head.gcs_address)
    else:
        proc = start_vllm(port, log, args.vllm_enforce_eager)
    try:
        ready_s = wait_healthy(proc, port, log, args.start_timeout)
        print(f"{name}: healthy after {ready_s:.0f} s (log {log})", flush=True)
        elapsed, results = asyncio.run(run_load(port, prompts, args))
        errors = [r.error for r in results if r.error]
        if errors:
            print(f"{name}: {len(errors)} failed, first: {errors[0]}", flush=True)
        figures = summarize(elapsed, results)
        print(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()), flush=True)
        return figures
    finally:
        stop(proc)
        if head is not None:
            stop_ray_head(head)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--request-rate", type=float, default=2.0, help="req/s; 0: all at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-enforce-eager", action="store_true")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--only", choices=["shoal", "vllm"], default=None)
    args = parser.parse_args()
    print(cpu_kind(), flush=True)
    if args.only != "shoal" and not (
        VLLM_PYTHON.exists() and (VLLM_MODEL / "config.json").exists()
    ):
        sys.exit("no vLLM peer: run bench/setup_vllm_peer.sh first")
    prompts = make_dataset(args)
    print(
        f"{args.num_requests} requests, ~{args.input_len} input / {args.output_len} output "
        f"tokens, Poisson {args.request_rate} req/s; vLLM enforce_eager={args.vllm_enforce_eager}",
        flush=True,
    )
    names = [args.only] if args.only else ["shoal", "vllm"]
    figures = {name: bench_server(name, args, prompts) for name in names}
    keys = list(next(iter(figures.values())))
    print(
        f"\n{'':16}"
        + "".join(f"{n:>12}" for n in names)
        + ("       ratio" if len(names) == 2 else "")
    )
    for key in keys:
        row = f"{key:16}" + "".join(f"{figures[n][key]:12.2f}" for n in names)
        if len(names) == 2 and figures["vllm"][key]:
            row += f"{figures['shoal'][key] / figures['vllm'][key]:11.2f}x"
        print(row)


if __name__ == "__main__":
    main()
