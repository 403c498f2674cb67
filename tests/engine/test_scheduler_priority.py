"""Scheduler under `--scheduling-policy priority`: the waiting queue by (priority, arrival),
the least urgent running request preempted first, and the same tokens as an unhurried run."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from shoal.engine.config import EngineConfig, SchedulerConfig, add_engine_cli_args
from shoal.engine.protocol import EngineCoreRequest, SamplingParams
from shoal.engine.request import Request, RequestStatus
from shoal.engine.request_queue import FCFSRequestQueue, PriorityRequestQueue
from shoal.engine.serial import MsgpackDecoder, MsgpackEncoder
from tests.engine.sched_factories import (
    KVCheckingRunner,
    RunResult,
    make_requests,
    make_scheduler,
    reference_tokens,
    run_step,
    run_until_done,
)


def _request(request_id: str, priority: int, arrival_time: float) -> Request:
    return Request(
        request_id,
        [1, 2, 3],
        SamplingParams(max_tokens=4),
        arrival_time=arrival_time,
        priority=priority,
    )


def test_priority_queue_orders_by_priority_then_arrival_then_order_taken_in() -> None:
    queue = PriorityRequestQueue()
    late_urgent = _request("late-urgent", -1, 30.0)
    early = _request("early", 0, 10.0)
    tie_first, tie_second = _request("tie-1", 0, 20.0), _request("tie-2", 0, 20.0)
    lazy = _request("lazy", 5, 1.0)
    for request in (lazy, tie_first, early, tie_second, late_urgent):
        queue.add(request)
    queue.remove(early)
    queue.add_preempted(early)  # back in its place by its key, not at the front
    order = [queue.pop().request_id for _ in range(len(queue))]
    assert order == ["late-urgent", "early", "tie-1", "tie-2", "lazy"]


def test_fcfs_queue_ignores_priority_and_puts_a_preempted_request_first() -> None:
    queue = FCFSRequestQueue()
    first, second, preempted = _request("a", 5, 1.0), _request("b", -5, 2.0), _request("c", 0, 3.0)
    queue.add(first)
    queue.add(second)
    queue.add_preempted(preempted)
    assert [queue.pop().request_id for _ in range(3)] == ["c", "a", "b"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_an_urgent_request_is_admitted_ahead_of_those_waiting_before_it(policy: str) -> None:
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy=policy)  # type: ignore[arg-type]
    first, second = make_requests(2, 5, max_tokens=3, id_prefix="bulk")
    (urgent,) = make_requests(1, 5, max_tokens=3, id_prefix="urgent", priority=-1, seed=1)
    runner = KVCheckingRunner(scheduler)
    result = RunResult()
    scheduler.add_request(first)
    run_step(scheduler, runner, result)  # bulk-0 holds the only seat
    scheduler.add_request(second)
    scheduler.add_request(urgent)
    run_until_done(scheduler, runner, result=result)
    starts = [step[0][0] for step in result.steps if step[0][1] == 0]
    if policy == "priority":
        assert starts == ["bulk-0", "urgent-0", "bulk-1"]
    else:
        assert starts == ["bulk-0", "bulk-1", "urgent-0"]
    for request in (first, second, urgent):
        assert result.token_ids(request.request_id) == reference_tokens(request, 256)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_kv_pressure_preempts_the_least_urgent_not_the_latest(policy: str) -> None:
    # 4 blocks of 4 tokens, two seats: urgent (admitted second) and lazy (admitted first)
    # each need a third block as they decode, and only one is free.
    scheduler = make_scheduler(
        num_blocks=5,
        block_size=4,
        max_num_seqs=2,
        scheduling_policy=policy,  # type: ignore[arg-type]
    )
    (lazy,) = make_requests(1, 4, max_tokens=20, id_prefix="lazy", priority=3)
    (urgent,) = make_requests(1, 4, max_tokens=20, id_prefix="urgent", priority=0, seed=1)
    scheduler.add_request(lazy)
    scheduler.add_request(urgent)
    runner = KVCheckingRunner(scheduler)
    result = RunResult()
    while scheduler.make_stats().num_preemptions_total == 0:
        run_step(scheduler, runner, result)
    victim, survivor = (lazy, urgent) if policy == "priority" else (urgent, lazy)
    assert victim.status == RequestStatus.PREEMPTED
    assert scheduler.running == [survivor]
    run_until_done(scheduler, runner, result=result)
    for request in (lazy, urgent):
        assert result.token_ids(request.request_id) == reference_tokens(request, 20)


def test_a_preempted_request_waits_behind_a_more_urgent_newcomer() -> None:
    scheduler = make_scheduler(
        num_blocks=5, block_size=4, max_num_seqs=2, scheduling_policy="priority"
    )
    (lazy,) = make_requests(1, 4, max_tokens=20, id_prefix="lazy", priority=3)
    (urgent,) = make_requests(1, 4, max_tokens=20, id_prefix="urgent", priority=0, seed=1)
    scheduler.add_request(lazy)
    scheduler.add_request(urgent)
    runner = KVCheckingRunner(scheduler)
    result = RunResult()
    while lazy.status != RequestStatus.PREEMPTED:
        run_step(scheduler, runner, result)
    (newcomer,) = make_requests(1, 4, max_tokens=2, id_prefix="newcomer", priority=1, seed=2)
    scheduler.add_request(newcomer)
    assert [scheduler.waiting.pop(), scheduler.waiting.pop()] == [newcomer, lazy]


def test_priority_travels_on_the_wire_and_reaches_the_engine_request() -> None:
    request = EngineCoreRequest("r", [1, 2], SamplingParams(), priority=-7)
    decoded = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(request))
    assert decoded.priority == -7
    assert Request.from_engine_core_request(decoded).priority == -7
    # Appended (before the newer lora_request): a frame without it (an older client's)
    # decodes to the default.
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(request))
    assert fields[-2:] == [-7, None]
    older_frame = msgspec.msgpack.encode(fields[:-2])
    assert MsgpackDecoder(EngineCoreRequest).decode(older_frame).priority == 0


def test_scheduling_policy_flag_takes_vllms_choices() -> None:
    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    assert parser.parse_args([]).scheduling_policy == "fcfs"
    args = parser.parse_args(["--scheduling-policy", "priority"])
    config = EngineConfig.from_kwargs("m", scheduling_policy=args.scheduling_policy)
    assert config.scheduler.scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lifo"])
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")  # type: ignore[arg-type]
