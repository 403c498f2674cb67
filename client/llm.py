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

from shoal.client.fan_out import child_params, child_request_id, merge_outputs
from shoal.client.output_processor import OutputProcessor
from shoal.client.outputs import RequestOutput
from shoal.client.prompts import PromptType, as_prompt_list, chat_prompt, tokenize_prompt
from shoal.engine.config import OFFLINE_MAX_NUM_BATCHED_TOKENS, EngineConfig
from shoal.engine.core.engine_core import EngineCore
from shoal.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
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
        self.engine_core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def step_outputs(self) -> list[EngineCoreOutputs]:
        return list(self.engine_core.step().values())

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.get_stats()

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class LLM:
    """Generates for many prompts at once with continuous batching.

    Args:
        model: local path to a Hugging Face checkpoint directory or a GGUF file.
        multiprocess: run the engine core in a child process.
        **engine_kwargs: engine settings named like vLLM's (`dtype`, `max_model_len`,
            `max_num_seqs`, `max_num_batched_tokens` (default here
            `OFFLINE_MAX_NUM_BATCHED_TOKENS`), `enable_prefix_caching`, `block_size`,
            `kv_cache_memory_bytes`, `num_gpu_blocks_override`, ...).

    Raises:
        ModelLoadError: when the checkpoint cannot be loaded.
        TypeError: for an unknown engine argument.
    """

    def __init__(self, model: str, *, multiprocess: bool = False, **engine_kwargs: Any) -> None:
        engine_kwargs.setdefault("max_num_batched_tokens", OFFLINE_MAX_NUM_BATCHED_TOKENS)
        self.config = EngineConfig.from_kwargs(model, **engine_kwargs)
        self.tokenizer: Tokenizer = load_tokenizer(self.config.model.tokenizer or model)
        self._driver: _EngineDriver
        if multiprocess:
            from shoal.client.core_client import SyncMPClient

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
    ) -> list[RequestOutput]:
        """Answers one conversation, or a list of them, as vLLM's `LLM.chat` does.

        Args:
            messages: [{"role": ..., "content": ...}, ...], or a list of such conversations.
            sampling_params: as for `generate`.
            add_generation_prompt: end each prompt with the assistant turn's header.
            use_tqdm: as for `generate`.

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
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion.

        Args:
            prompts: one prompt or a list; each is text, token ids, or a vLLM prompt dict.
            sampling_params: one for all prompts, or one per prompt (default: `SamplingParams()`).
            use_tqdm: show a progress bar of finished prompts on stderr, as vLLM does.

        Returns:
            One `RequestOutput` per prompt, in order. A rejected prompt (too long, invalid
            token ids) has `error` set and finish reason "error"; the others are unaffected.

        Raises:
            ValueError: if the number of sampling params does not match the prompts.
        """
        prompt_list = as_prompt_list(prompts)
        params_list = _broadcast_params(sampling_params, len(prompt_list))
        processor = OutputProcessor(self.tokenizer)
        request_ids: list[str] = []
        # Parent id -> its children's ids, for prompts with n > 1 (`shoal.client.fan_out`).
        groups: dict[str, list[str]] = {}
        for prompt, params in zip(prompt_list, params_list, strict=True):
            text, token_ids = tokenize_prompt(self.tokenizer, prompt)
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
                    prompt_token_ids=token_ids,
                    sampling_params=child,
                    arrival_time=time.time(),
                )
                processor.add_request(request, text)
                self._driver.add_request(request)
                request_ids.append(request.request_id)
        final: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
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
        return [
            final[ids[0]] if len(ids) == 1 else merge_outputs(parent, [final[i] for i in ids])
            for parent, ids in groups.items()
        ]

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
