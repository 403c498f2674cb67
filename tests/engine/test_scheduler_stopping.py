"""Scheduler: when a request stops (max tokens, EOS and min tokens, stop token ids, the
context length and the pool's capacity) and the finish reason it reports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from shoal.engine.protocol import FinishReason, SamplingParams
from shoal.engine.request import Request
from shoal.engine.scheduler import Scheduler
from tests.engine.sched_factories import (
    EOS_TOKEN_ID,
    KVCheckingRunner,
    RunResult,
    TokenFn,
    context_token,
    make_requests,
    make_scheduler,
    run_until_done,
)


def _run_one(
    request: Request, token_fn: TokenFn = context_token, **scheduler_kwargs: Any
) -> tuple[RunResult, Scheduler]:
    scheduler = make_scheduler(**scheduler_kwargs)
    scheduler.add_request(request)
    return run_until_done(scheduler, KVCheckingRunner(scheduler, token_fn)), scheduler


def _always_eos(context: Sequence[int]) -> int:
    return EOS_TOKEN_ID


def _context_length(context: Sequence[int]) -> int:
    return len(context)


def test_max_tokens_ends_with_length() -> None:
    (request,) = make_requests(1, 5, max_tokens=7)
    result, _ = _run_one(request)
    assert len(result.token_ids("req-0")) == 7
    assert result.finish_reason("req-0") == FinishReason.LENGTH
    assert [o.finished for o in result.outputs["req-0"]] == [False] * 6 + [True]


def test_eos_stops_only_after_min_tokens_unless_ignored() -> None:
    eos = (EOS_TOKEN_ID,)
    (request,) = make_requests(1, 5, max_tokens=10, min_tokens=3, eos_token_ids=eos)
    result, _ = _run_one(request, _always_eos)
    assert result.token_ids("req-0") == [EOS_TOKEN_ID] * 4
    last = result.outputs["req-0"][-1]
    assert last.finish_reason == FinishReason.STOP and last.stop_reason is None
    (request,) = make_requests(1, 5, max_tokens=6, ignore_eos=True, eos_token_ids=eos)
    result, _ = _run_one(request, _always_eos)
    assert result.token_ids("req-0") == [EOS_TOKEN_ID] * 6
    assert result.finish_reason("req-0") == FinishReason.LENGTH


@pytest.mark.parametrize(
    ("min_tokens", "expected"), [(0, [5, 6, 7, 8]), (3, [5, 6, 7, 8]), (4, [5, 6, 7, 8, 9, 10])]
)
def test_stop_token_ids_report_the_token(min_tokens: int, expected: list[int]) -> None:
    params = SamplingParams(max_tokens=6, min_tokens=min_tokens, stop_token_ids=[8])
    request = Request("r", [100, 101, 102, 103, 104], params, eos_token_ids=(8,))
    result, _ = _run_one(request, _context_length)
    assert result.token_ids("r") == expected
    last = result.outputs["r"][-1]
    if len(expected) == 4:  # a stop token that is also EOS still reports itself
        assert last.finish_reason == FinishReason.STOP and last.stop_reason == 8
    else:
        assert last.finish_reason == FinishReason.LENGTH and last.stop_reason is None


def test_max_model_len_and_pool_capacity_end_with_length() -> None:
    (request,) = make_requests(1, 15, max_tokens=None)
    result, scheduler = _run_one(request, max_model_len=20)
    assert len(result.token_ids("req-0")) == 5 and request.num_tokens == 20
    assert result.finish_reason("req-0") == FinishReason.LENGTH
    (request,) = make_requests(1, 10, max_tokens=None)
    result, scheduler = _run_one(request, num_blocks=4, block_size=4, max_model_len=256)
    assert request.num_tokens == 16 and result.finish_reason("req-0") == FinishReason.LENGTH
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
