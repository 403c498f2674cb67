"""vLLM's EngineCore as a shoal rank's engine (`--engine vllm`), without Ray: two engine
processes (`EngineCoreProc` around `VllmEngineCore`) on a tiny Llama of head size 32, driven
by shoal's own DPLB client over the data plane.

The engines live for the module (each start imports vLLM); every test drives them with a
client of its own. Sampling is checked against shoal's engine on the same checkpoint: the
tiny model's wide logit margins make greedy choices agree across implementations.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from typing import Any

import pytest

from shoal import LLM, AsyncLLM
from shoal.client.routing.lb_client import DPLBAsyncMPClient
from shoal.engine.config import EngineConfig
from shoal.engine.core.engine_process import start_engine_process, stop_engine_process
from shoal.engine.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineEndpoint,
    FinishReason,
    SamplingParams,
    StructuredOutputsParams,
)
from shoal.engine.tokenizer import load_tokenizer
from tests.engine.core.vllm_priority import start_order
from tests.factories import make_tiny_checkpoint
from tests.kv_sync import engine_hits, synced

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32
NUM_BLOCKS = 48
VLLM_KWARGS: dict[str, Any] = {
    "engine": "vllm",
    "dtype": "float32",  # vLLM's "auto" would halve a float32 checkpoint
    "block_size": BLOCK_SIZE,
    "max_model_len": 512,
    "num_gpu_blocks_override": NUM_BLOCKS,
    "max_num_batched_tokens": 256,
    "vllm_engine_args": {"enforce_eager": True},
}
STARTUP_TIMEOUT_S = 600.0
OUTPUT_TIMEOUT_S = 60.0
PROMPT = [3 + (i * 7) % 90 for i in range(40)]


@contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama whose heads vLLM's CPU kernels take (head size 32)."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("vllm-llama"),
        "llama",
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=256,
    )


@pytest.fixture(scope="module")
def endpoints(checkpoint: str) -> Iterator[list[EngineEndpoint]]:
    """Two vLLM engine processes, started at once (one thread each on the 2 cores)."""
    config = EngineConfig.from_kwargs(checkpoint, **VLLM_KWARGS)
    started: dict[int, tuple[BaseProcess, EngineEndpoint]] = {}
    errors: list[BaseException] = []

    def start(index: int) -> None:
        try:
            started[index] = start_engine_process(
                config, engine_index=index, startup_timeout_s=STARTUP_TIMEOUT_S
            )
        except BaseException as e:
            errors.append(e)

    with _environ(OMP_NUM_THREADS="1"):
        threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    try:
        if errors:
            raise errors[0]
        yield [started[i][1] for i in range(2)]
    finally:
        for process, _ in started.values():
            stop_engine_process(process)


@pytest.fixture(scope="module")
def shoal_engine(checkpoint: str) -> Iterator[LLM]:
    """shoal's own engine on the same checkpoint, in this process: the reference."""
    llm = LLM(checkpoint, max_model_len=512, num_gpu_blocks_override=64)
    yield llm
    llm.shutdown()


def _request(request_id: str, prompt: list[int], rank: int | None = None, **params: Any) -> Any:
    params.setdefault("temperature", 0.0)
    request = EngineCoreRequest(request_id, prompt, SamplingParams(**params))
    request.data_parallel_rank = rank
    return request


async def _run(
    client: DPLBAsyncMPClient, *requests: EngineCoreRequest
) -> dict[str, list[EngineCoreOutput]]:
    """Sends `requests` at once; every output of each until it finishes."""
    for request in requests:
        await client.add_request_async(request)
    seen: dict[str, list[EngineCoreOutput]] = {}
    unfinished = {r.request_id for r in requests}
    while unfinished:
        frame = await asyncio.wait_for(client.get_output_async(), OUTPUT_TIMEOUT_S)
        for output in frame.outputs:
            seen.setdefault(output.request_id, []).append(output)
            if output.finished:
                unfinished.discard(output.request_id)
    return seen


def _tokens(outputs: list[EngineCoreOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


async def test_hello_tells_the_clients_vllms_engine_and_its_block_size(
    endpoints: list[EngineEndpoint],
) -> None:
    client = DPLBAsyncMPClient(endpoints)
    try:
        facts = client.engine_facts()
        assert sorted(facts) == [0, 1]
        for rank_facts in facts.values():
            assert rank_facts.engine == "vllm"
            assert rank_facts.block_size == BLOCK_SIZE
            assert rank_facts.num_kv_blocks == NUM_BLOCKS
            assert rank_facts.max_model_len == 512
            assert rank_facts.eos_token_ids == [0]
        assert client.kv_index.block_size == BLOCK_SIZE
    finally:
        client.shutdown()


@pytest.mark.parametrize(
    "params",
    [
        {"max_tokens": 12, "ignore_eos": True},
        {"max_tokens": 12, "ignore_eos": True, "frequency_penalty": 1.5},
        {"max_tokens": 12, "ignore_eos": True, "presence_penalty": 2.0},
        {"max_tokens": 12, "ignore_eos": True, "repetition_penalty": 1.8},
        {"max_tokens": 12, "min_tokens": 6},
        {"max_tokens": 5},
    ],
    ids=["greedy", "frequency", "presence", "repetition", "min-tokens", "max-tokens"],
)
async def test_sampling_parameters_give_shoals_engines_tokens(
    endpoints: list[EngineEndpoint], shoal_engine: LLM, params: dict[str, Any]
) -> None:
    client = DPLBAsyncMPClient(endpoints)
    try:
        outputs = (await _run(client, _request("s", PROMPT, **params)))["s"]
    finally:
        client.shutdown()
    expected = shoal_engine.generate(
        {"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, **params), use_tqdm=False
    )[0].outputs[0]
    assert _tokens(outputs) == list(expected.token_ids)
    assert str(outputs[-1].finish_reason) == expected.finish_reason


async def test_stop_ids_logprobs_and_seeds_map_onto_vllms(endpoints: list[EngineEndpoint]) -> None:
    client = DPLBAsyncMPClient(endpoints)
    try:
        greedy = _tokens((await _run(client, _request("g", PROMPT, max_tokens=10)))["g"])
        # A stop token id that first appears at position 2 or later ends the request there.
        stop_at = next(i for i in range(2, 10) if greedy[i] not in greedy[:i])
        stop = (await _run(client, _request("t", PROMPT, stop_token_ids=[greedy[stop_at]])))["t"]
        assert _tokens(stop) == greedy[: stop_at + 1]
        assert stop[-1].finish_reason == FinishReason.STOP
        assert stop[-1].stop_reason == greedy[stop_at]
        # Logprobs: the sampled token first, then the top 3; greedy samples rank 1.
        logged = (await _run(client, _request("l", PROMPT, max_tokens=4, logprobs=3)))["l"]
        positions = [p for o in logged for p in o.new_logprobs or []]
        assert [p.token_ids[0] for p in positions] == greedy[:4]
        assert all(len(p.token_ids) == 4 and p.sampled_rank == 1 for p in positions)
        assert all(p.logprobs[0] == max(p.logprobs[1:]) for p in positions)
        # A seed draws the same tokens on either rank.
        seeded = [
            _request(f"seed-{rank}", PROMPT, rank, temperature=1.0, seed=7, max_tokens=8)
            for rank in (0, 1)
        ]
        runs = await _run(client, *seeded)
        assert _tokens(runs["seed-0"]) == _tokens(runs["seed-1"])
    finally:
        client.shutdown()


async def test_structured_outputs_constrain_vllms_tokens_and_a_bad_one_fails_alone(
    endpoints: list[EngineEndpoint], checkpoint: str
) -> None:
    tokenizer = load_tokenizer(checkpoint)
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    constraints = {
        "choice": StructuredOutputsParams(choice=["red", "green", "blue"]),
        "regex": StructuredOutputsParams(regex="[ab]{3}c"),
        "json": StructuredOutputsParams(json=schema),
        "bad": StructuredOutputsParams(grammar="start: ((("),
    }
    requests = [
        _request(name, PROMPT, max_tokens=40, structured_outputs=constraint)
        for name, constraint in constraints.items()
    ]
    out_of_vocabulary = _request("oov", [5, 100_000], max_tokens=4)
    client = DPLBAsyncMPClient(endpoints)
    try:
        runs = await _run(client, *requests, out_of_vocabulary)
    finally:
        client.shutdown()
    text = {name: tokenizer.decode(_tokens(runs[name])) for name in ("choice", "regex", "json")}
    assert text["choice"] in ("red", "green", "blue")
    assert re.fullmatch("[ab]{3}c", text["regex"]), text
    assert json.loads(text["json"])["answer"] in ("yes", "no")
    assert all(runs[n][-1].finish_reason == FinishReason.STOP for n in text)
    for name in ("bad", "oov"):
        assert runs[name][-1].finish_reason == FinishReason.ERROR
        assert runs[name][-1].error_message
    assert "Grammar error" in (runs["bad"][-1].error_message or "")


async def test_a_resumed_request_continues_after_its_tokens_on_another_rank(
    endpoints: list[EngineEndpoint],
) -> None:
    client = DPLBAsyncMPClient(endpoints)
    try:
        whole = _tokens((await _run(client, _request("w", PROMPT, 0, max_tokens=16)))["w"])
        resumed = _request("r", PROMPT, 1, max_tokens=16)
        resumed.resumed_output_token_ids = whole[:6]
        outputs = (await _run(client, resumed))["r"]
    finally:
        client.shutdown()
    assert _tokens(outputs) == whole[6:]
    assert outputs[-1].finish_reason == FinishReason.LENGTH


# Room in each rank's cache for one document and its conversations' tails.
DOC_TOKENS = 4 * BLOCK_SIZE
DOCS = {
    "A": [3 + (i * 7) % 90 for i in range(DOC_TOKENS)],
    "B": [3 + (i * 11 + 5) % 90 for i in range(DOC_TOKENS)],
}


async def test_routing_predicts_exactly_the_hits_vllm_counts(
    endpoints: list[EngineEndpoint],
) -> None:
    """Conversations over two documents: the cache-aware router keeps each document's turns
    where its blocks are, from vLLM's own prefix-cache events, and every hit it predicted is
    one vLLM's engine counted."""
    client = DPLBAsyncMPClient(endpoints)
    try:
        await client.call_utility_all_async("reset_prefix_cache")
        await synced(client, attempts=200)
        hits_before = await engine_hits(client)
        history = {f"{doc}{n}": list(DOCS[doc]) for doc in DOCS for n in (1, 2)}
        placed: dict[str, set[int]] = {doc: set() for doc in DOCS}
        reported = 0
        for turn in range(3):
            for name, prompt in history.items():
                prompt.extend(range(40 + turn * 8, 48 + turn * 8))  # this turn's question
                request = _request(f"{name}-{turn}", list(prompt), max_tokens=4, ignore_eos=True)
                await client.add_request_async(request)
                rank = client.rank_of(request.request_id)
                assert rank is not None
                seen = await _collect_one(client, request.request_id)
                placed[name[0]].add(rank)
                reported += seen[0].num_cached_tokens
                prompt.extend(_tokens(seen))
        assert placed["A"] in ({0}, {1}) and placed["B"] in ({0}, {1})
        assert placed["A"] != placed["B"]
        assert reported > 0
        # vLLM's own counters agree with the hits it reported per request, and with what the
        # router predicted from the KV events when it chose each rank.
        assert await engine_hits(client) - hits_before == reported
        stats = client.router.stats
        assert stats.predicted_hit_tokens == stats.actual_hit_tokens == reported
        assert stats.decisions.get("cache", 0) >= 8
        await synced(client, attempts=200)
        # A cleared cache (vLLM's AllBlocksCleared) empties the index too.
        assert all((await client.call_utility_all_async("reset_prefix_cache")).values())
        await synced(client, attempts=200)
        assert all(not view.keys for view in client.kv_index.views.values())
    finally:
        client.shutdown()


async def _collect_one(client: DPLBAsyncMPClient, request_id: str) -> list[EngineCoreOutput]:
    seen: list[EngineCoreOutput] = []
    while not (seen and seen[-1].finished):
        frame = await asyncio.wait_for(client.get_output_async(), OUTPUT_TIMEOUT_S)
        seen += [o for o in frame.outputs if o.request_id == request_id]
    return seen


async def test_the_python_api_serves_vllms_engine_by_name(
    endpoints: list[EngineEndpoint], checkpoint: str
) -> None:
    """`AsyncLLM(model, engine="vllm")`: its own engine process hosts vLLM's engine, and its
    greedy text is the ranks' here."""
    client = DPLBAsyncMPClient(endpoints)
    try:
        expected = _tokens((await _run(client, _request("p", PROMPT, max_tokens=8)))["p"])
    finally:
        client.shutdown()
    kwargs = {k: v for k, v in VLLM_KWARGS.items() if k != "engine"}
    with _environ(OMP_NUM_THREADS="1"):
        llm = AsyncLLM(checkpoint, engine="vllm", **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8)
        outputs = [
            out async for out in llm.generate({"prompt_token_ids": PROMPT}, params, request_id="p")
        ]
        assert list(outputs[-1].outputs[0].token_ids) == expected
        assert [f.engine for f in llm.engine_core.engine_facts().values()] == ["vllm"]
    finally:
        await llm.aclose()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
async def test_priority_orders_vllms_waiting_queue_under_its_scheduling_policy(
    checkpoint: str, policy: str
) -> None:
    """An urgent request (priority -1) that arrives after another one waiting for the only
    seat starts first under `--scheduling-policy priority`, and in arrival order under fcfs."""
    kwargs = {**VLLM_KWARGS, "max_num_seqs": 1, "scheduling_policy": policy}
    order = await asyncio.to_thread(start_order, checkpoint, kwargs)
    if policy == "priority":
        assert order == ["bulk-0", "urgent", "bulk-1"]
    else:
        assert order == ["bulk-0", "bulk-1", "urgent"]
