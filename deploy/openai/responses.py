"""`POST /v1/responses`: OpenAI's Responses API, served by the chat path.

A request becomes a chat request (`as_chat_request`): `instructions` a system message, `input`
(a string, or a list of messages, `function_call` and `function_call_output` items) the
conversation, `max_output_tokens`, `temperature`, `top_p`, `tools`, `tool_choice`,
`parallel_tool_calls` and `text.format` (a JSON schema or any JSON object) their chat
counterparts. `chat.start_chat` validates, renders, tokenizes and starts it, and tool calls
are read from the output as in chat (`tools.py`): the answer's output holds a `message` item
with the text, and one `function_call` item per call. Streamed, it is OpenAI's event sequence
(`responses_output.py`). The server keeps no responses: `store: true`, `previous_response_id`
and `background` are refused with a 400, so a client sends the whole conversation each time.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from shoal.deploy.openai.admission_gate import Caller
from shoal.deploy.openai.chat import start_chat
from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.protocol import ChatCompletionRequest
from shoal.deploy.openai.responses_output import finish, output_items, stream_response
from shoal.deploy.openai.responses_protocol import ResponseObject, ResponsesRequest, TextConfig
from shoal.deploy.openai.state import ServerState
from shoal.deploy.openai.tools import parse_tool_calls

STATELESS = (
    "this server keeps no responses; send `store: false` (or leave it out) and the whole "
    "conversation as `input`"
)
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def refuse_stateful(request: ResponsesRequest) -> None:
    """Raises OpenAIError (400): a field that needs stored responses or background work."""
    if request.previous_response_id is not None:
        raise OpenAIError(
            f"previous_response_id is not supported: {STATELESS}", param="previous_response_id"
        )
    if request.store:
        raise OpenAIError(f"store is not supported: {STATELESS}", param="store")
    if request.background:
        raise OpenAIError(
            "background is not supported: the response is answered (or streamed) at once",
            param="background",
        )
    if request.truncation == "auto":
        raise OpenAIError(
            "truncation auto is not supported: an input over the context is refused",
            param="truncation",
        )


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError("content must be a string or a list of text parts", param=param)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            raise OpenAIError("only text content parts are supported", param=param)
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = _ROLES.get(item.get("role", ""))
    if role is None:
        raise OpenAIError(f"unknown role {item.get('role')!r}", param=f"{param}.role")
    return {"role": role, "content": _text(item.get("content"), f"{param}.content")}


def _function_call(item: dict[str, Any], param: str) -> dict[str, Any]:
    fields = ("call_id", "name", "arguments")
    if not all(isinstance(item.get(f), str) for f in fields):
        raise OpenAIError("a function_call item needs call_id, name and arguments", param=param)
    function = {"name": item["name"], "arguments": item["arguments"]}
    return {"id": item["call_id"], "type": "function", "function": function}


def chat_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation of `instructions` and `input`, as chat messages.

    Raises:
        OpenAIError: an item shoal cannot read (400, naming it).
    """
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    items: list[dict[str, Any]] = (
        [{"role": "user", "content": request.input}]
        if isinstance(request.input, str)
        else request.input
    )
    for i, item in enumerate(items):
        param = f"input.{i}"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append(_message(item, param))
        elif kind == "function_call":
            call = _function_call(item, param)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": _text(output, f"{param}.output"),
                }
            )
        else:
            raise OpenAIError(f"input items of type {kind!r} are not supported", param=param)
    return messages


def as_chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves `request`.

    Raises:
        OpenAIError: an input shoal cannot read, or an empty conversation (400).
    """
    body: dict[str, Any] = {
        "model": request.model,
        "messages": chat_messages(request),
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "parallel_tool_calls": request.parallel_tool_calls,
        "stream": request.stream,
        "user": request.user,
        "priority": request.priority,
    }
    if request.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
            for t in request.tools
        ]
    choice = request.tool_choice
    if isinstance(choice, str):
        body["tool_choice"] = choice
    elif choice is not None:
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif text_format is not None and text_format.type == "json_schema":
        schema = {"name": text_format.name or "response", "schema": text_format.schema_}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    if not body["messages"]:
        raise OpenAIError("input must not be empty", param="input")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise OpenAIError(f"input cannot be read: {e.errors()[0]['msg']}", param="input") from e


def base_response(state: ServerState, request: ResponsesRequest) -> ResponseObject:
    """The response as it starts: the request's settings, no output yet."""
    return ResponseObject(
        model=state.model_name,
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        tools=request.tools or [],
        tool_choice=request.tool_choice or ("auto" if request.tools else "none"),
        parallel_tool_calls=request.parallel_tool_calls is not False,
        text=request.text or TextConfig(),
        user=request.user,
        metadata=request.metadata or {},
    )


async def create_response(
    state: ServerState, request: ResponsesRequest, session_id: str | None, caller: Caller
) -> JSONResponse | StreamingResponse:
    """Raises OpenAIError: as `start_chat`, or a stateful field (400)."""
    refuse_stateful(request)
    chat = as_chat_request(request)
    generation, mode, _ = await start_chat(state, chat, session_id, caller)
    response = base_response(state, request)
    if request.stream:
        events = stream_response(generation, mode, response)
        return StreamingResponse(events, media_type="text/event-stream")
    await generation.run()
    choice = generation.choices[0]
    content, calls = parse_tool_calls(mode, choice.text)
    finish(
        response,
        generation,
        output_items(content, calls, is_complete=choice.finish_reason != "length"),
    )
    return JSONResponse(response.dump())
