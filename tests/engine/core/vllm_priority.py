"""The order in which a `VllmEngineCore` of one seat starts its requests, stepped by hand in a
process of its own (vLLM's CPU build takes over the process's torch threads).

One long request takes the seat; then a request of the default priority and an urgent one
(priority -1) arrive, in that order, and the engine steps until all finish. The child prints
the ids in the order of their first tokens.

    python -m tests.engine.core.vllm_priority < job.json > order.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tests.ray_utils import REPO_ROOT


def start_order(model: str, engine_kwargs: dict[str, Any], timeout_s: float = 900.0) -> list[str]:
    """The request ids in the order the engine of `engine_kwargs` started them."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "tests.engine.core.vllm_priority"],
        input=json.dumps({"model": model, "engine_kwargs": engine_kwargs}),
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    order: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return order


def _main() -> None:
    from shoal.engine.config import EngineConfig
    from shoal.engine.core.vllm_core import VllmEngineCore
    from shoal.engine.protocol import EngineCoreRequest, SamplingParams

    job = json.loads(sys.stdin.read())
    engine = VllmEngineCore(EngineConfig.from_kwargs(job["model"], **job["engine_kwargs"]))
    prompt = [3 + (i * 7) % 90 for i in range(40)]

    def request(request_id: str, max_tokens: int, priority: int = 0) -> EngineCoreRequest:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return EngineCoreRequest(request_id, prompt, params, priority=priority)

    started: list[str] = []

    def step() -> None:
        for outputs in engine.step().values():
            for output in outputs.outputs:
                assert output.error_message is None, output.error_message
                if output.new_token_ids and output.request_id not in started:
                    started.append(output.request_id)

    engine.add_request(request("bulk-0", max_tokens=8))
    while not started:
        step()
    engine.add_request(request("bulk-1", max_tokens=4))
    engine.add_request(request("urgent", max_tokens=4, priority=-1))
    while engine.has_unfinished_requests():
        step()
    engine.shutdown()
    print(json.dumps(started), flush=True)


if __name__ == "__main__":
    _main()
