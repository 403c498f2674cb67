"""What the benchmarks that run shoal beside vLLM share: where the peer lives, a worker in a
fresh process of another venv, engines taking turns round by round, and an engine driven step
by step with every token timestamped as its step returns it.

Standard library only: the workers import it inside vLLM's venv, which lacks shoal's
dependencies. It knows nothing of either engine's API; the callers adapt them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from bench.cpu import cpu_kind

ROOT = Path(__file__).resolve().parents[1]
# Both made by bench/setup_vllm_peer.sh; vLLM is never a dependency of shoal.
VLLM_PYTHON = ROOT / ".bench" / "vllm-venv" / "bin" / "python"
VLLM_MODEL = ROOT / ".bench" / "smollm2-135m"
# One vLLM worker on both cores, none held back for its other processes; the KV space (GiB) is
# an upper bound, far above what the workloads need.
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "4",
}

T = TypeVar("T")
# What one step returned, per request: (request id, new tokens, finished).
TokenEvents = Iterable[tuple[str, int, bool]]


def require_vllm_peer(*, with_model: bool = True) -> None:
    """Exits saying how to make the peer when `.bench` lacks its venv (or its checkpoint)."""
    if not VLLM_PYTHON.exists() or (with_model and not (VLLM_MODEL / "config.json").exists()):
        sys.exit("no vLLM peer: run bench/setup_vllm_peer.sh first")


def run_worker(
    script: str,
    worker: str,
    job: Mapping[str, Any],
    *,
    python: str | Path = sys.executable,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 1800,
) -> dict[str, Any]:
    """Runs `python script --worker WORKER --job FILE` in a fresh process, `job` written to FILE
    as JSON, and returns the JSON object the worker printed last (a line starting with "{";
    engines log on stdout too). Exits with the worker's stderr if it failed."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        proc = subprocess.run(
            [str(python), script, "--worker", worker, "--job", f.name],
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    finally:
        os.unlink(f.name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{worker} worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def serve_job(job_path: str, worker: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """The worker's side of `run_worker`: reads the job, prints the worker's result as JSON."""
    print(json.dumps(worker(json.loads(Path(job_path).read_text()))))


def rotated(names: list[str], round_index: int) -> list[str]:
    """`names` starting at round_index's turn, so none always runs on a warmer machine."""
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def alternate(names: list[str], rounds: int, run: Callable[[str, int], T]) -> dict[str, list[T]]:
    """`run(name, round_index)` for every name once a round, `rounds` times, the first of a
    round rotating; returns each name's results in round order."""
    results: dict[str, list[T]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in rotated(names, round_index):
            results[name].append(run(name, round_index))
    return results


def drive(
    add: Callable[[], None], step: Callable[[], TokenEvents], request_ids: list[str]
) -> tuple[float, dict[str, list[float]]]:
    """Calls `add` (which adds the requests), then `step` until each of `request_ids` finished.

    Returns:
        (the time `add` was called, each request's token times): a token's time is when the
        step that returned it came back (`time.perf_counter()`), the same for every engine.
    """
    times: dict[str, list[float]] = {request_id: [] for request_id in request_ids}
    start = time.perf_counter()
    add()
    num_done = 0
    while num_done < len(request_ids):
        events = list(step())
        now = time.perf_counter()
        for request_id, num_new_tokens, finished in events:
            if request_id not in times:
                continue  # another caller's request
            times[request_id].extend([now] * num_new_tokens)
            num_done += finished
    return start, times


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_summary() -> str:
    """The CPU's model, cores, vector flags and load average (bench/cpu.py)."""
    return cpu_kind()
