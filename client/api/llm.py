"""`LLM`: offline batched generation, the interface vLLM users know.

By default the engine core runs in this process; `multiprocess=True` runs it in a child
process behind `SyncMPClient`. Either way, prompts are tokenized here and outputs are
detokenized here.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any, Protocol, cast

from tqdm import tqdm

from shoal.client.api.fan_out import child_params, child_request_id, merge_outputs
from shoal.client.api.lora import LoRARequest, broadcast_loras
from shoal.client.api.output_processor import OutputProcessor
from shoal.client.api.outputs import EmbeddingRequestOutput, RequestOutput
from shoal.client.api.prompts import PromptType, as_prompt_list, chat_prompt, tokenize_prompt
from shoal.engine.config import OFFLINE_MAX_NUM_BATCHED_TOKENS, EngineConfig
from shoal.engine.core.rank_engine import RankEngine, make_rank_engine
from shoal.engine.loader.hub import local_model_config
from shoal.engine.protocol import (
    POOLING_OUTPUT,
    EngineCoreOutputs,
    EngineCoreRequest,
    PoolingParams,
    SamplingParams,
    SchedulerStats,
)
from shoal.engine.tokenizer import Tokenizer, load_tokenizer


class _EngineDriver(Protocol):
    """What `LLM` needs from an engine: in-process core or a multiprocess client."""

    def add_request(self, request: EngineCoreRequest) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    def step_outputs(self) -> list[EngineCoreOutputs]: ...
    def get_stats(self) -> SchedulerStats: ...
    def shutdown(self) -> None: ...


class _InprocDriver:
    def __init__(self, config: EngineConfig) -> None:
        self.engine_core: RankEngine = make_rank_engine(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def step_outputs(self) -> list[EngineCoreOutputs]:
        return list(self.engine_core.step().values())

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.make_stats()

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class LLM:
    """Generates for many prompts at once with continuous batching.

    Args:
        model: local path to a Hugging Face checkpoint directory or a GGUF file.
        multiprocess: run the engine core in a child process.
        max_sequences_per_request: the most sequences (prompts x n, or inputs to embed) one
            `generate`, `chat` or `embed` call may start; None: no bound (an offline batch is
            its caller's own). A call past it raises ValueError before anything is queued.
        **engine_kwargs: engine settings named like vLLM's (`dtype`, `max_model_len`,
            `max_num_seqs`, `max_num_batched_tokens` (default here
            `OFFLINE_MAX_NUM_BATCHED_TOKENS`), `enable_prefix_caching`, `block_size`,
            `kv_cache_memory_bytes`, `num_gpu_blocks_override`, ...).

    Raises:
        ModelLoadError: when the checkpoint cannot be loaded.
        TypeError: for an unknown engine argument.
    """

    def __init__(
        self,
        model: str,
        *,
        multiprocess: bool = False,
        max_sequences_per_request: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if max_sequences_per_request is not None and max_sequences_per_request < 1:
            raise ValueError("max_sequences_per_request must be at least 1")
        self.max_sequences_per_request = max_sequences_per_request
        engine_kwargs.setdefault("max_num_batched_tokens", OFFLINE_MAX_NUM_BATCHED_TOKENS)
        # A Hub id is downloaded once, here, and the engine loads the same snapshot.
        self.config = local_model_config(EngineConfig.from_kwargs(model, **engine_kwargs))
        local = self.config.model
        self.tokenizer: Tokenizer = load_tokenizer(local.tokenizer or local.model)
        self._driver: _EngineDriver
        if multiprocess:
            from shoal.client.transport.sync_mp_client import SyncMPClient

            self._driver = SyncMPClient.make_local(self.config)
        else:
            self._driver = _InprocDriver(self.config)
        self._counter = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Answers one conversation, or a list of them, as vLLM's `LLM.chat` does.

        Args:
            messages: [{"role": ..., "content": ...}, ...], or a list of such conversations.
            sampling_params: as for `generate`.
            add_generation_prompt: end each prompt with the assistant turn's header.
            use_tqdm: as for `generate`.
            lora_request: as for `generate`, one per conversation or one for all.

        Returns:
            One `RequestOutput` per conversation, in order.

        Raises:
            ValueError: the model has no chat template, or the template raised.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = [
            chat_prompt(self.tokenizer, conversation, add_generation_prompt=add_generation_prompt)
            for conversation in cast(Sequence[Sequence[dict[str, Any]]], conversations)
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion.

        Args:
            prompts: one prompt or a list; each is text, token ids, or a vLLM prompt dict.
            sampling_params: one for all prompts, or one per prompt (default: `SamplingParams()`).
            use_tqdm: show a progress bar of finished prompts on stderr, as vLLM does.
            priority: one per prompt, lower first, as vLLM's: an engine made with
                `scheduling_policy="priority"` schedules waiting prompts in this order; under
                "fcfs" it is ignored.
            lora_request: the LoRA adapter of every prompt, or one (or None) per prompt, as
                vLLM's; the engine needs `enable_lora`.

        Returns:
            One `RequestOutput` per prompt, in order. A rejected prompt (too long, invalid
            token ids) has `error` set and finish reason "error"; the others are unaffected.

        Raises:
            ValueError: the number of sampling params or priorities does not match the
                prompts, or the call would start more sequences than
                `max_sequences_per_request`.
        """
        prompt_list = as_prompt_list(prompts)
        params_list = _broadcast_params(sampling_params, len(prompt_list))
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        loras = broadcast_loras(lora_request, len(prompt_list))
        if len(priorities) != len(prompt_list):
            raise ValueError(f"{len(priorities)} priorities for {len(prompt_list)} prompts")
        num_sequences = sum(params.n for params in params_list)
        self._check_num_sequences(num_sequences, f"{len(prompt_list)} prompts, n each")
        processor = OutputProcessor(self.tokenizer)
        request_ids: list[str] = []
        # Parent id -> its children's ids, for prompts with n > 1 (`shoal.client.api.fan_out`).
        groups: dict[str, list[str]] = {}
        for prompt, params, urgency, lora in zip(
            prompt_list, params_list, priorities, loras, strict=True
        ):
            tokenized = tokenize_prompt(self.tokenizer, prompt)
            parent_id = str(next(self._counter))
            children = child_params(params)
            child_ids = (
                [parent_id]
                if len(children) == 1
                else [child_request_id(parent_id, i) for i in range(len(children))]
            )
            groups[parent_id] = child_ids
            for child_id, child in zip(child_ids, children, strict=True):
                request = EngineCoreRequest(
                    request_id=child_id,
                    prompt_token_ids=tokenized.token_ids,
                    sampling_params=child,
                    arrival_time=time.time(),
                    priority=urgency,
                    lora_request=lora,
                )
                processor.add_request(request, tokenized.text)
                self._driver.add_request(request)
                request_ids.append(request.request_id)
        final = self._run(processor, len(request_ids), use_tqdm)
        return [
            final[ids[0]] if len(ids) == 1 else merge_outputs(parent, [final[i] for i in ids])
            for parent, ids in groups.items()
        ]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's pooled final hidden state, as vLLM's `LLM.embed` (the engine made with
        `runner="pooling"`, and `pooler_config` for MEAN pooling).

        Returns:
            One `EmbeddingRequestOutput` per prompt, in order; a rejected prompt has `error`
            set and an empty embedding.

        Raises:
            ValueError: more prompts than `max_sequences_per_request`.
        """
        prompt_list = as_prompt_list(prompts)
        self._check_num_sequences(len(prompt_list), f"{len(prompt_list)} inputs")
        processor = OutputProcessor(self.tokenizer)
        request_ids = []
        for prompt in prompt_list:
            tokenized = tokenize_prompt(self.tokenizer, prompt)
            request = EngineCoreRequest(
                request_id=str(next(self._counter)),
                prompt_token_ids=tokenized.token_ids,
                sampling_params=POOLING_OUTPUT,
                arrival_time=time.time(),
                pooling_params=pooling_params or PoolingParams(),
            )
            processor.add_request(request, tokenized.text)
            self._driver.add_request(request)
            request_ids.append(request.request_id)
        final = self._run(processor, len(request_ids), use_tqdm)
        return [EmbeddingRequestOutput.of(final[i]) for i in request_ids]

    def _run(
        self, processor: OutputProcessor, num_requests: int, use_tqdm: bool
    ) -> dict[str, RequestOutput]:
        """Steps the engine until every request of `processor` finished; their final outputs."""
        final: dict[str, RequestOutput] = {}
        progress = tqdm(total=num_requests, desc="Processed prompts", disable=not use_tqdm)
        try:
            while processor.has_unfinished_requests():
                for outputs in self._driver.step_outputs():
                    processed = processor.process_outputs(outputs.outputs, outputs.engine_index)
                    if processed.reqs_to_abort:
                        self._driver.abort_requests(processed.reqs_to_abort)
                    finished = [o for o in processed.request_outputs if o.finished]
                    final.update((o.request_id, o) for o in finished)
                    progress.update(len(finished))
        except BaseException:
            self._driver.abort_requests(list(processor.request_states))
            raise
        finally:
            progress.close()
        return final

    def _check_num_sequences(self, num_sequences: int, what: str) -> None:
        limit = self.max_sequences_per_request
        if limit is not None and num_sequences > limit:
            raise ValueError(
                f"this call would start {num_sequences} sequences ({what}), more than "
                f"max_sequences_per_request={limit}"
            )

    def get_stats(self) -> SchedulerStats:
        """The engine's current load and cumulative counters (prefix-cache hits, preemptions)."""
        return self._driver.get_stats()

    def shutdown(self) -> None:
        self._driver.shutdown()


def _broadcast_params(
    params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(num_prompts)]
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params_list = list(params)
    if len(params_list) != num_prompts:
        raise ValueError(
            f"got {len(params_list)} sampling params for {num_prompts} prompts; "
            "pass one for all or one per prompt"
        )
    return params_list
