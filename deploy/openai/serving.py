"""One prompt's generation as the endpoints drive it: started, streamed as deltas, accumulated.

An endpoint hands a `Generation` its prompt in the one form the client takes
(`TokenizedPrompt`: tokenized off the event loop, or rendered and tokenized with the chat
template), and the prompt's length is checked there, once, before the request is made: a
prompt and `max_tokens` past the context are a 400. A request's generations are then admitted
together (`admit`: its tenant's fair share, or its queue) before any is sent to a rank.
`Generation.start` waits for the first output before any response header is sent, so a
request the engine rejects (invalid token ids, say) is a 400 and a cluster with no serving
rank a 503, never a broken 200 stream. Every sequence that finishes is counted
in the front end's metrics. Closing a generation (the client went away) aborts its engine
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from shoal.client.api.outputs import CompletionOutput, Logprob, RequestOutput
from shoal.client.api.prompts import TokenizedPrompt, tokenize_prompt
from shoal.deploy.openai.admission import work_of
from shoal.deploy.openai.admission_gate import Caller, Ticket
from shoal.deploy.openai.errors import OpenAIError, error_body, from_exception
from shoal.deploy.openai.protocol import UsageInfo
from shoal.deploy.openai.state import ServerState
from shoal.engine.protocol import LoRARequest, SamplingParams


@dataclass
class ChoiceState:
    """One sequence's text, tokens and logprobs so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def as_output(self, index: int) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            text=self.text,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class Generation:
    """The engine requests of one prompt (n of them for `n > 1`), streamed as deltas."""

    def __init__(
        self,
        state: ServerState,
        prompt: TokenizedPrompt,
        params: SamplingParams,
        session_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Raises OpenAIError: the prompt and `max_tokens` exceed the context (400)."""
        _check_length(len(prompt.token_ids), params.max_tokens, state.max_model_len)
        self._stream = state.llm.generate(
            prompt,
            params,
            uuid.uuid4().hex,
            session_id=session_id,
            priority=priority,
            lora_request=lora_request,
        )
        self._metrics = state.metrics
        self.choices = [ChoiceState() for _ in range(params.n)]
        self.num_prompt_ids = len(prompt.token_ids)
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens the engine found in its prefix cache
        self._first: RequestOutput | None = None
        self.ticket: Ticket | None = None  # its admission, which counts the tokens served

    @classmethod
    async def create(
        cls,
        state: ServerState,
        prompt: str | list[int],
        params: SamplingParams,
        session_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> Generation:
        """The generation of a completion's prompt (text or token ids), a text tokenized off
        the event loop (`TokenizerPool`).

        Raises:
            OpenAIError: a text longer than any prompt that fits could be, refused before it is
                tokenized, or a prompt and `max_tokens` that exceed the context (400); the
                tokenizer busy (503).
        """
        if isinstance(prompt, str):
            state.pool.check_text_length(len(prompt), state.max_model_len, "prompt")
            tokenized: TokenizedPrompt = await state.pool.run(
                tokenize_prompt, state.tokenizer, prompt, size=len(prompt)
            )
        else:
            tokenized = TokenizedPrompt(list(prompt))  # ids: nothing to encode
        return cls(state, tokenized, params, session_id, priority, lora_request)

    async def start(self) -> None:
        """Waits for the first output.

        Raises:
            OpenAIError: the engine rejected the request (400) or no rank serves (503).
        """
        try:
            self._first = await anext(aiter(self._stream))
        except BaseException as e:
            await self.close()
            if isinstance(e, Exception):
                raise from_exception(e) from e
            raise

    async def deltas(self) -> AsyncIterator[tuple[int, CompletionOutput]]:
        """(choice index, what is new in it), until every sequence has finished.

        Raises:
            OpenAIError: the generation failed midway (the engine died).
        """
        output = self._first
        try:
            while output is not None:
                for completion in output.outputs:
                    self._absorb(output, completion)
                    yield completion.index, completion
                if output.finished:
                    break
                output = await anext(aiter(self._stream), None)
        except Exception as e:
            raise from_exception(e) from e
        finally:
            await self.close()

    async def run(self) -> None:
        """Runs to the end without streaming."""
        async for _ in self.deltas():
            pass

    async def close(self) -> None:
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def _absorb(self, output: RequestOutput, delta: CompletionOutput) -> None:
        self.num_prompt_tokens = len(output.prompt_token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        choice = self.choices[delta.index]
        choice.text += delta.text
        choice.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            choice.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None and choice.finish_reason is None:
            choice.finish_reason = delta.finish_reason
            choice.stop_reason = delta.stop_reason
            self._metrics.observe_sequence(
                output.data_parallel_rank,
                num_prompt_tokens=self.num_prompt_tokens,
                num_generation_tokens=len(choice.token_ids),
                finish_reason=delta.finish_reason,
                metrics=output.metrics,
                count_prompt=delta.index == 0,
            )
            if self.ticket is not None:
                num_prompt = self.num_prompt_tokens if delta.index == 0 else 0
                self.ticket.add_usage(num_prompt, len(choice.token_ids))


def _check_length(num_prompt: int, max_tokens: int | None, max_model_len: int | None) -> None:
    if max_model_len is None:
        return
    if num_prompt >= max_model_len or num_prompt + (max_tokens or 0) > max_model_len:
        raise OpenAIError(
            f"this model's maximum context length is {max_model_len} tokens; the request has "
            f"{num_prompt} prompt tokens and asks for {max_tokens or 0} more",
            param="max_tokens" if num_prompt < max_model_len else "prompt",
        )


async def admit(
    state: ServerState,
    caller: Caller,
    generations: Sequence[Generation],
    params: SamplingParams,
    priority: int,
) -> None:
    """Admits one request's generations by its caller's tenant: returns once admitted (the
    front door releases the ticket when the response ends).

    Raises:
        OpenAIError: 429 or 503 with `Retry-After` (`AdmissionGate.admit`).
    """
    prompt_lens = [g.num_prompt_ids for g in generations]
    work = work_of(prompt_lens, params.n, params.max_tokens, state.max_model_len)
    ticket = await state.admission.admit(caller.tenant, work, priority)
    caller.tickets.append(ticket)
    for generation in generations:
        generation.ticket = ticket


async def start_all(generations: Sequence[Generation]) -> None:
    """Starts every generation; on any failure closes them all and raises the first error."""
    results = await asyncio.gather(*(g.start() for g in generations), return_exceptions=True)
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        await asyncio.gather(*(g.close() for g in generations), return_exceptions=True)
        raise failure


def usage_of(generations: Sequence[Generation]) -> UsageInfo:
    prompt = sum(g.num_prompt_tokens for g in generations)
    completion = sum(g.num_completion_tokens for g in generations)
    return UsageInfo(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


async def merged_deltas(
    generations: Sequence[Generation],
) -> AsyncIterator[tuple[int, int, CompletionOutput]]:
    """(generation index, choice index, delta) of several generations as they arrive."""
    if len(generations) == 1:
        async for index, delta in generations[0].deltas():
            yield 0, index, delta
        return
    queue: asyncio.Queue[tuple[int, int, CompletionOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, generation: Generation) -> None:
        try:
            async for index, delta in generation.deltas():
                queue.put_nowait((i, index, delta))
        except Exception as e:
            queue.put_nowait(e)
        else:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying a JSON body."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude_unset=False)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(e: BaseException) -> str:
    error = e if isinstance(e, OpenAIError) else from_exception(e)
    return sse(error_body(error))
