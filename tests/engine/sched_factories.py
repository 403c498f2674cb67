"""Factories and a deterministic driver for scheduler and KV cache tests (pure Python).

`KVCheckingRunner` plays the model runner: it writes each computed token into its slot of a
simulated KV pool, reads the whole context back from the request's blocks before sampling,
and samples a token that is a function of that context. Wrong blocks, stolen blocks or a bad
prefix hit therefore show up as an assertion or as different tokens.
"""

from __future__ import annotations

import random
import zlib
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.engine.config import CacheConfig, SchedulerConfig, SchedulingPolicy
from shoal.engine.protocol import EngineCoreOutput, FinishReason, SamplingParams
from shoal.engine.request import Request
from shoal.engine.scheduler import Scheduler
from shoal.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

VOCAB_SIZE = 1000
EOS_TOKEN_ID = VOCAB_SIZE  # never produced by `context_token`

TokenFn = Callable[[Sequence[int]], int]


def context_token(context: Sequence[int]) -> int:
    """A stand-in for a model: the next token as a stable function of the whole context."""
    return zlib.crc32(array("q", context).tobytes()) % VOCAB_SIZE


def make_requests(
    num_requests: int,
    prompt_len: int | Sequence[int] = 10,
    *,
    seed: int = 0,
    prefix: Sequence[int] = (),
    id_prefix: str = "req",
    client_index: int = 0,
    eos_token_ids: tuple[int, ...] = (),
    priority: int = 0,
    **sampling_kwargs: Any,
) -> list[Request]:
    """Requests with random prompts (`prefix` + random tokens), ids `{id_prefix}-{i}`.

    Args:
        prompt_len: one length for all, or one per request (prefix included).
        sampling_kwargs: `SamplingParams` fields; max_tokens defaults to 8.
    """
    rng = random.Random(seed)
    lens = [prompt_len] * num_requests if isinstance(prompt_len, int) else list(prompt_len)
    sampling_kwargs.setdefault("max_tokens", 8)
    requests = []
    for i, n in enumerate(lens):
        prompt = list(prefix) + [rng.randrange(VOCAB_SIZE) for _ in range(n - len(prefix))]
        requests.append(
            Request(
                f"{id_prefix}-{i}",
                prompt,
                SamplingParams(**sampling_kwargs),
                client_index=client_index,
                eos_token_ids=eos_token_ids,
                priority=priority,
            )
        )
    return requests


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    max_model_len: int = 256,
    scheduling_policy: SchedulingPolicy = "fcfs",
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            scheduling_policy=scheduling_policy,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
    )


class KVCheckingRunner:
    """The test driver in place of the model runner (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, token_fn: TokenFn = context_token) -> None:
        self.block_size = scheduler.block_size
        self.slots: list[int | None] = [None] * (
            scheduler.kv_cache_manager.num_blocks * self.block_size
        )
        self.token_fn = token_fn

    def _slot(self, block_ids: Sequence[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # All writes before any read, as in one forward pass: two requests wrongly sharing a
        # block would overwrite each other and fail the read-back.
        for s in scheduler_output.scheduled:
            end = s.start + s.num_new_tokens
            assert len(s.block_ids) * self.block_size >= end, f"too few blocks for {s.request}"
            for pos in range(s.start, end):
                self.slots[self._slot(s.block_ids, pos)] = s.request.all_token_ids[pos]
        output = ModelRunnerOutput()
        for s in scheduler_output.scheduled:
            if not s.samples:
                continue
            end = s.start + s.num_new_tokens
            context = [self.slots[self._slot(s.block_ids, pos)] for pos in range(end)]
            assert context == s.request.all_token_ids[:end], f"KV of {s.request} is corrupt"
            output.sampled_token_ids[s.request.request_id] = self.token_fn(s.request.all_token_ids)
        return output


def assert_invariants(scheduler: Scheduler) -> None:
    """Block ownership, conservation and queue states are consistent."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    owners: Counter[int] = Counter()
    assert len(scheduler.running) <= scheduler.scheduler_config.max_num_seqs
    for request in scheduler.running:
        block_ids = kv.get_block_ids(request.request_id)
        assert len(set(block_ids)) == len(block_ids), f"{request} holds a block twice"
        assert len(block_ids) * kv.block_size >= request.num_computed_tokens
        assert request.num_computed_tokens < request.num_tokens
        owners.update(block_ids)
    for request in scheduler.waiting:
        assert not kv.get_block_ids(request.request_id), f"waiting {request} holds blocks"
        assert request.num_computed_tokens == 0
    live = {r.request_id for r in scheduler.running} | {r.request_id for r in scheduler.waiting}
    assert live == set(scheduler.requests), "request table out of sync with the queues"
    for block in pool.blocks:
        assert block.ref_count == owners[block.block_id], f"bad ref_count on {block}"
        if block.ref_count > 1:
            assert block.block_hash is not None, f"{block} shared but not a prefix-cache block"
    free_ids = list(pool.free_block_ids())
    assert len(free_ids) == len(set(free_ids))
    assert set(free_ids) == {b.block_id for b in pool.blocks if b.ref_count == 0}
    assert len(free_ids) + len(owners) == kv.num_blocks


@dataclass
class RunResult:
    """What a run produced: every output per request, and each non-empty step's
    (request id, start, num_new_tokens) per scheduled request."""

    outputs: dict[str, list[EngineCoreOutput]] = field(default_factory=dict)
    steps: list[list[tuple[str, int, int]]] = field(default_factory=list)

    def token_ids(self, request_id: str) -> list[int]:
        return [t for o in self.outputs[request_id] for t in o.new_token_ids]

    def finish_reason(self, request_id: str) -> FinishReason | None:
        return self.outputs[request_id][-1].finish_reason


def run_step(scheduler: Scheduler, runner: KVCheckingRunner, result: RunResult) -> None:
    """One engine step, checking the step limits and the invariants."""
    running_before = {r.request_id for r in scheduler.running}
    preemptions_before = scheduler.make_stats().num_preemptions_total
    scheduler_output = scheduler.schedule()
    if scheduler.make_stats().num_preemptions_total > preemptions_before:
        admitted = {s.request.request_id for s in scheduler_output.scheduled} - running_before
        assert not admitted, f"admitted {admitted} in a step that preempted"
    config = scheduler.scheduler_config
    assert scheduler_output.num_batched_tokens <= config.max_num_batched_tokens
    assert len(scheduler_output.scheduled) <= config.max_num_seqs
    if not scheduler_output.is_empty:
        result.steps.append(
            [(s.request.request_id, s.start, s.num_new_tokens) for s in scheduler_output.scheduled]
        )
    runner_output = runner.execute_model(scheduler_output)
    for outputs in scheduler.update_from_output(scheduler_output, runner_output).values():
        for output in outputs:
            sent = result.outputs.setdefault(output.request_id, [])
            assert not (sent and sent[-1].finished), f"output after finish: {output}"
            sent.append(output)
    assert_invariants(scheduler)


def run_until_done(
    scheduler: Scheduler,
    runner: KVCheckingRunner | None = None,
    *,
    max_steps: int = 10_000,
    result: RunResult | None = None,
) -> RunResult:
    runner = runner or KVCheckingRunner(scheduler)
    result = result or RunResult()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return result
        run_step(scheduler, runner, result)
    raise AssertionError(f"not done after {max_steps} steps: {scheduler.requests}")


def reference_tokens(
    request: Request, max_num_tokens: int, token_fn: TokenFn = context_token
) -> list[int]:
    """The tokens an unhurried engine would produce for a request (the test oracle)."""
    params = request.sampling_params
    tokens = list(request.prompt_token_ids)
    outputs: list[int] = []
    while True:
        token = token_fn(tokens)
        tokens.append(token)
        outputs.append(token)
        if len(outputs) > params.min_tokens and (
            token in params.stop_token_ids
            or (not params.ignore_eos and token in request.eos_token_ids)
        ):
            return outputs
        if params.max_tokens is not None and len(outputs) >= params.max_tokens:
            return outputs
        if len(tokens) >= max_num_tokens:
            return outputs
