"""A driver process that tests pause (SIGSTOP) for longer than its engines wait for a client.

Run as `python -m tests.pausable_driver --model PATH [--sync]` (an `AsyncLLM`, or with
`--sync` an `LLM(multiprocess=True)`, with its own engine process) or `... --namespace NS
--address GCS` (an `AsyncLLM` attached to a cluster). It completes four requests and prints
their results, waits for a line on stdin (`pause_and_resume` stops and continues it around
that), then sends four requests at a time until all four complete, for at most 30 s, printing
each round, and exits 0. An asyncio round that hangs fails it after 10 s; a blocking one is
ended by `pause_and_resume`'s limit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shoal.client import LLM, AsyncLLM, SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[1]
ALL_OK = "['ok', 'ok', 'ok', 'ok']"
# Longer than an engine waits for a silent client (heartbeat timeout + grace, about 4.5 s).
PAUSE_S = 8.0


PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


async def _one(llm: AsyncLLM, prompt: str) -> str:
    try:
        async for _ in llm.generate(prompt, PARAMS):
            pass
        return "ok"
    except Exception as e:
        return type(e).__name__


async def _round(llm: AsyncLLM, name: str) -> list[str]:
    prompts = (f"{name} {i}" for i in range(4))
    return await asyncio.wait_for(asyncio.gather(*(_one(llm, p) for p in prompts)), 10)


async def _main(args: argparse.Namespace) -> None:
    if args.model is not None:
        llm = AsyncLLM(model=args.model, max_model_len=256)
    else:
        llm = await AsyncLLM.connect(args.namespace, host="127.0.0.1", name="pausable")
    print(await _round(llm, "before"), flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # paused and resumed around this
    started = time.monotonic()
    while time.monotonic() - started < 30:
        results = await _round(llm, "after")
        print(results, flush=True)
        if results == ["ok"] * 4:
            break
        await asyncio.sleep(0.5)
    await llm.aclose()


def _sync_main(model: str) -> None:
    llm = LLM(model, multiprocess=True, max_model_len=256)

    def round_(name: str) -> list[str]:
        try:
            outputs = llm.generate([f"{name} {i}" for i in range(4)], PARAMS)
            return ["ok" if o.error is None else "error" for o in outputs]
        except Exception as e:
            return [type(e).__name__] * 4

    print(round_("before"), flush=True)
    sys.stdin.readline()  # paused and resumed around this
    started = time.monotonic()
    while time.monotonic() - started < 30:
        results = round_("after")
        print(results, flush=True)
        if results == ["ok"] * 4:
            break
        time.sleep(0.5)
    llm.shutdown()


def pause_and_resume(args: list[str], env: dict[str, str] | None = None) -> str:
    """Runs the driver with `args`, pauses it for PAUSE_S once it has been served, resumes it,
    and returns everything it printed (stdout and stderr, where the client logs)."""
    driver = subprocess.Popen(
        [sys.executable, "-m", "tests.pausable_driver", *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env, cwd=REPO_ROOT,
    )  # fmt: skip
    assert driver.stdin is not None and driver.stdout is not None
    try:
        lines = []
        while "ok" not in (line := driver.stdout.readline()):
            assert line, "".join(lines)
            lines.append(line)
        os.kill(driver.pid, signal.SIGSTOP)
        time.sleep(PAUSE_S)
        os.kill(driver.pid, signal.SIGCONT)
        driver.stdin.write("go\n")
        driver.stdin.flush()
        output, _ = driver.communicate(timeout=60)
        assert driver.returncode == 0, output
        return "".join(lines) + line + output
    finally:
        driver.kill()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--namespace")
    parser.add_argument("--address")
    parsed = parser.parse_args()
    if parsed.namespace is not None:
        import ray

        ray.init(address=parsed.address, log_to_driver=False)
    if parsed.sync:
        _sync_main(parsed.model)
    else:
        asyncio.run(_main(parsed))
