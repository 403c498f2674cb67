"""`POST /v1/completions`: text or token-id prompts, one or a batch, streamed (SSE) or not.

Choice `index` is `prompt_index * n + sequence_index`, as in OpenAI's API. With
`stream_options.include_usage` the stream ends with a chunk whose `choices` is empty and whose
`usage` covers the whole request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from shoal.deploy.openai.admission_gate import Caller
from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from shoal.deploy.openai.sampling import completion_logprobs, sampling_params
from shoal.deploy.openai.serving import (
    SSE_DONE,
    Generation,
    admit,
    merged_deltas,
    sse,
    sse_error,
    start_all,
    usage_of,
)
from shoal.deploy.openai.state import ServerState

# The most prompts one request may batch.
MAX_PROMPTS = 1024


def _prompts(request: CompletionRequest) -> list[str | list[int]]:
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be empty", param="prompt")
    if len(prompt) > MAX_PROMPTS and not isinstance(prompt[0], int):
        raise OpenAIError(f"a batch holds at most {MAX_PROMPTS} prompts", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    if any(not p for p in prompt):
        raise OpenAIError("prompt must not be empty", param="prompt")
    return [list(p) for p in prompt]  # type: ignore[arg-type]


async def create_completion(
    state: ServerState, request: CompletionRequest, session_id: str | None, caller: Caller
) -> JSONResponse | StreamingResponse:
    lora = state.check_model(request.model)
    prompts = _prompts(request)
    state.limits.check_request(request, len(prompts))
    params = sampling_params(
        request,
        max_tokens=request.max_tokens,
        max_logprobs=state.max_logprobs,
        defaults=state.sampling_defaults,
    )
    await state.grammar_sandbox.check(params.structured_outputs)
    generations = [
        await Generation.create(state, prompt, params, session_id, request.priority, lora)
        for prompt in prompts
    ]
    await admit(state, caller, generations, params, request.priority)
    await start_all(generations)
    num_top = request.logprobs if request.logprobs is not None else -1
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        events = _stream(state, generations, params.n, num_top, include_usage)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        for generation in generations:
            await generation.run()
    finally:
        for generation in generations:
            await generation.close()
    choices = []
    for p, generation in enumerate(generations):
        for i, choice in enumerate(generation.choices):
            logprobs = (
                completion_logprobs(state.tokenizer, choice.as_output(i), num_top, 0)
                if num_top >= 0
                else None
            )
            choices.append(
                CompletionChoice(
                    index=p * params.n + i,
                    text=choice.text,
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
    response = CompletionResponse(
        model=state.model_name, choices=choices, usage=usage_of(generations)
    )
    return JSONResponse(response.model_dump())


async def _stream(
    state: ServerState,
    generations: list[Generation],
    n: int,
    num_top: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    response_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    offsets: dict[int, int] = {}
    try:
        async for p, i, delta in merged_deltas(generations):
            index = p * n + i
            logprobs = None
            if num_top >= 0:
                logprobs = completion_logprobs(
                    state.tokenizer, delta, num_top, offsets.get(index, 0)
                )
            offsets[index] = offsets.get(index, 0) + len(delta.text)
            choice = CompletionChoice(
                index=index,
                text=delta.text,
                logprobs=logprobs,
                finish_reason=delta.finish_reason,
                stop_reason=delta.stop_reason,
            )
            yield sse(
                CompletionResponse(
                    id=response_id, created=created, model=state.model_name, choices=[choice]
                ).model_dump(exclude={"usage"})
            )
        if include_usage:
            yield sse(
                CompletionResponse(
                    id=response_id,
                    created=created,
                    model=state.model_name,
                    choices=[],
                    usage=usage_of(generations),
                )
            )
    except Exception as e:  # headers are sent: the error travels as an event
        yield sse_error(e)
    yield SSE_DONE
