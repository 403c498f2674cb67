"""vLLM's own offline `LLM`, as the reference for shoal's vLLM ranks: run in a process of its
own (vLLM's CPU build takes over the process's torch threads), on token-id prompts, one at a
time or all at once, greedy, with each position's top logprobs. One child serves every set of
prompts a test asks for: vLLM's start is most of its cost.

    python -m tests.deploy.vllm_offline < job.json > result.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tests.ray_utils import REPO_ROOT

# A sequence of one engine and its top logprobs at each position.
Run = tuple[list[int], list[dict[int, float]]]


def offline_reference(
    model: str,
    prompt_sets: list[tuple[list[list[int]], bool]],
    *,
    max_tokens: int,
    num_logprobs: int,
    engine_args: dict[str, Any],
    timeout_s: float = 900.0,
) -> list[list[Run]]:
    """For each (prompts, batched) of `prompt_sets`, each prompt's greedy tokens and top
    logprobs from one vLLM `LLM` (a child process): batched, all of the set's prompts in one
    `generate`; otherwise one at a time."""
    job = {
        "model": model,
        "prompt_sets": [[prompts, batched] for prompts, batched in prompt_sets],
        "max_tokens": max_tokens,
        "num_logprobs": num_logprobs,
        "engine_args": engine_args,
    }
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = str(REPO_ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "tests.deploy.vllm_offline"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    sets = json.loads(done.stdout.strip().splitlines()[-1])
    return [
        [(tokens, [{int(t): v for t, v in top.items()} for top in tops]) for tokens, tops in runs]
        for runs in sets
    ]


def _main() -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    job = json.loads(sys.stdin.read())
    llm = LLM(model=job["model"], **job["engine_args"])
    params = SamplingParams(
        temperature=0.0,
        max_tokens=job["max_tokens"],
        ignore_eos=True,
        logprobs=job["num_logprobs"],
    )
    sets = []
    for prompt_ids, batched in job["prompt_sets"]:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
        if batched:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        else:
            outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        runs = []
        for output in outputs:
            completion = output.outputs[0]
            tops = [
                {str(t): lp.logprob for t, lp in position.items()}
                for position in completion.logprobs or []
            ]
            runs.append([list(completion.token_ids), tops])
        sets.append(runs)
    print(json.dumps(sets), flush=True)


if __name__ == "__main__":
    _main()
