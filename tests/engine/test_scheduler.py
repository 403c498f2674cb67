"""Scheduler: chunked prefill, limits, prefix hits, preemption, aborts, stopping, stats."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from shoal.engine.errors import RequestError
from shoal.engine.protocol import FinishReason, SamplingParams
from shoal.engine.request import Request, RequestStatus
from shoal.engine.scheduler import Scheduler
from shoal.engine.scheduler_output import ModelRunnerOutput
from tests.engine.sched_factories import (
    KVCheckingRunner,
    RunResult,
    assert_invariants,
    context_token,
    make_requests,
    make_scheduler,
    reference_tokens,
    run_step,
    run_until_done,
)


def _add(scheduler: Scheduler, requests: Sequence[Request]) -> None:
    for request in requests:
        scheduler.add_request(request)


def _max_num_tokens(scheduler: Scheduler) -> int:
    kv = scheduler.kv_cache_manager
    return min(scheduler.max_model_len, kv.num_blocks * kv.block_size)


def _assert_all_blocks_free(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0


# --- batching -------------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    (request,) = make_requests(1, 50, max_tokens=3)
    scheduler.add_request(request)
    result = run_until_done(scheduler)
    assert result.steps == [
        [("req-0", 0, 16)],
        [("req-0", 16, 16)],
        [("req-0", 32, 16)],
        [("req-0", 48, 2)],
        [("req-0", 50, 1)],
        [("req-0", 51, 1)],
    ]
    assert result.token_ids("req-0") == reference_tokens(request, 256)
    _assert_all_blocks_free(scheduler)


def test_stats_count_each_step_by_the_tokens_it_computed() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    (request,) = make_requests(1, 50, max_tokens=3)
    scheduler.add_request(request)
    run_until_done(scheduler)  # steps of 16, 16, 16, 2, 1 and 1 tokens (as above)
    stats = scheduler.make_stats()
    # Buckets of at most 1, 8, 16, 32, ... tokens, the last one past 16,384.
    assert stats.iteration_tokens_counts == [2, 1, 3] + [0] * 11
    assert stats.iteration_tokens_sum == 52


def test_decodes_go_first_and_a_new_prompt_takes_the_rest_of_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16)
    short, long = make_requests(2, [6, 40], max_tokens=4)
    scheduler.add_request(short)
    result = RunResult()
    runner = KVCheckingRunner(scheduler)
    run_step(scheduler, runner, result)
    scheduler.add_request(long)
    run_step(scheduler, runner, result)
    run_step(scheduler, runner, result)
    assert result.steps == [
        [("req-0", 0, 6)],
        [("req-0", 6, 1), ("req-1", 0, 15)],
        [("req-0", 7, 1), ("req-1", 15, 15)],
    ]


def test_without_chunked_prefill_prompts_run_whole() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    requests = make_requests(3, [10, 10, 17], max_tokens=2)
    _add(scheduler, requests)
    result = run_until_done(scheduler)
    assert result.steps[0] == [("req-0", 0, 10)]  # req-1 does not fit the remaining 6 tokens
    assert result.steps[1] == [("req-0", 10, 1), ("req-1", 0, 10)]
    assert result.finish_reason("req-2") == FinishReason.ERROR
    assert "chunked prefill is disabled" in (result.outputs["req-2"][0].error_message or "")
    for request in requests[:2]:
        assert result.token_ids(request.request_id) == reference_tokens(request, 256)


def test_without_chunked_prefill_a_resumed_request_over_the_budget_is_chunked() -> None:
    scheduler = make_scheduler(
        num_blocks=6,
        block_size=4,
        max_num_batched_tokens=8,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
    )
    requests = make_requests(2, 6, max_tokens=10)
    _add(scheduler, requests)
    result = run_until_done(scheduler)
    assert requests[1].num_preemptions >= 1
    # Preempted at 12 tokens: its recompute can never fit one step whole, so it is chunked.
    assert [("req-1", 0, 8)] in result.steps and [("req-1", 8, 4)] in result.steps
    for request in requests:
        assert result.token_ids(request.request_id) == reference_tokens(request, 256)


def test_budget_and_max_num_seqs_hold_every_step() -> None:
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=10)
    lens = [random.Random(7).randrange(1, 30) for _ in range(12)]
    requests = make_requests(12, lens, max_tokens=5)
    _add(scheduler, requests)
    result = run_until_done(scheduler)  # asserts both limits after every step
    assert max(len(step) for step in result.steps) == 3
    assert max(sum(n for _, _, n in step) for step in result.steps) == 10
    for request in requests:
        assert result.token_ids(request.request_id) == reference_tokens(request, 256)
    _assert_all_blocks_free(scheduler)


# --- prefix caching --------------------------------------------------------------------------


def test_repeated_prompt_hits_the_prefix_cache() -> None:
    scheduler = make_scheduler(block_size=4)
    (first,) = make_requests(1, 18, id_prefix="first", max_tokens=4)
    scheduler.add_request(first)
    runner = KVCheckingRunner(scheduler)  # one runner: hits read the KV that `first` wrote
    first_result = run_until_done(scheduler, runner)
    assert first_result.outputs["first-0"][0].num_cached_tokens == 0
    again = Request("again", first.prompt_token_ids, SamplingParams(max_tokens=4))
    scheduler.add_request(again)
    # While it waits, its pending prefill is what the cache does not hold: the load it is.
    assert scheduler.make_stats().num_pending_prefill_tokens == 18 - 16
    result = run_until_done(scheduler, runner)
    assert result.steps[0] == [("again", 16, 2)]  # four full blocks reused
    assert all(o.num_cached_tokens == 16 for o in result.outputs["again"])
    assert result.token_ids("again") == first_result.token_ids("first-0")
    stats = scheduler.make_stats()
    assert stats.prefix_cache_queries_total == 36 and stats.prefix_cache_hits_total == 16
    assert stats.num_prompt_tokens_total == 18 + 2


def test_prefix_hit_on_a_running_request_and_on_its_generated_tokens() -> None:
    scheduler = make_scheduler(block_size=4)
    (first,) = make_requests(1, 8, id_prefix="first", max_tokens=20)
    scheduler.add_request(first)
    runner = KVCheckingRunner(scheduler)
    result = RunResult()
    for _ in range(5):  # prefill + 4 decodes: 13 tokens, 12 computed
        run_step(scheduler, runner, result)
    follower = Request("follower", list(first.all_token_ids), SamplingParams(max_tokens=2))
    scheduler.add_request(follower)
    run_step(scheduler, runner, result)
    assert ("follower", 12, 1) in result.steps[-1]
    assert follower.num_cached_tokens == 12
    first_blocks = scheduler.kv_cache_manager.get_block_ids("first-0")
    assert scheduler.kv_cache_manager.get_block_ids("follower")[:3] == first_blocks[:3]
    run_until_done(scheduler, runner, result=result)
    assert result.token_ids("follower") == reference_tokens(follower, 256)
    _assert_all_blocks_free(scheduler)


# --- preemption ------------------------------------------------------------------------------


def test_preemption_takes_the_most_recently_admitted_and_requeues_it_first() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    older, newer, third = make_requests(3, 4, max_tokens=20)
    _add(scheduler, [older, newer, third])
    runner = KVCheckingRunner(scheduler)
    result = RunResult()
    while scheduler.make_stats().num_preemptions_total == 0:
        run_step(scheduler, runner, result)
    assert newer.status == RequestStatus.PREEMPTED and newer.num_preemptions == 1
    assert list(scheduler.waiting) == [newer, third] and scheduler.running == [older]
    assert newer.num_computed_tokens == 0 and newer.num_output_tokens > 0
    run_until_done(scheduler, runner, result=result)
    for request in (older, newer, third):
        assert result.token_ids(request.request_id) == reference_tokens(request, 16)
    # Each request's prompt is looked up once, as vLLM counts: not again after a preemption.
    assert scheduler.make_stats().prefix_cache_queries_total == 3 * 4
    _assert_all_blocks_free(scheduler)


def test_a_long_prompt_waits_until_its_whole_prompt_fits_not_just_its_first_chunk() -> None:
    # 12 blocks of 4 tokens; budget 16. `short` holds 5 blocks after its prompt and grows to
    # 6 as it decodes. `long` (32 tokens: 8 blocks) has a first chunk of 4 blocks, which would
    # fit at once; admitted chunk by chunk it would take the blocks `short` needs and preempt.
    scheduler = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16)
    (short,) = make_requests(1, 16, max_tokens=8, id_prefix="short")
    (long,) = make_requests(1, 32, max_tokens=4, id_prefix="long", seed=1)
    _add(scheduler, [short])
    runner = KVCheckingRunner(scheduler)
    result = RunResult()
    run_step(scheduler, runner, result)  # short's prompt: 4 blocks
    scheduler.add_request(long)
    # Long's prompt needs 8 blocks; short holds 5 or 6 of the 12 while it runs.
    while not short.is_finished:
        run_step(scheduler, runner, result)
        assert long.status == RequestStatus.WAITING or short.is_finished
    run_until_done(scheduler, runner, result=result)
    assert scheduler.make_stats().num_preemptions_total == 0
    for request in (short, long):
        assert result.token_ids(request.request_id) == reference_tokens(
            request, _max_num_tokens(scheduler)
        )
    _assert_all_blocks_free(scheduler)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_tiny_pool_preempts_yet_produces_the_same_tokens(enable_prefix_caching: bool) -> None:
    outputs = {}
    for num_blocks in (8, 256):
        scheduler = make_scheduler(
            num_blocks=num_blocks, block_size=4, enable_prefix_caching=enable_prefix_caching
        )
        _add(scheduler, make_requests(6, [5, 9, 12, 7, 3, 10], max_tokens=12))
        result = run_until_done(scheduler)
        outputs[num_blocks] = {rid: result.token_ids(rid) for rid in result.outputs}
        preemptions = scheduler.make_stats().num_preemptions_total
        assert (preemptions > 0) == (num_blocks == 8)
        _assert_all_blocks_free(scheduler)
    assert outputs[8] == outputs[256]
    assert all(len(tokens) == 12 for tokens in outputs[8].values())


# --- aborts and errors -----------------------------------------------------------------------


def test_abort_in_every_state_frees_blocks_and_reports_abort() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=2)
    running, preempted, waiting = make_requests(3, 5, max_tokens=30)
    _add(scheduler, [running, preempted, waiting])
    runner = KVCheckingRunner(scheduler)
    result = RunResult()
    while preempted.status != RequestStatus.PREEMPTED:
        run_step(scheduler, runner, result)
    assert running.status == RequestStatus.RUNNING and waiting.status == RequestStatus.WAITING
    assert scheduler.kv_cache_manager.num_free_blocks < 6
    scheduler.abort_requests(["req-0", "req-1", "req-2", "no-such-request"])
    _assert_all_blocks_free(scheduler)
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0
    assert scheduler.has_unfinished_requests()  # the abort outputs are still to be delivered
    scheduler_output = scheduler.schedule()
    assert scheduler_output.is_empty
    assert sorted(scheduler_output.finished_request_ids) == ["req-0", "req-1", "req-2"]
    outputs = scheduler.update_from_output(scheduler_output, ModelRunnerOutput())
    assert sorted(o.request_id for o in outputs[0]) == ["req-0", "req-1", "req-2"]
    assert all(o.finish_reason == FinishReason.ABORT and not o.new_token_ids for o in outputs[0])
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in (running, preempted, waiting))
    assert not scheduler.has_unfinished_requests()
    scheduler.abort_requests(["req-0"])  # already finished: ignored
    assert not scheduler.has_unfinished_requests()


def test_requests_that_can_never_fit_end_with_error_while_others_complete() -> None:
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_model_len=30)
    ok = make_requests(2, 6, max_tokens=3)
    too_long_for_model = Request("long", list(range(30)), SamplingParams())
    too_big_for_pool = Request("big", list(range(20)), SamplingParams())
    empty = Request("empty", [], SamplingParams())
    _add(scheduler, [ok[0], too_long_for_model, too_big_for_pool, empty, ok[1]])
    result = run_until_done(scheduler)
    errors = {rid: result.outputs[rid] for rid in ("long", "big", "empty")}
    for outputs in errors.values():
        assert len(outputs) == 1 and outputs[0].finish_reason == FinishReason.ERROR
    assert "max_model_len=30" in (errors["long"][0].error_message or "")
    assert "needs 6 KV blocks, but the cache has only 5" in (errors["big"][0].error_message or "")
    assert "empty" in (errors["empty"][0].error_message or "")
    for request in ok:
        assert result.finish_reason(request.request_id) == FinishReason.LENGTH
        assert len(result.token_ids(request.request_id)) == 3
    _assert_all_blocks_free(scheduler)


def test_duplicate_live_request_id_is_refused() -> None:
    scheduler = make_scheduler()
    (request,) = make_requests(1)
    scheduler.add_request(request)
    with pytest.raises(RequestError, match="already in use"):
        scheduler.add_request(Request("req-0", [1, 2], SamplingParams()))
    assert scheduler.num_waiting == 1


# --- outputs and stats -----------------------------------------------------------------------


def test_outputs_are_grouped_by_client_index() -> None:
    scheduler = make_scheduler()
    for client_index in (0, 1, 2):
        _add(
            scheduler,
            make_requests(2, 5, id_prefix=f"c{client_index}", client_index=client_index),
        )
    scheduler_output = scheduler.schedule()
    outputs = scheduler.update_from_output(
        scheduler_output, KVCheckingRunner(scheduler).execute_model(scheduler_output)
    )
    assert sorted(outputs) == [0, 1, 2]
    for client_index, client_outputs in outputs.items():
        assert sorted(o.request_id for o in client_outputs) == [
            f"c{client_index}-0",
            f"c{client_index}-1",
        ]


def test_stats_track_queues_blocks_steps_and_counters() -> None:
    scheduler = make_scheduler(
        num_blocks=20, block_size=4, max_num_seqs=2, max_num_batched_tokens=16
    )
    _add(scheduler, make_requests(3, 10, max_tokens=2))
    stats = scheduler.make_stats()
    assert (stats.num_waiting_reqs, stats.num_running_reqs) == (3, 0)
    assert stats.num_pending_prefill_tokens == 30 and stats.step_counter == 0
    assert (stats.num_free_blocks, stats.num_total_blocks, stats.kv_cache_usage) == (20, 20, 0.0)
    runner = KVCheckingRunner(scheduler)
    result = RunResult()
    run_step(scheduler, runner, result)  # req-0 whole, req-1 six tokens; req-2 has no seat
    stats = scheduler.make_stats()
    assert (stats.num_waiting_reqs, stats.num_running_reqs) == (1, 2)
    assert stats.num_pending_prefill_tokens == 4 + 10
    assert stats.num_free_blocks == 20 - 3 - 2
    assert stats.kv_cache_usage == pytest.approx(5 / 20)
    assert stats.step_counter == 1 and stats.num_prompt_tokens_total == 16
    assert stats.num_generation_tokens_total == 1
    run_until_done(scheduler, runner, result=result)
    stats = scheduler.make_stats()
    assert stats.num_prompt_tokens_total == 30 and stats.num_generation_tokens_total == 6
    assert stats.step_counter == len(result.steps)
    assert stats.prefix_cache_queries_total == 30 and stats.prefix_cache_hits_total == 0
    assert (stats.num_free_blocks, stats.kv_cache_usage) == (20, 0.0)


def test_step_counter_counts_only_steps_that_schedule_something() -> None:
    scheduler = make_scheduler()
    scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput())
    assert scheduler.make_stats().step_counter == 0
    _add(scheduler, make_requests(1, 5, max_tokens=2))
    result = run_until_done(scheduler)
    assert scheduler.make_stats().step_counter == 2 == len(result.steps)
    assert scheduler.reset_prefix_cache()


# --- stress ----------------------------------------------------------------------------------


def _small_vocab_token(context: Sequence[int]) -> int:
    return context_token(context) % 20  # small enough that stop and EOS tokens occur


@pytest.mark.parametrize(
    ("seed", "num_blocks", "chunked", "caching"),
    [(1, 12, True, True), (2, 8, True, True), (3, 12, False, True), (4, 10, True, False)],
)
def test_random_traffic_keeps_invariants_and_finishes_everything(
    seed: int, num_blocks: int, chunked: bool, caching: bool
) -> None:
    rng = random.Random(seed)
    scheduler = make_scheduler(
        num_blocks=num_blocks,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
        max_model_len=40,
    )
    runner = KVCheckingRunner(scheduler, _small_vocab_token)
    prefixes = [[rng.randrange(20) for _ in range(n)] for n in (4, 8, 13)]
    result = RunResult()
    requests: dict[str, Request] = {}
    aborted: set[str] = set()
    for step in range(300):
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            prefix = rng.choice([[], *prefixes])
            prompt = prefix + [rng.randrange(20) for _ in range(rng.randrange(0, 30))]
            params = SamplingParams(
                max_tokens=rng.choice([None, 1, 5, 20]),
                min_tokens=rng.choice([0, 0, 1]),
                stop_token_ids=rng.sample(range(20), rng.choice([0, 1])),
                ignore_eos=rng.random() < 0.3,
            )
            request = Request(
                f"s{step}-{len(requests)}",
                prompt,
                params,
                client_index=rng.randrange(3),
                eos_token_ids=(3,),
            )
            requests[request.request_id] = request
            scheduler.add_request(request)
        live = scheduler.all_request_ids()
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            aborted.add(victim)
            scheduler.abort_requests([victim])
        if rng.random() < 0.02:
            scheduler.reset_prefix_cache()
        run_step(scheduler, runner, result)
    run_until_done(scheduler, runner, result=result)
    _assert_all_blocks_free(scheduler)
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
    assert scheduler.make_stats().num_preemptions_total > 0
    max_num_tokens = _max_num_tokens(scheduler)
    for request_id, request in requests.items():
        outputs = result.outputs[request_id]
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        tokens = result.token_ids(request_id)
        expected = reference_tokens(request, max_num_tokens, _small_vocab_token)
        reason = outputs[-1].finish_reason
        if reason == FinishReason.ERROR:
            num_prompt = request.num_prompt_tokens
            never_fits = num_prompt == 0 or num_prompt >= 40 or num_prompt >= num_blocks * 4
            never_fits |= not chunked and num_prompt > 16
            assert never_fits and not tokens, request
        elif reason == FinishReason.ABORT:
            assert request_id in aborted and tokens == expected[: len(tokens)]
        else:
            assert tokens == expected, request
    assert_invariants(scheduler)


def test_scheduler_and_kv_cache_import_no_torch() -> None:
    code = "import sys, shoal.engine.scheduler; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
