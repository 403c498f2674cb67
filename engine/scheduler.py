"""Continuous batching: which requests run in each engine step, and how many tokens each.

Owns the waiting queue, the running list, request lifetimes and the KV cache manager; knows
nothing of tensors, sockets or tokenizers (stop strings are the client's). FCFS in the style of
vLLM V1: running requests first, then admissions, chunked prefill, prefix-cache hits and
preemption by recompute. No torch.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable

from shoal.engine.config import CacheConfig, SchedulerConfig
from shoal.engine.errors import RequestError
from shoal.engine.kv_cache import KVCacheManager
from shoal.engine.protocol import ITERATION_TOKENS_BUCKETS, EngineCoreOutput, SchedulerStats
from shoal.engine.request import Request, RequestStatus
from shoal.engine.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Schedules requests step by step over a fixed pool of KV blocks.

    One step: `schedule()` → the runner computes it → `update_from_output()`. Call
    `update_from_output` after every `schedule()`, even an empty one: it also delivers the
    outputs of requests that ended outside a step (aborted, rejected).

    Policy per step, within `max_num_batched_tokens` tokens and `max_num_seqs` requests:
      1. Running requests in admission order: a decode takes one token, a prefill in progress
         its next chunk. When one needs a block and none is free, the most recently admitted
         running request is preempted (blocks freed, recomputed later from scratch, put at the
         front of the waiting queue); possibly the request itself.
      2. If nobody was preempted, waiting requests in order while the budget, the seat limit
         and the free blocks allow; each starts after its prefix-cache hit. A request is
         admitted only when the free blocks hold its whole prompt (and resumed tokens), not
         just its first chunk, as vLLM's `scheduler_reserve_full_isl` does: a long prompt
         admitted chunk by chunk would otherwise take the blocks the running requests need
         for their next tokens, and preempt them. Without chunked prefill a request's tokens
         must fit whole in the remaining budget, except a resumed request that outgrew the
         whole budget, which could otherwise never run again.

    A request that can never fit (empty prompt, prompt + 1 token over `max_model_len` or over
    the whole pool, or a prompt over the step budget without chunked prefill) finishes at once
    with FinishReason.ERROR. Generation also stops with LENGTH when a request fills the whole
    pool, so a lone running request always gets its blocks and nothing deadlocks.

    Aborts: the request ends wherever it is, its blocks are freed, and an output with
    FinishReason.ABORT goes to its client with the next update. vLLM sends none because its
    client aborts first; here the engine may abort on its own (a client detached), and a client
    ignores outputs of requests it no longer tracks.

    Args:
        scheduler_config: batching limits.
        cache_config: block size and prefix caching.
        num_blocks: KV blocks the model runner allocated.
        max_model_len: the context length limit (prompt + output tokens).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        num_blocks: int,
        max_model_len: int,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        # One request can never hold more KV than the whole pool.
        self._max_num_tokens = min(max_model_len, num_blocks * cache_config.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_request_ids: list[str] = []
        self._pending_outputs: list[tuple[int, EngineCoreOutput]] = []
        self._step_counter = 0
        self._num_preemptions_total = 0
        self._num_prompt_tokens_total = 0
        self._num_generation_tokens_total = 0
        self._iteration_tokens_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self._iteration_tokens_sum = 0

    # --- requests ------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def get_request(self, request_id: str) -> Request | None:
        """A live (unfinished) request by id."""
        return self.requests.get(request_id)

    def all_request_ids(self) -> list[str]:
        return list(self.requests)

    def request_ids_of_client(self, client_index: int) -> list[str]:
        return [r.request_id for r in self.requests.values() if r.client_index == client_index]

    def has_unfinished_requests(self) -> bool:
        """True while a step is needed: requests to run, or ended ones not yet reported."""
        return bool(self.requests or self._pending_outputs or self._finished_request_ids)

    def add_request(self, request: Request) -> None:
        """Queues a request, or finishes it with an ERROR output if it can never fit.

        Raises:
            RequestError: if a live request already has this id.
        """
        if request.request_id in self.requests:
            raise RequestError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        error = self._why_never_fits(request)
        if error is not None:
            request.error_message = error
            self._finish(request, RequestStatus.FINISHED_ERROR)
            return
        _, request.num_queued_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Ends requests in any state; unknown or already finished ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def reset_prefix_cache(self) -> bool:
        """Forgets all cached prefixes. Returns False while any request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    # --- the step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Picks this step's requests and token counts, reserving their KV blocks.

        Returns:
            the step; each `block_ids` is the request's live block table, valid until
            `update_from_output`.
        """
        token_budget = self.scheduler_config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        token_budget, preempted = self._schedule_running(token_budget, scheduled)
        if not preempted:
            self._schedule_waiting(token_budget, scheduled)
        if scheduled:
            self._step_counter += 1
            num_tokens = sum(s.num_new_tokens for s in scheduled)
            self._iteration_tokens_counts[bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
            self._iteration_tokens_sum += num_tokens
        finished_request_ids, self._finished_request_ids = self._finished_request_ids, []
        return SchedulerOutput(scheduled, finished_request_ids)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, list[EngineCoreOutput]]:
        """Advances the scheduled requests, appends sampled tokens and applies stop rules.

        Returns:
            client index → outputs for requests that got a token or ended since the last call.
        """
        outputs: dict[int, list[EngineCoreOutput]] = {}
        for client_index, output in self._pending_outputs:
            outputs.setdefault(client_index, []).append(output)
        self._pending_outputs = []
        num_finished = 0
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted after schedule()
            samples = scheduled.samples  # reads num_computed_tokens, so before advancing it
            self._advance(scheduled)
            if samples:
                output = self._append_sampled_token(request, model_runner_output)
                outputs.setdefault(request.client_index, []).append(output)
                num_finished += output.finished
        if num_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def make_stats(self) -> SchedulerStats:
        """A load snapshot: queue lengths, KV usage, the step counter and running totals.

        The pending prefill of a request that waits leaves out what the prefix cache held of
        its prompt when it was queued: that is the work it will take, which routing weighs.
        """
        kv = self.kv_cache_manager
        pending = sum(
            r.num_pending_prefill_tokens - (0 if r.num_computed_tokens else r.num_queued_hit_tokens)
            for r in self.waiting
        )
        pending += sum(r.num_pending_prefill_tokens for r in self.running)
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_pending_prefill_tokens=pending,
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            step_counter=self._step_counter,
            prefix_cache_queries_total=kv.num_prefix_cache_queries,
            prefix_cache_hits_total=kv.num_prefix_cache_hits,
            num_preemptions_total=self._num_preemptions_total,
            num_prompt_tokens_total=self._num_prompt_tokens_total,
            num_generation_tokens_total=self._num_generation_tokens_total,
            num_cached_blocks=kv.block_pool.num_cached_blocks,
            iteration_tokens_counts=list(self._iteration_tokens_counts),
            iteration_tokens_sum=self._iteration_tokens_sum,
        )

    # --- internals -----------------------------------------------------------------------------

    def _schedule_running(
        self, token_budget: int, scheduled: list[ScheduledRequest]
    ) -> tuple[int, bool]:
        preempted = False
        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            assert num_new_tokens > 0, f"{request} is running with nothing to compute"
            while not self.kv_cache_manager.allocate_slots(request, num_new_tokens):
                # Victims come from the back, which this loop has not reached: none of them
                # is in `scheduled` yet, except possibly `request` itself.
                victim = self.running.pop()
                preempted = True
                if victim is request and not self.running:
                    request.error_message = "the KV cache cannot hold this request"
                    self._finish(request, RequestStatus.FINISHED_ERROR)
                else:
                    self._preempt(victim)
                if victim is request:
                    return token_budget, preempted
            scheduled.append(self._scheduled(request, num_new_tokens))
            token_budget -= num_new_tokens
            i += 1
        return token_budget, preempted

    def _schedule_waiting(self, token_budget: int, scheduled: list[ScheduledRequest]) -> None:
        max_num_seqs = self.scheduler_config.max_num_seqs
        while self.waiting and token_budget > 0 and len(self.running) < max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_cached_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_cached_tokens
            if num_new_tokens > token_budget and not self._can_chunk(num_new_tokens):
                break
            kv = self.kv_cache_manager
            if num_new_tokens > token_budget and not kv.can_allocate(
                request, num_new_tokens, computed_blocks
            ):
                break  # the whole prompt does not fit yet (FCFS: nobody overtakes the head)
            num_new_tokens = min(num_new_tokens, token_budget)
            if not kv.allocate_slots(request, num_new_tokens, computed_blocks):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached_tokens
            if request.first_scheduled_at is None:
                request.first_scheduled_at = time.monotonic()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached_tokens
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new_tokens))
            token_budget -= num_new_tokens

    def _can_chunk(self, num_new_tokens: int) -> bool:
        return (
            self.scheduler_config.enable_chunked_prefill
            or num_new_tokens > self.scheduler_config.max_num_batched_tokens
        )

    def _scheduled(self, request: Request, num_new_tokens: int) -> ScheduledRequest:
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        return ScheduledRequest(request, num_new_tokens, block_ids)

    def _advance(self, scheduled: ScheduledRequest) -> None:
        request = scheduled.request
        start, end = scheduled.start, scheduled.start + scheduled.num_new_tokens
        # Prompt positions computed, a preempted request's recompute included.
        self._num_prompt_tokens_total += max(0, min(end, request.num_prompt_tokens) - start)
        request.num_computed_tokens = end
        self.kv_cache_manager.cache_full_blocks(request)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _append_sampled_token(
        self, request: Request, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput:
        token_id = model_runner_output.sampled_token_ids.get(request.request_id)
        assert token_id is not None, f"the runner sampled no token for {request}"
        request.append_output_token(token_id)
        self._num_generation_tokens_total += 1
        status = self._check_stop(request, token_id)
        if status is not None:
            self._finish(request, status, emit=False)
        logprobs = model_runner_output.logprobs.get(request.request_id)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[token_id],
            new_logprobs=[logprobs] if logprobs is not None else None,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(0, request.num_cached_tokens),
            error_message=request.error_message,
            queue_time_s=self._queue_time_s(request) if request.num_output_tokens == 1 else None,
        )

    @staticmethod
    def _queue_time_s(request: Request) -> float | None:
        if request.first_scheduled_at is None:
            return None
        return request.first_scheduled_at - request.queued_at

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.grammar is not None and request.error_message is not None:
            # Its grammar refused the token (a mask lets through only what the grammar takes).
            return RequestStatus.FINISHED_ERROR
        if request.grammar is not None and request.grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED  # the constrained output is complete
        # Stop and EOS tokens are masked for the first min_tokens outputs, as in the sampler.
        if request.num_output_tokens > params.min_tokens:
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self._max_num_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _why_never_fits(self, request: Request) -> str | None:
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            return "the prompt is empty"
        if num_prompt + 1 > self.max_model_len:
            return (
                f"the prompt has {num_prompt} tokens; with one generated token it exceeds "
                f"max_model_len={self.max_model_len}"
            )
        num_blocks_needed = _cdiv(num_prompt + 1, self.block_size)
        if num_blocks_needed > self.kv_cache_manager.num_blocks:
            return (
                f"the prompt has {num_prompt} tokens and needs {num_blocks_needed} KV blocks, "
                f"but the cache has only {self.kv_cache_manager.num_blocks}"
            )
        max_batched = self.scheduler_config.max_num_batched_tokens
        if not self.scheduler_config.enable_chunked_prefill and num_prompt > max_batched:
            return (
                f"the prompt has {num_prompt} tokens, more than max_num_batched_tokens="
                f"{max_batched}, and chunked prefill is disabled"
            )
        return None

    def _finish(self, request: Request, status: RequestStatus, *, emit: bool = True) -> None:
        """Ends a request taken off the queues: frees its blocks and reports it (if `emit`)."""
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_request_ids.append(request.request_id)
        if emit:
            output = EngineCoreOutput(
                request_id=request.request_id,
                finish_reason=status.finish_reason,
                error_message=request.error_message,
                num_cached_tokens=max(0, request.num_cached_tokens),
            )
            self._pending_outputs.append((request.client_index, output))
