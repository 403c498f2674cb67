"""`POST /v1/chat/completions`: conversations rendered with the model's chat template.

The prompt is the template's text, tokenized without added special tokens (the template
writes them), as `LLM.chat` does; it renders `tools` and `chat_template_kwargs` too. Streams
open each choice with an assistant-role delta, carry content (or tool-call) deltas, and close
it with its finish reason. Tool calls are read from the output as `tools.py` describes.
`--chat-template` replaces the tokenizer's template (`load_chat_template`).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from shoal.client.api.prompts import TokenizedPrompt, chat_prompt
from shoal.deploy.openai.admission_gate import Caller
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
from shoal.deploy.openai.serving import SSE_DONE, Generation, admit, sse, sse_error, usage_of
from shoal.deploy.openai.state import ServerState
from shoal.deploy.openai.tools import (
    ToolCallStreamer,
    ToolMode,
    finish_reason_of,
    parse_tool_calls,
    tool_mode,
)
from shoal.engine.protocol import SamplingParams
from shoal.engine.tokenizer import Tokenizer


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's contents, or the value itself when it is a Jinja template.

    Raises:
        ValueError: neither a readable file nor a template, or a template that does not parse.
    """
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            raise ValueError(f"cannot read --chat-template {value}: {e.strerror}") from e
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not parse: {e.message} (line {e.lineno})") from e
    return template


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


def template_variables(request: ChatCompletionRequest) -> dict[str, Any]:
    """What a request gives the chat template besides its messages: tools, its own kwargs."""
    variables: dict[str, Any] = {"chat_template_kwargs": request.chat_template_kwargs}
    if request.tools:
        variables["tools"] = [t.model_dump(exclude_none=True) for t in request.tools]
    return variables


def render_chat(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    variables: dict[str, Any] | None = None,
) -> TokenizedPrompt:
    """The prompt of a conversation (`variables`: `template_variables`).

    Raises:
        OpenAIError: no chat template, or the template refused the conversation (400).
    """
    try:
        return chat_prompt(
            tokenizer,
            messages_as_dicts(messages),
            add_generation_prompt=add_generation_prompt,
            **(variables or {}),
        )
    except ValueError as e:
        raise OpenAIError(str(e), param="messages") from e


async def render_chat_off_loop(
    state: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    variables: dict[str, Any] | None = None,
) -> TokenizedPrompt:
    """`render_chat` on the tokenizer pool, after the cheap bound on the messages' length.

    Raises:
        OpenAIError: too long to fit (400), the template refused it (400), or the pool is
            busy (503).
    """
    num_chars = sum(len(str(m.content or "")) for m in messages)
    state.pool.check_text_length(num_chars, state.max_model_len, "messages")
    return await state.pool.run(
        render_chat,
        state.tokenizer,
        messages,
        add_generation_prompt,
        variables,
        size=num_chars + len(str(variables or "")),  # tools render too
    )


async def start_chat(
    state: ServerState,
    request: ChatCompletionRequest,
    session_id: str | None,
    caller: Caller,
) -> tuple[Generation, ToolMode, SamplingParams]:
    """A chat request's generation, admitted by its caller's tenant and started (its first
    output in), how its output turns into tool calls, and its sampling parameters: what
    `/v1/chat/completions` and `/v1/responses` both serve from.

    Raises:
        OpenAIError: a bad request (400), another model (404), the tenant's queue full (429),
            no serving rank or the front end's queues full (503).
    """
    lora = state.check_model(request.model)
    state.limits.check_request(request)
    max_tokens = (
        request.max_completion_tokens
        if request.max_completion_tokens is not None
        else request.max_tokens
    )
    mode = tool_mode(request, state.tool_calls)
    params = sampling_params(
        request,
        max_tokens=max_tokens,
        max_logprobs=state.max_logprobs,
        defaults=state.sampling_defaults,
    )
    await state.grammar_sandbox.check(params.structured_outputs)
    prompt = await render_chat_off_loop(
        state, request.messages, request.add_generation_prompt, template_variables(request)
    )
    generation = Generation(state, prompt, params, session_id, request.priority, lora)
    await admit(state, caller, [generation], params, request.priority)
    await generation.start()
    return generation, mode, params


async def create_chat_completion(
    state: ServerState, request: ChatCompletionRequest, session_id: str | None, caller: Caller
) -> JSONResponse | StreamingResponse:
    generation, mode, params = await start_chat(state, request, session_id, caller)
    num_top = (request.top_logprobs or 0) if request.logprobs else -1
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        events = _stream(state, generation, params.n, num_top, include_usage, mode)
        return StreamingResponse(events, media_type="text/event-stream")
    await generation.run()
    choices = []
    for i, choice in enumerate(generation.choices):
        content, tool_calls = parse_tool_calls(mode, choice.text)
        choices.append(
            ChatChoice(
                index=i,
                message=ChatResponseMessage(content=content, tool_calls=tool_calls),
                logprobs=ChatLogprobs(
                    content=chat_logprobs(state.tokenizer, choice.as_output(i), num_top)
                )
                if num_top >= 0
                else None,
                finish_reason=finish_reason_of(mode, len(tool_calls), choice.finish_reason),
                stop_reason=choice.stop_reason,
            )
        )
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
    mode: ToolMode,
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
        streamers = [ToolCallStreamer(mode) for _ in range(n)]
        async for index, delta in generation.deltas():
            logprobs = (
                ChatLogprobs(content=chat_logprobs(state.tokenizer, delta, num_top))
                if num_top >= 0
                else None
            )
            streamer = streamers[index]
            message = streamer.feed(delta.text, delta.finish_reason is not None)
            is_held = message.content is None and not message.tool_calls and mode.kind != "none"
            if is_held and delta.finish_reason is None and logprobs is None:
                continue  # held back: a tool call may be under way
            yield chunk(
                ChatStreamChoice(
                    index=index,
                    delta=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason_of(mode, streamer.num_calls, delta.finish_reason),
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
