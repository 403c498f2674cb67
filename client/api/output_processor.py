"""Client-side per-request state: detokenize incrementally, apply stop strings, build outputs.

Engines send token ids; this module turns them into `RequestOutput`s. Stop strings are matched
here (the engine only sees token ids), and a request that hits one is reported back so the
caller can abort it in the engine. Shared by `LLM` and `AsyncLLM`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from shoal.client.api.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from shoal.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from shoal.engine.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    RequestOutputKind,
    TokenLogprobs,
)
from shoal.engine.tokenizer import Tokenizer


class RequestOutputCollector:
    """Hands one request's outputs from the output loop to its consumer without blocking.

    The producer never waits: if the consumer is behind, a newer cumulative output replaces the
    unread one and delta outputs are merged, so a slow reader costs memory O(1) per request.
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self._aggregate = output_kind == RequestOutputKind.DELTA
        self._item: RequestOutput | BaseException | None = None
        # The consumer's, while it waits: a bare future costs less per token than an Event.
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self._item, RequestOutput) and isinstance(item, RequestOutput):
            if self._aggregate:
                _merge_delta(self._item, item)
            else:
                self._item = item
        elif not isinstance(self._item, BaseException):
            self._item = item
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # done: the consumer was cancelled
                waiter.set_result(None)

    async def get(self) -> RequestOutput:
        """Waits for the next output.

        Raises:
            BaseException: the error put in place of an output.
        """
        while self._item is None:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        item, self._item = self._item, None
        if isinstance(item, BaseException):
            raise item
        return item


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    for old_c, new_c in zip(into.outputs, new.outputs, strict=True):
        old_c.text += new_c.text
        old_c.token_ids.extend(new_c.token_ids)
        if old_c.logprobs is not None and new_c.logprobs is not None:
            old_c.logprobs.extend(new_c.logprobs)
        old_c.cumulative_logprob = new_c.cumulative_logprob
        old_c.finish_reason = new_c.finish_reason
        old_c.stop_reason = new_c.stop_reason
    into.new_token_ids.extend(new.new_token_ids)
    into.finished = new.finished
    into.error = new.error
    into.metrics = new.metrics
    into.data_parallel_rank = new.data_parallel_rank


@dataclass
class ProcessedOutputs:
    """Result of one `OutputProcessor.process_outputs` call."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Requests finished here by a stop string while the engine still runs them: abort them there.
    reqs_to_abort: list[str] = field(default_factory=list)


class RequestState:
    """Everything the client tracks for one live request."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        tokenizer: Tokenizer | None,
        collector: RequestOutputCollector | None,
    ) -> None:
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.params = request.sampling_params
        self.collector = collector
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=self.params.skip_special_tokens,
            )
            if tokenizer is not None
            else None
        )
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = (
            [] if self.params.logprobs is not None else None
        )
        self.cumulative_logprob: float | None = 0.0 if self.params.logprobs is not None else None
        self.metrics = RequestMetrics(arrival_time=request.arrival_time or time.time())
        self.num_cached_tokens = 0
        self.engine_index: int | None = None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.pooled: list[float] | None = None  # a pooling request's answer
        self._num_sent_tokens = 0
        self._num_sent_chars = 0
        self._num_sent_logprobs = 0
        # Streamed text holds back this many characters: they might begin a stop string.
        self._holdback = max((len(s) for s in self.params.stop), default=1) - 1
        if self.params.include_stop_str_in_output:
            self._holdback = 0
        self._has_stop_strings = bool(self.params.stop)
        self._output_kind = self.params.output_kind

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, output: EngineCoreOutput, engine_index: int, now: float) -> bool:
        """Folds one engine output in; returns True if a stop string finished the request here."""
        # Runs once per streamed token of every request: attribute reads are kept few.
        self.engine_index = engine_index
        if output.num_cached_tokens > self.num_cached_tokens:
            self.num_cached_tokens = output.num_cached_tokens
        new_token_ids = output.new_token_ids
        stopped_here = False
        if new_token_ids:
            metrics = self.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                metrics.queue_time = output.queue_time_s
            metrics.last_token_time = now
            self.token_ids.extend(new_token_ids)
            if output.new_logprobs is not None:
                self._add_logprobs(output.new_logprobs)
            detokenizer = self.detokenizer
            if detokenizer is not None:
                num_new_chars = len(detokenizer.update(new_token_ids))
                self.text = detokenizer.output_text
                if self._has_stop_strings:
                    stopped_here = self._check_stop_strings(num_new_chars)
        if output.pooled is not None:
            self.pooled = output.pooled
        if output.finish_reason is not None and self.finish_reason is None:
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason
            self.error = output.error_message
        if self.finish_reason is not None:
            self.metrics.finished_time = now
        return stopped_here

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """Ends the request on the client side (abort, engine death)."""
        if not self.finished:
            self.finish_reason = reason
            self.error = error
            self.metrics.finished_time = time.time()

    def make_output(self) -> RequestOutput | None:
        """The output to hand to the caller now, following the request's output kind."""
        finished = self.finish_reason is not None
        kind = self._output_kind
        all_token_ids = self.token_ids
        if not finished and (
            kind == RequestOutputKind.FINAL_ONLY or len(all_token_ids) == self._num_sent_tokens
        ):
            return None
        all_text = self.text
        visible = len(all_text) if finished else max(0, len(all_text) - self._holdback)
        new_token_ids = all_token_ids[self._num_sent_tokens :]
        if kind == RequestOutputKind.DELTA:
            text = all_text[self._num_sent_chars : visible]
            token_ids = list(new_token_ids)
            logprobs = (
                self.logprobs[self._num_sent_logprobs :] if self.logprobs is not None else None
            )
        else:
            text, token_ids = all_text[:visible], list(all_token_ids)
            logprobs = list(self.logprobs) if self.logprobs is not None else None
        self._num_sent_tokens = len(all_token_ids)
        if visible > self._num_sent_chars:
            self._num_sent_chars = visible
        self._num_sent_logprobs = len(self.logprobs) if self.logprobs is not None else 0
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(self.finish_reason) if self.finish_reason is not None else None,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            data_parallel_rank=self.engine_index,
            error=self.error,
            new_token_ids=new_token_ids,
            pooled=self.pooled,
        )

    def _check_stop_strings(self, num_new_chars: int) -> bool:
        if self.finished or not self.params.stop:
            return False
        if len(self.token_ids) < self.params.min_tokens:
            return False
        hit = find_stop_string(
            self.text, num_new_chars, self.params.stop, self.params.include_stop_str_in_output
        )
        if hit is None:
            return False
        stop_str, truncate_to = hit
        self.text = self.text[:truncate_to]
        self.finish_reason = FinishReason.STOP
        self.stop_reason = stop_str
        return True

    def _add_logprobs(self, entries: list[TokenLogprobs]) -> None:
        assert self.logprobs is not None and self.cumulative_logprob is not None
        for entry in entries:
            position: dict[int, Logprob] = {}
            for i, (token_id, logprob) in enumerate(
                zip(entry.token_ids, entry.logprobs, strict=True)
            ):
                rank = entry.sampled_rank if i == 0 else i
                position.setdefault(token_id, Logprob(logprob=logprob, rank=rank))
            self.logprobs.append(position)
            self.cumulative_logprob += entry.logprobs[0]


class OutputProcessor:
    """Owns the `RequestState` of every live request of one client."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None = None,
        collector: RequestOutputCollector | None = None,
    ) -> RequestState:
        """Starts tracking a request, keyed by its request id (the caller's, which the engines
        scope by client themselves).

        Raises:
            ValueError: if the request id is already live on this client.
        """
        if request.request_id in self.request_states:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        state = RequestState(request, prompt, self.tokenizer, collector)
        self.request_states[request.request_id] = state
        return state

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def request_ids(self) -> list[str]:
        """The ids of every live request."""
        return list(self.request_states)

    def remove_request(self, request_id: str) -> None:
        """Stops tracking a request that never reached an engine (its send failed)."""
        self.request_states.pop(request_id, None)

    def process_outputs(
        self, outputs: list[EngineCoreOutput], engine_index: int = 0
    ) -> ProcessedOutputs:
        """Applies one engine frame's outputs; finished requests stop being tracked."""
        processed = ProcessedOutputs()
        now = time.time()
        for output in outputs:
            state = self.request_states.get(output.request_id)
            if state is None:  # aborted or already finished by a stop string
                continue
            if state.apply(output, engine_index, now) and output.finish_reason is None:
                processed.reqs_to_abort.append(output.request_id)
            self._emit(state, processed)
        return processed

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Ends requests locally as aborted; returns their final outputs."""
        return self._end(request_ids, FinishReason.ABORT, None)

    def fail_requests(self, request_ids: list[str], error: BaseException) -> None:
        """Hands `error` to the consumers of these requests and stops tracking them."""
        for request_id in request_ids:
            state = self.request_states.pop(request_id, None)
            if state is not None:
                state.finish(FinishReason.ERROR, str(error))
                if state.collector is not None:
                    state.collector.put(error)

    def request_ids_on_engine(self, engine_index: int) -> list[str]:
        return [rid for rid, s in self.request_states.items() if s.engine_index == engine_index]

    def _end(
        self, request_ids: list[str], reason: FinishReason, error: str | None
    ) -> list[RequestOutput]:
        ended = ProcessedOutputs()
        for request_id in request_ids:
            state = self.request_states.get(request_id)
            if state is not None:
                state.finish(reason, error)
                self._emit(state, ended)
        return ended.request_outputs

    def _emit(self, state: RequestState, processed: ProcessedOutputs) -> None:
        output = state.make_output()
        if state.finish_reason is not None:
            self.request_states.pop(state.request_id, None)
        if output is None:
            return
        if state.collector is not None:
            state.collector.put(output)
        processed.request_outputs.append(output)
