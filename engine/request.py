"""Engine-side state of one request: its tokens, progress and status. No torch, no IO."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shoal.engine.block_hash import ROOT_BLOCK_HASH, adapter_root_hash
from shoal.engine.protocol import (
    EngineCoreRequest,
    FinishReason,
    LoRARequest,
    PoolingParams,
    SamplingParams,
)

if TYPE_CHECKING:
    from shoal.engine.structured_output import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # blocks taken back; waits to recompute from scratch
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self.value >= RequestStatus.FINISHED_STOPPED.value

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """A request as the scheduler and model runner see it.

    Invariant: `num_computed_tokens <= num_tokens`; the KV of `all_token_ids[:num_computed_tokens]`
    is in the request's blocks. A request samples a new token after the step in which
    `num_computed_tokens` reaches `num_tokens`.

    A resumed request (`resumed_output_token_ids`: output another rank generated before it
    left the cluster) starts as a preempted request does: its output so far follows the prompt
    in `all_token_ids` with nothing computed, so the scheduler prefills prompt + output (prefix
    cache hits included) before it samples, and max_tokens, min_tokens, penalties and seeded
    draws count that output as produced. Only tokens sampled here are ever emitted.

    A constrained request (`SamplingParams.structured_outputs`) holds its `grammar`, which
    consumes every output token as it is appended (resumed ones included), so its state always
    matches `output_token_ids`; a preemption keeps the output, and so the state.

    A pooling request (`pooling_params`) never samples: the step whose chunk reaches the end of
    its prompt pools the final hidden states and finishes it.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        client_index: int = 0,
        arrival_time: float | None = None,
        eos_token_ids: tuple[int, ...] = (),
        resumed_output_token_ids: Sequence[int] = (),
        pooling_params: PoolingParams | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.pooling_params = pooling_params
        self.priority = priority  # lower first, under `--scheduling-policy priority`
        self.lora_request = lora_request  # the adapter it runs with; None: the base model
        # The parent hash of its first KV block: adapters' KV never serves the base or another.
        self.root_block_hash = (
            ROOT_BLOCK_HASH
            if lora_request is None
            else adapter_root_hash(lora_request.lora_name, lora_request.lora_path)
        )
        self.client_index = client_index
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.eos_token_ids = eos_token_ids
        self.all_token_ids: list[int] = [*prompt_token_ids, *resumed_output_token_ids]
        self.num_resumed_tokens = len(resumed_output_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache; -1: not looked up
        # Prompt tokens cached when it was queued: its pending prefill while it waits is the
        # rest (an estimate: the cache may change before it is admitted).
        self.num_queued_hit_tokens = 0
        self.num_preemptions = 0
        # Engine-local monotonic times: taken in, and first scheduled (for the queue time).
        self.queued_at = time.monotonic()
        self.first_scheduled_at: float | None = None
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error_message: str | None = None
        self.grammar: RequestGrammar | None = None

    @classmethod
    def from_engine_core_request(
        cls, request: EngineCoreRequest, eos_token_ids: tuple[int, ...] = ()
    ) -> Request:
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            client_index=request.client_index,
            arrival_time=request.arrival_time or None,
            eos_token_ids=eos_token_ids,
            resumed_output_token_ids=request.resumed_output_token_ids,
            pooling_params=request.pooling_params,
            priority=request.priority,
            lora_request=request.lora_request,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def num_pending_prefill_tokens(self) -> int:
        """Prompt (and resumed output) tokens whose KV is not computed yet."""
        num_prefill = self.num_prompt_tokens + self.num_resumed_tokens
        return max(0, num_prefill - self.num_computed_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.grammar is not None and not self.grammar.accept(token_id):
            self.error_message = f"token {token_id} broke the output's grammar"

    def attach_grammar(self, grammar: RequestGrammar) -> None:
        """Constrains the output from now on, after the grammar consumed the output so far.

        Raises:
            ValueError: the output so far (a resumed request's) does not fit the grammar.
        """
        for token_id in self.output_token_ids:
            if not grammar.accept(token_id):
                raise ValueError(f"the resumed output does not fit the grammar: {grammar.error}")
        self.grammar = grammar

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
