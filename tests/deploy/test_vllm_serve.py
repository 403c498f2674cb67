"""`shoal serve MODEL --engine vllm --data-parallel-size 2` end to end, with real Ray and real
vLLM: SmolLM2-135M (a safetensors copy of the demo's GGUF) served by two ranks that each host
vLLM's EngineCore, behind shoal's routing, failover, resizes and OpenAI front end.

One cluster serves the whole module and the tests run in order: greedy output against vLLM's
own offline `LLM` (one request at a time, then batched), the official `openai` client
(streaming, structured outputs, tool calls), `shoal status`, a rank SIGKILLed mid-stream, and
resizes 2 → 1 → 2 → 1 under load.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
import ray

from shoal.client import AsyncLLM, SamplingParams
from shoal.client.api.outputs import RequestOutput
from shoal.cluster.launch import ClusterHandle, attach
from shoal.engine.tokenizer import load_tokenizer
from tests.cluster.elastic_load import Load, Served, hold_on_ranks
from tests.cluster.in_flight import decoding_on, dplb_client
from tests.deploy.openai_utils import FrontEnd, http_status, spawn_shoal, start_shoal
from tests.deploy.vllm_offline import Run, offline_reference
from tests.ray_utils import REPO_ROOT, RayHead, ray_env, ray_head, unique_namespace

__all__ = ["ray_head"]

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.asyncio(loop_scope="module"),
]

MODEL_NAME = "smollm2"
READY_TIMEOUT_S = 900.0
MAX_MODEL_LEN = 1024
# The same engine settings on both sides of every comparison.
VLLM_ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": MAX_MODEL_LEN,
}
TOP_LOGPROBS = 5
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three colors:",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def namespace() -> str:
    return unique_namespace("vllm")


@pytest.fixture(scope="module")
def served(
    ray_head: RayHead,
    smollm2_safetensors: str,
    namespace: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[FrontEnd]:
    """`shoal serve --engine vllm` with two ranks and its HTTP front end."""
    args = [
        "serve", smollm2_safetensors, "--engine", "vllm", "--data-parallel-size", "2",
        "--namespace", namespace, "--served-model-name", MODEL_NAME, "--enforce-eager",
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
        "--data-parallel-address", "127.0.0.1", "--ready-timeout", str(READY_TIMEOUT_S),
    ]  # fmt: skip
    front_end = spawn_shoal(ray_head, args, tmp_path_factory.mktemp("logs") / "serve.log")
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while http_status(f"{front_end.base_url}/health") != 200:
            assert front_end.proc.poll() is None, front_end.output()
            assert time.monotonic() < deadline, front_end.output()
            time.sleep(1.0)
        yield front_end
    finally:
        front_end.stop()


@pytest.fixture(scope="module")
def api(served: FrontEnd) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0, timeout=300
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def driver(served: FrontEnd, ray_head: RayHead, namespace: str) -> AsyncIterator[AsyncLLM]:
    """A driver in this process attached to the cluster, round-robin over the ranks."""
    ray.init(address=ray_head.gcs_address, namespace=namespace, log_to_driver=False)
    llm = await AsyncLLM.connect(
        namespace, host="127.0.0.1", name="test driver", policy="round-robin"
    )
    yield llm
    await llm.aclose()
    ray.shutdown()


@pytest.fixture(scope="module")
def cluster(driver: AsyncLLM, namespace: str) -> ClusterHandle:
    return attach(namespace)


@pytest.fixture(scope="module")
def prompt_ids(smollm2_safetensors: str) -> list[list[int]]:
    tokenizer = load_tokenizer(smollm2_safetensors)
    return [tokenizer.encode(p) for p in PROMPTS]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_LOGPROBS
    )


async def _generate(llm: AsyncLLM, prompt: list[int], max_tokens: int) -> Run:
    final: RequestOutput | None = None
    async for output in llm.generate({"prompt_token_ids": prompt}, _greedy(max_tokens)):
        final = output
    assert final is not None and final.error is None, final
    completion = final.outputs[0]
    tops = [{t: lp.logprob for t, lp in p.items()} for p in completion.logprobs or []]
    return list(completion.token_ids), tops


def assert_close(ours: Run, theirs: Run) -> None:
    """vLLM's float tolerance (its `check_logprobs_close`): the same tokens, or, where they
    first differ, each side's token is among the other's top logprobs there (a near tie that
    batching may tip either way); nothing after that is compared."""
    (tokens, tops), (their_tokens, their_tops) = ours, theirs
    assert len(tokens) == len(their_tokens)
    for i, (token, theirs_at) in enumerate(zip(tokens, their_tokens, strict=True)):
        if token != theirs_at:
            assert token in their_tops[i] and theirs_at in tops[i], (i, tokens, their_tokens)
            return


async def test_greedy_output_equals_vllms_offline_llm(
    driver: AsyncLLM, smollm2_safetensors: str, prompt_ids: list[list[int]]
) -> None:
    max_tokens = 24
    args = {**VLLM_ENGINE_ARGS, "max_logprobs": TOP_LOGPROBS}
    # Batched: every prompt twice at once on the two ranks, against vLLM's batch of them.
    batch = prompt_ids * 2
    one_at_a_time, theirs = offline_reference(
        smollm2_safetensors,
        [(prompt_ids, False), (batch, True)],
        max_tokens=max_tokens,
        num_logprobs=TOP_LOGPROBS,
        engine_args=args,
    )
    for prompt, expected in zip(prompt_ids, one_at_a_time, strict=True):
        tokens, _ = await _generate(driver, prompt, max_tokens)
        assert tokens == expected[0]
    ours = await asyncio.gather(*(_generate(driver, p, max_tokens) for p in batch))
    for mine, expected in zip(ours, theirs, strict=True):
        assert_close(mine, expected)


async def test_the_openai_client_streams_and_gets_structured_outputs_and_tool_calls(
    api: openai.AsyncOpenAI,
) -> None:
    messages = [{"role": "user", "content": "Name a fruit."}]
    body: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": 16}
    whole = await api.chat.completions.create(messages=messages, **body)  # type: ignore[arg-type]
    stream = await api.chat.completions.create(messages=messages, stream=True, **body)  # type: ignore[arg-type]
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == whole.choices[0].message.content and text

    schema = {
        "type": "object",
        "properties": {"fruit": {"type": "string", "maxLength": 20}},
        "required": ["fruit"],
        "additionalProperties": False,
    }
    structured = await api.chat.completions.create(
        messages=messages,  # type: ignore[arg-type]
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "fruit", "schema": schema},
        },
        **{**body, "max_tokens": 40},
    )
    assert isinstance(json.loads(structured.choices[0].message.content or "")["fruit"], str)

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    called = await api.chat.completions.create(
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[weather],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **{**body, "max_tokens": 40},
    )
    (call,) = called.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert isinstance(json.loads(call.function.arguments)["city"], str)  # type: ignore[union-attr]


async def test_a_shoal_api_server_attached_serves_the_vllm_ranks(
    ray_head: RayHead, namespace: str, api: openai.AsyncOpenAI, tmp_path: Path
) -> None:
    args = [
        "api-server", "--namespace", namespace, "--host", "127.0.0.1",
        "--served-model-name", MODEL_NAME, "--data-parallel-address", "127.0.0.1",
    ]  # fmt: skip
    attached = await asyncio.to_thread(start_shoal, ray_head, args, tmp_path / "api.log")
    try:
        other = openai.AsyncOpenAI(
            base_url=f"{attached.base_url}/v1", api_key="unused", max_retries=0, timeout=300
        )
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 12}
        body |= {"temperature": 0.0}
        ours, theirs = await asyncio.gather(
            other.completions.create(**body), api.completions.create(**body)
        )
        assert ours.choices[0].text == theirs.choices[0].text and ours.choices[0].text
    finally:
        await asyncio.to_thread(attached.stop)


async def test_shoal_status_shows_each_ranks_engine(
    ray_head: RayHead, namespace: str, driver: AsyncLLM
) -> None:
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "shoal.deploy", "status", "--namespace", namespace,
         "--address", ray_head.gcs_address],
        capture_output=True, text=True, env=ray_env(), cwd=REPO_ROOT, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line[:1].isdigit()]
    assert [(row[0], row[1], row[2]) for row in rows] == [
        ("0", "ready", "vllm"),
        ("1", "ready", "vllm"),
    ]


async def test_a_vllm_rank_killed_mid_stream_loses_no_stream(
    driver: AsyncLLM, cluster: ClusterHandle, prompt_ids: list[list[int]]
) -> None:
    max_tokens = 48
    references = [await _generate(driver, p, max_tokens) for p in prompt_ids]
    tasks = [asyncio.create_task(_generate(driver, p, max_tokens)) for p in prompt_ids]
    victim = 1
    await decoding_on([driver], victim, 8)
    pid = int(ray.get(cluster.engine(victim).health.remote(), timeout=60)["pid"])
    os.kill(pid, signal.SIGKILL)
    runs = await asyncio.wait_for(asyncio.gather(*tasks), 600)  # no client error
    for run, reference in zip(runs, references, strict=True):
        assert len(run[0]) == max_tokens
        assert_close(run, reference)
    assert dplb_client(driver).router.stats.migrated, "no stream moved off the killed rank"


async def _until_serving(driver: AsyncLLM, ranks: list[int]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while sorted(driver.serving_ranks()) != ranks:
        assert time.monotonic() < deadline, driver.serving_ranks()
        await asyncio.sleep(0.5)


async def test_resizes_1_2_1_under_load_lose_nothing(
    driver: AsyncLLM, prompt_ids: list[list[int]]
) -> None:
    await _until_serving(driver, [0, 1])  # the killed rank is back
    max_tokens = 24
    load = Load(driver, prompt_ids, max_tokens, concurrency=2)
    running = asyncio.create_task(load.run())
    held: list[asyncio.Task[Served]] = []
    for size in (1, 2, 1):
        if size == 1:  # a long request on the leaving rank, handed over as it leaves
            held.append((await hold_on_ranks(driver, prompt_ids, 64, {1}))[-1])
        report = await driver.scale_elastic_ep(size)
        assert report["outcome"] == "committed" and report["to_size"] == size
        await _until_serving(driver, list(range(size)))
        if size == 2:  # the rank the scale-up started serves a request before it leaves
            grown_at = time.monotonic()
            deadline = grown_at + 300
            while not any(1 in s.ranks for s in load.served if s.started_at >= grown_at):
                assert time.monotonic() < deadline, "the new rank served nothing"
                await asyncio.sleep(0.2)
    load.stop.set()
    await asyncio.wait_for(running, 600)
    handed_over = list(await asyncio.wait_for(asyncio.gather(*held), 600))
    for one in [*load.served, *handed_over]:
        assert one.error is None and one.finish_reason == "length", one
    assert all(len(s.token_ids) == max_tokens for s in load.served)
    # Each request held on a leaving rank finished on the other, every token there once.
    assert all(len(s.token_ids) == 64 and len(s.ranks) > 1 for s in handed_over), handed_over
