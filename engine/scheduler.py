"""Continuous batching: which requests run in each engine step, and how many tokens each.

Owns the waiting queue, the running list, request lifetimes and the KV cache manager; knows
nothing of tensors, sockets or tokenizers (stop strings are the client's). In the style of
vLLM V1: running requests first, then admissions (FCFS, or by priority: `request_queue`),
chunked prefill, prefix-cache hits and preemption by recompute. No torch.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable

from shoal.engine.config import CacheConfig, SchedulerConfig
from shoal.engine.errors import RequestError
from shoal.engine.kv_cache import KVCacheManager
from shoal.engine.lora.config import LoRAConfig
from shoal.engine.lora.requests import adapter_key, has_lora_slot, lora_stats
from shoal.engine.lora.slots import LoRASlots
from shoal.engine.protocol import (
    ITERATION_TOKENS_BUCKETS,
    EngineCoreOutput,
    FinishReason,
    SchedulerStats,
)
from shoal.engine.request import Request, RequestStatus
from shoal.engine.request_queue import RequestQueue, make_request_queue, running_order_key
from shoal.engine.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Schedules requests step by step over a fixed pool of KV blocks.

    One step: `schedule()` → the runner computes it → `update_from_output()`. Call
    `update_from_output` after every `schedule()`, even an empty one: it also delivers the
    outputs of requests that ended outside a step (aborted, rejected).

    Policy per step, within `max_num_batched_tokens` tokens and `max_num_seqs` requests:
      1. Running requests in admission order (priority policy: by (priority, arrival)): a
         decode takes one token, a prefill in progress its next chunk. When one needs a block
         and none is free, the last running request is preempted (blocks freed, recomputed
         later from scratch, queued again ahead of newer requests: `request_queue`);
         possibly the request itself. Under the priority policy that is the least urgent.
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
    with FinishReason.ERROR. A pooling request needs no room for a token after its prompt; the
    step that computes its prompt's last chunk finishes it (STOP) with the pooled vector. Generation also stops with LENGTH when a request fills the whole
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
        sliding_window: the model's window when every layer slides: the KV blocks that fall
            out of it are freed as requests advance (`KVCacheManager`).
        lora: with LoRA (`enable_lora`): `max_loras` bounds the distinct adapters running at
            once (the model's live slots): a waiting request whose adapter would exceed it
            waits at the head.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        num_blocks: int,
        max_model_len: int,
        sliding_window: int | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.max_loras = lora.max_loras if lora is not None and lora.enable_lora else None
        # The runner's slot table, mirrored for the stats (`LoRASlots`: both see every step).
        self.lora_slots = None
        if lora is not None and lora.enable_lora:
            self.lora_slots = LoRASlots(lora.max_loras, lora.num_cpu_loras)
        self.lora_load_s = 0.0  # the seconds the runner's adapter loads took (its outputs say)
        self.block_size = cache_config.kv_block_size
        self.max_model_len = max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache_config.kv_block_size,
            cache_config.enable_prefix_caching,
            sliding_window=sliding_window,
        )
        # One request can never hold more KV than the whole pool.
        self._max_num_tokens = min(max_model_len, num_blocks * cache_config.kv_block_size)
        self.waiting: RequestQueue = make_request_queue(scheduler_config.scheduling_policy)
        self._is_priority = scheduler_config.scheduling_policy == "priority"
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
        error = _why_never_fits(
            request,
            self.max_model_len,
            self.block_size,
            self.kv_cache_manager.num_blocks,
            self.scheduler_config,
        )
        if error is not None:
            request.error_message = error
            self._finish(request, RequestStatus.FINISHED_ERROR)
            return
        _, request.num_queued_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
        self.waiting.add(request)

    def abort_requests(self, request_ids: Iterable[str], error: str | None = None) -> None:
        """Ends requests in any state (with `error`: as failed, saying it); unknown or already
        finished ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.error_message = error
            status = (
                RequestStatus.FINISHED_ABORTED if error is None else RequestStatus.FINISHED_ERROR
            )
            self._finish(request, status)

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
        if scheduled and self.lora_slots is not None:
            self.lora_slots.assign([adapter_key(s.request) for s in scheduled])
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
            if samples and request.is_pooling:
                pooled = model_runner_output.pooled.get(request.request_id)
                assert pooled is not None, f"the runner pooled nothing for {request}"
                self._finish(request, RequestStatus.FINISHED_STOPPED, emit=False)
                output = _pooled_output(request, pooled)
                outputs.setdefault(request.client_index, []).append(output)
                num_finished += 1
            elif samples:
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
            **lora_stats(self.lora_slots, self.running, list(self.waiting), self.lora_load_s),
        )

    # --- internals -----------------------------------------------------------------------------

    def _schedule_running(
        self, token_budget: int, scheduled: list[ScheduledRequest]
    ) -> tuple[int, bool]:
        preempted = False
        if self._is_priority:
            self.running.sort(key=running_order_key)  # the least urgent last: the victims
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
            request = self.waiting.peek()
            if not has_lora_slot(request, self.running, self.max_loras):
                break  # its adapter waits for a running one's to finish
            computed_blocks, num_cached_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_cached_tokens
            can_chunk = (
                self.scheduler_config.enable_chunked_prefill
                or num_new_tokens > self.scheduler_config.max_num_batched_tokens
            )
            if num_new_tokens > token_budget and not can_chunk:
                break
            kv = self.kv_cache_manager
            if num_new_tokens > token_budget and not kv.can_allocate(
                request, num_new_tokens, computed_blocks
            ):
                break  # the whole prompt does not fit yet (nobody overtakes the head)
            num_new_tokens = min(num_new_tokens, token_budget)
            if not kv.allocate_slots(request, num_new_tokens, computed_blocks):
                break  # nobody overtakes the head of the queue
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached_tokens
            if request.first_scheduled_at is None:
                request.first_scheduled_at = time.monotonic()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached_tokens
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new_tokens))
            token_budget -= num_new_tokens

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
        self.waiting.add_preempted(request)

    def _append_sampled_token(
        self, request: Request, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput:
        token_id = model_runner_output.sampled_token_ids.get(request.request_id)
        assert token_id is not None, f"the runner sampled no token for {request}"
        request.append_output_token(token_id)
        self._num_generation_tokens_total += 1
        status = _stop_status(request, token_id, self._max_num_tokens)
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
            queue_time_s=_queue_time_s(request) if request.num_output_tokens == 1 else None,
        )

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


def _queue_time_s(request: Request) -> float | None:
    """Seconds the request waited before it was first scheduled (None: not scheduled yet)."""
    if request.first_scheduled_at is None:
        return None
    return request.first_scheduled_at - request.queued_at


def _stop_status(request: Request, token_id: int, max_num_tokens: int) -> RequestStatus | None:
    """The stop rules, after `token_id` was appended: the status that ends the request, or
    None while it goes on (`max_num_tokens`: the most tokens a sequence may hold)."""
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
    if request.num_tokens >= max_num_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None


def _why_never_fits(
    request: Request,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    config: SchedulerConfig,
) -> str | None:
    """Why a request can never be scheduled (None: it can): an empty prompt, one past the
    context, one the whole KV cache cannot hold, or one too long for a step unchunked."""
    num_prompt = request.num_prompt_tokens
    if num_prompt == 0:
        return "the prompt is empty"
    num_needed = num_prompt + (0 if request.is_pooling else 1)  # room for a token
    if num_needed > max_model_len:
        with_token = "" if request.is_pooling else " with one generated token"
        return (
            f"the prompt has {num_prompt} tokens;{with_token} it exceeds "
            f"max_model_len={max_model_len}"
        )
    num_blocks_needed = _cdiv(num_needed, block_size)
    if num_blocks_needed > num_blocks:
        return (
            f"the prompt has {num_prompt} tokens and needs {num_blocks_needed} KV blocks, "
            f"but the cache has only {num_blocks}"
        )
    max_batched = config.max_num_batched_tokens
    if not config.enable_chunked_prefill and num_prompt > max_batched:
        return (
            f"the prompt has {num_prompt} tokens, more than max_num_batched_tokens="
            f"{max_batched}, and chunked prefill is disabled"
        )
    return None


def _pooled_output(request: Request, pooled: list[float]) -> EngineCoreOutput:
    """A pooling request's one output: its pooled vector, as it finishes."""
    return EngineCoreOutput(
        request_id=request.request_id,
        finish_reason=FinishReason.STOP,
        num_cached_tokens=max(0, request.num_cached_tokens),
        queue_time_s=_queue_time_s(request),
        pooled=pooled,
    )
