"""`POST /v1/chat/completions`: conversations rendered with the model's chat template.

The prompt is the template's text, tokenized without added special tokens (the template
writes them), as `LLM.chat` does. Streams open each choice with an assistant-role delta,
carry content deltas, and close it with its finish reason.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from shoal.client.prompts import chat_prompt
from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from shoal.deploy.openai.sampling import chat_logprobs, sampling_params
from shoal.deploy.openai.serving import SSE_DONE, Generation, sse, sse_error, usage_of
from shoal.deploy.openai.state import ServerState
from shoal.engine.tokenizer import Tokenizer


def messages_as_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the template reads them; content parts of type "text" are joined."""
    rendered = []
    for message in messages:
        item = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            texts = []
            for part in message.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise OpenAIError(
                        "only text content parts are supported", param="messages.content"
                    )
                texts.append(part["text"])
            item["content"] = "\n".join(texts)
        rendered.append(item)
    return rendered


def render_chat(
    tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool
) -> dict[str, Any]:
    """The prompt dict of a conversation.

    Raises:
        OpenAIError: no chat template, or the template refused the conversation (400).
    """
    try:
        return chat_prompt(
            tokenizer, messages_as_dicts(messages), add_generation_prompt=add_generation_prompt
        )
    except ValueError as e:
        raise OpenAIError(str(e), param="messages") from e


async def create_chat_completion(
    state: ServerState, request: ChatCompletionRequest
) -> JSONResponse | StreamingResponse:
    state.check_model(request.model)
    max_tokens = (
        request.max_completion_tokens
        if request.max_completion_tokens is not None
        else request.max_tokens
    )
    params = sampling_params(request, max_tokens=max_tokens)
    prompt = render_chat(state.tokenizer, request.messages, request.add_generation_prompt)
    generation = Generation(state, prompt, params)
    await generation.start()
    num_top = (request.top_logprobs or 0) if request.logprobs else -1
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        events = _stream(state, generation, params.n, num_top, include_usage)
        return StreamingResponse(events, media_type="text/event-stream")
    await generation.run()
    choices = [
        ChatChoice(
            index=i,
            message=ChatResponseMessage(content=choice.text),
            logprobs=ChatLogprobs(
                content=chat_logprobs(state.tokenizer, choice.as_output(i), num_top)
            )
            if num_top >= 0
            else None,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
        )
        for i, choice in enumerate(generation.choices)
    ]
    response = ChatCompletionResponse(
        model=state.model_name, choices=choices, usage=usage_of([generation])
    )
    return JSONResponse(response.model_dump())


async def _stream(
    state: ServerState,
    generation: Generation,
    n: int,
    num_top: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    chunk_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())

    def chunk(choice: ChatStreamChoice) -> str:
        return sse(
            ChatCompletionChunk(
                id=chunk_id, created=created, model=state.model_name, choices=[choice]
            ).model_dump(exclude={"usage"})
        )

    try:
        for i in range(n):
            yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
        async for index, delta in generation.deltas():
            logprobs = (
                ChatLogprobs(content=chat_logprobs(state.tokenizer, delta, num_top))
                if num_top >= 0
                else None
            )
            yield chunk(
                ChatStreamChoice(
                    index=index,
                    delta=DeltaMessage(content=delta.text),
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                )
            )
        if include_usage:
            yield sse(
                ChatCompletionChunk(
                    id=chunk_id,
                    created=created,
                    model=state.model_name,
                    choices=[],
                    usage=usage_of([generation]),
                )
            )
    except Exception as e:  # headers are sent: the error travels as an event
        yield sse_error(e)
    yield SSE_DONE
