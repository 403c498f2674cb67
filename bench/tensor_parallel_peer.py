"""What `bench/tensor_parallel.py` measures on every engine alike, and its vLLM peer.

`measure` drives an engine step by step through two calls, add a request and run a step, and
stamps every token when the step that returned it comes back (`side_by_side.drive`):

- decode step at batch B: B requests of 16 prompt tokens and N + 1 output tokens each (greedy,
  EOS ignored, added together); a request's decode step is (its last token's time - its first
  token's time) / N, so the prefill step is left out; the figure is the mean over the batch;
- prefill: one request of 512 prompt tokens and 1 output token; tokens/s is 512 over the time
  from adding it to its token.

The peer is one long-lived process of vLLM's venv (`.bench/vllm-venv`) holding an `LLMEngine`
on the bench's checkpoint, so it can take turns with shoal's engines without a restart each
round. The protocol, one line at a time over the child's stdin and stdout:

1. The parent starts `VLLM_PYTHON tensor_parallel_peer.py --model DIR --tensor-parallel-size N`;
   the child builds its engine, warms it up (a `measure` of 4 steps) and prints `@@ ready`.
2. Each `{"steps": N}` the parent writes is answered by `@@ ` and the figures as JSON.
3. At EOF on its stdin the child returns, and vLLM's workers end with it.

Lines without the `@@ ` mark (vLLM's logs, its workers' too) go to a log file. Once idle for a
second, vLLM's workers wait on a socket instead of spinning, so a peer between its turns takes
no CPU from shoal's. The module runs in both venvs: only the child's functions import vLLM,
and nothing here imports shoal.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.side_by_side import VLLM_PYTHON, TokenEvents, drive

MAX_MODEL_LEN = 1024
PREFILL_TOKENS = 512
MARK = "@@ "
IDLE_AFTER_S = 1.5  # vLLM's shared-memory readers spin for 1 s after their last read


def vllm_env(tensor_parallel_size: int) -> dict[str, str]:
    """One OpenMP thread per vLLM worker, rank i bound to core i (vLLM's per-rank "|" syntax);
    no core held back for its engine-core and front processes, which mostly wait. 1 GiB of KV
    space per worker holds what the bench needs (8 requests of < 600 tokens) many times over."""
    return {
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tensor_parallel_size)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }


class SteppedEngine(Protocol):
    """An engine as `measure` drives it."""

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        """Adds a greedy request that ignores EOS and ends after `max_tokens` tokens."""

    def step(self) -> TokenEvents:
        """Runs one step: (request id, new tokens, finished) per request it advanced."""


@dataclass(frozen=True)
class Figures:
    decode_b1_ms: float
    decode_b8_ms: float
    prefill_tokens_per_s: float


def decode_step_ms(engine: SteppedEngine, batch: int, steps: int) -> float:
    """The mean over `batch` requests of (last token's time - first token's) / `steps`."""
    tag = f"d{batch}-{time.monotonic_ns()}"
    request_ids = [f"{tag}-{i}" for i in range(batch)]

    def add() -> None:
        for i, request_id in enumerate(request_ids):
            engine.add(request_id, [7 + i] * 16, steps + 1)

    _, times = drive(add, engine.step, request_ids)
    assert all(len(t) == steps + 1 for t in times.values()), "a request ended early"
    return statistics.fmean((t[-1] - t[0]) / steps for t in times.values()) * 1e3


def prefill_tokens_per_s(engine: SteppedEngine) -> float:
    """`PREFILL_TOKENS` over the time from adding one such prompt to its first token."""
    request_id = f"p-{time.monotonic_ns()}"
    start, times = drive(
        lambda: engine.add(request_id, [9] * PREFILL_TOKENS, 1), engine.step, [request_id]
    )
    return PREFILL_TOKENS / (times[request_id][0] - start)


def measure(engine: SteppedEngine, steps: int) -> Figures:
    return Figures(
        decode_step_ms(engine, 1, steps),
        decode_step_ms(engine, 8, steps),
        prefill_tokens_per_s(engine),
    )


class VllmPeer:
    """The parent's side: starts the child, asks it for figures, ends it."""

    def __init__(self, model: str, tensor_parallel_size: int, log: Path, start_timeout_s: float):
        self._log = log.open("a", encoding="utf-8")
        self._proc = subprocess.Popen(
            [str(VLLM_PYTHON), __file__, "--model", model,
             "--tensor-parallel-size", str(tensor_parallel_size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env={**os.environ, **vllm_env(tensor_parallel_size)}, start_new_session=True,
        )  # fmt: skip
        self._replies: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            self._reply(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(MARK):
                self._replies.put(line[len(MARK) :])
            else:
                self._log.write(line)
        self._replies.put(None)  # EOF: the child ended

    def _reply(self, timeout_s: float) -> str:
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            message = f"no answer from vLLM in {timeout_s:.0f} s (log {self._log.name})"
            raise RuntimeError(message) from None
        if reply is None:
            self._log.flush()
            tail = Path(self._log.name).read_text()[-3000:]
            raise RuntimeError(f"vLLM exited {self._proc.wait()}:\n{tail}")
        return reply

    def measure(self, steps: int, timeout_s: float = 900) -> Figures:
        """The child's figures; returns once its workers stopped spinning (the next engine to
        measure gets the cores)."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"steps": steps}) + "\n")
        self._proc.stdin.flush()
        figures = Figures(**json.loads(self._reply(timeout_s)))
        time.sleep(IDLE_AFTER_S)
        return figures

    def close(self) -> None:
        """Closes the child's stdin and waits for it; kills its process group after 60 s."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._reader.join(timeout=10)  # the log's last lines
        self._log.close()


class _VllmEngine:
    """`SteppedEngine` over vLLM's `LLMEngine` (in vLLM's venv)."""

    def __init__(self, engine: Any) -> None:
        from vllm import SamplingParams, TokensPrompt

        self._engine = engine
        self._params = SamplingParams
        self._prompt = TokensPrompt
        self._counts: dict[str, int] = {}

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = self._params(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )
        self._engine.add_request(request_id, self._prompt(prompt_token_ids=prompt), params)

    def step(self) -> TokenEvents:
        events = []
        for output in self._engine.step():
            total = len(output.outputs[0].token_ids)
            events.append((output.request_id, total - self._counts.get(output.request_id, 0),
                           output.finished))  # fmt: skip
            self._counts[output.request_id] = total
            if output.finished:
                del self._counts[output.request_id]
        return events


def _serve(model: str, tensor_parallel_size: int) -> None:
    """The child's side of the protocol."""
    from vllm import EngineArgs, LLMEngine
    from vllm.usage.usage_lib import UsageContext

    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=model, tensor_parallel_size=tensor_parallel_size, dtype="float32",
            max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False, skip_tokenizer_init=True,
            seed=0, disable_log_stats=True,
        ),
        usage_context=UsageContext.LLM_CLASS,
    )  # fmt: skip
    stepped = _VllmEngine(engine)
    measure(stepped, 4)
    _answer("ready")
    for line in sys.stdin:
        _answer(json.dumps(asdict(measure(stepped, int(json.loads(line)["steps"])))))


def _answer(text: str) -> None:
    # One write, so no log line of a vLLM worker sharing the pipe can land inside it.
    sys.stdout.write(f"{MARK}{text}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the vLLM peer of bench/tensor_parallel.py")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    args = parser.parse_args()
    _serve(args.model, args.tensor_parallel_size)
