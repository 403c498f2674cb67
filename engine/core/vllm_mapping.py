"""Shoal's requests to vLLM's and vLLM's outputs and stats back, for `VllmEngineCore`.

Requests: the sampling fields and the priority map one to one (vLLM's names are shoal's; the
priority orders vLLM's waiting queue under `--scheduling-policy priority`); stop strings stay
with the client, which applies them as it detokenizes (as vLLM's own front end does), so the
engine gets only stop token ids. EOS and the generation config's stop ids are added as vLLM's
input processor adds them. A request resumed from another rank (`resumed_output_token_ids`)
is computed as prompt + those tokens, with max_tokens and min_tokens lowered by their number,
so its stream continues after them; its penalties see them as prompt tokens.

Outputs and stats: finish reasons keep their numbers (vLLM's `repetition` becomes `stop`);
vLLM's per-step prefix-cache counts and iteration details are summed into shoal's cumulative
`SchedulerStats`. vLLM is imported inside the functions that need it.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, Any

from shoal.engine.protocol import (
    ITERATION_TOKENS_BUCKETS,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
    SchedulerStats,
    StructuredOutputsParams,
    TokenLogprobs,
)

if TYPE_CHECKING:
    import vllm
    import vllm.v1.engine
    import vllm.v1.metrics.stats
    from vllm.v1.core.sched.interface import SchedulerInterface

_QUEUED, _SCHEDULED = 1, 2  # vLLM's EngineCoreEventType values


class RequestMapper:
    """Builds vLLM's `EngineCoreRequest` for shoal's.

    Args:
        max_model_len: the engine's context length (a request without max_tokens runs to it).
        generation_config: the checkpoint's generation config fields, as vLLM reads them.
        eos_token_id: the tokenizer's EOS id.
    """

    def __init__(
        self, max_model_len: int, generation_config: dict[str, Any], eos_token_id: int | None
    ) -> None:
        self.max_model_len = max_model_len
        self.generation_config = generation_config
        self.eos_token_id = eos_token_id

    def to_vllm(self, request: EngineCoreRequest) -> vllm.v1.engine.EngineCoreRequest:
        """vLLM's request for a validated one (the same scoped id and client index).

        Raises:
            ValueError: the request names a LoRA adapter (shoal's engine serves those).
        """
        from vllm.v1.engine import EngineCoreRequest as VllmRequest

        if request.lora_request is not None:
            raise ValueError("LoRA adapters are served by shoal's engine (--engine shoal)")

        prompt = [*request.prompt_token_ids, *request.resumed_output_token_ids]
        params = self.sampling_params(request.sampling_params, len(prompt), request)
        return VllmRequest(
            request_id=request.request_id,
            prompt_token_ids=prompt,
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=request.arrival_time,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            client_index=request.client_index,
            priority=request.priority,
        )

    def sampling_params(
        self, params: SamplingParams, num_prompt_tokens: int, request: EngineCoreRequest
    ) -> vllm.SamplingParams:
        """vLLM's sampling parameters, with EOS and stop ids resolved as its front end does."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        num_resumed = len(request.resumed_output_token_ids)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - num_prompt_tokens
        else:
            max_tokens -= num_resumed
        vllm_params = VllmSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            seed=params.seed,
            max_tokens=max_tokens,
            min_tokens=min(max(0, params.min_tokens - num_resumed), max_tokens),
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            logprobs=params.logprobs,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            skip_special_tokens=params.skip_special_tokens,
            structured_outputs=_structured_outputs(params.structured_outputs),
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
        )
        vllm_params.update_from_generation_config(self.generation_config, self.eos_token_id)
        return vllm_params


def _structured_outputs(constraint: StructuredOutputsParams | None) -> Any:
    """vLLM's constraint for shoal's (the same kinds, under the same names)."""
    if constraint is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams as VllmStructuredOutputs

    if constraint.whitespace_flexible:
        raise ValueError(
            "structured outputs with flexible whitespace are not served by vLLM engines "
            "(they emit compact JSON)"
        )
    return VllmStructuredOutputs(
        json=constraint.json,
        regex=constraint.regex,
        choice=constraint.choice,
        grammar=constraint.grammar,
        json_object=True if constraint.json_object else None,
    )


def from_vllm_output(output: Any) -> EngineCoreOutput:
    """Shoal's output for one of vLLM's (a request's tokens of one step)."""
    finish = output.finish_reason
    finish_reason = None
    if finish is not None:  # vLLM's numbers are shoal's; its "repetition" is a stop
        finish_reason = FinishReason(finish) if finish <= FinishReason.ERROR else FinishReason.STOP
    stats = output.prefill_stats
    return EngineCoreOutput(
        request_id=output.request_id,
        new_token_ids=list(output.new_token_ids),
        new_logprobs=_logprobs(output.new_logprobs),
        finish_reason=finish_reason,
        stop_reason=output.stop_reason,
        num_cached_tokens=stats.num_cached_tokens if stats is not None else 0,
        error_message="the vLLM engine failed this request"
        if finish_reason == FinishReason.ERROR
        else None,
        queue_time_s=_queue_time(output.events),
    )


def _logprobs(lists: Any) -> list[TokenLogprobs] | None:
    """One `TokenLogprobs` per generated position: the sampled token first, then the top-n."""
    if lists is None:
        return None
    ids, logprobs, ranks = lists.logprob_token_ids, lists.logprobs, lists.sampled_token_ranks
    return [
        TokenLogprobs([int(t) for t in ids[i]], [float(v) for v in logprobs[i]], int(ranks[i]))
        for i in range(len(ids))
    ]


def _queue_time(events: list[Any] | None) -> float | None:
    """Seconds between queued and first scheduled, when this output carries both."""
    if not events:
        return None
    times = {int(e.type): e.timestamp for e in events}
    if _QUEUED in times and _SCHEDULED in times:
        return max(0.0, times[_SCHEDULED] - times[_QUEUED])
    return None


class VllmStats:
    """Shoal's cumulative `SchedulerStats` for a vLLM engine.

    vLLM's scheduler hands out prefix-cache counts per interval (each `make_stats` starts a
    new one) and a step's token counts with its outputs; every one it hands out passes
    through `absorb`, so the totals miss nothing.
    """

    def __init__(self) -> None:
        self.step_counter = 0
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0
        self.num_preemptions_total = 0
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.iteration_tokens_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.iteration_tokens_sum = 0

    def absorb(self, stats: vllm.v1.metrics.stats.SchedulerStats | None) -> None:
        """Adds one interval of vLLM's scheduler stats (and a step's details, if it has)."""
        if stats is None:
            return
        cache = stats.prefix_cache_stats
        self.prefix_cache_queries_total += cache.queries
        self.prefix_cache_hits_total += cache.hits
        self.num_preemptions_total += cache.preempted_requests
        details = stats.iteration_details
        if details is not None and not details.is_dummy:
            num_tokens = details.num_ctx_tokens + details.num_generation_tokens
            self.step_counter += 1
            self.num_prompt_tokens_total += details.num_ctx_tokens
            self.iteration_tokens_counts[bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
            self.iteration_tokens_sum += num_tokens

    def snapshot(self, scheduler: SchedulerInterface, num_cached_blocks: int) -> SchedulerStats:
        """The load now: vLLM's queues and KV pool, with the totals absorbed so far."""
        stats = scheduler.make_stats()
        assert stats is not None, "vLLM's engine is built with log_stats"
        self.absorb(stats)
        sched: Any = scheduler
        pool = sched.kv_cache_manager.block_pool
        num_total_blocks = pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
        return SchedulerStats(
            num_running_reqs=stats.num_running_reqs,
            num_waiting_reqs=stats.num_waiting_reqs + stats.num_skipped_waiting_reqs,
            num_pending_prefill_tokens=sum(
                max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in sched.requests.values()
            ),
            kv_cache_usage=stats.kv_cache_usage,
            num_free_blocks=pool.get_num_free_blocks(),
            num_total_blocks=num_total_blocks,
            step_counter=self.step_counter,
            prefix_cache_queries_total=self.prefix_cache_queries_total,
            prefix_cache_hits_total=self.prefix_cache_hits_total,
            num_preemptions_total=self.num_preemptions_total,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            num_cached_blocks=num_cached_blocks,
            iteration_tokens_counts=list(self.iteration_tokens_counts),
            iteration_tokens_sum=self.iteration_tokens_sum,
        )
