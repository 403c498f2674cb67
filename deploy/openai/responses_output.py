"""A response's output, whole or streamed as the events of OpenAI's Responses API.

Whole: the text is one `message` item (its one `output_text` part), each tool call a
`function_call` item, after it. Streamed, the events are, in order (each with its
`sequence_number`):

    response.created, response.in_progress          the response, in_progress, no output
    per text: response.output_item.added (message), response.content_part.added,
              response.output_text.delta ..., response.output_text.done,
              response.content_part.done, response.output_item.done
    per call: response.output_item.added (function_call),
              response.function_call_arguments.delta ..., .done, response.output_item.done
    response.completed (or response.incomplete: max_output_tokens reached)

Text streams as it is generated; calls stream as chat streams them (`tools.ToolCallStreamer`:
a named call's arguments as generated, other calls whole at the end). An item is opened at its
first fragment and closed when the output ends (the message before any call that follows
it). A failure after the first event is an `error` event, then `response.failed`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from shoal.deploy.openai.errors import from_exception
from shoal.deploy.openai.protocol import DeltaMessage, DeltaToolCall, ToolCall
from shoal.deploy.openai.responses_protocol import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseUsage,
)
from shoal.deploy.openai.serving import Generation
from shoal.deploy.openai.tools import ToolCallStreamer, ToolMode


def output_items(
    content: str | None, calls: list[ToolCall], *, is_complete: bool
) -> list[OutputItem]:
    """A finished output as Responses items: the text's message, then one item per call."""
    status: Literal["completed", "incomplete"] = "completed" if is_complete else "incomplete"
    items: list[OutputItem] = []
    if content:
        items.append(OutputMessage(status=status, content=[OutputText(text=content)]))
    for call in calls:
        function = call.function
        items.append(
            FunctionCallItem(call_id=call.id, name=function.name, arguments=function.arguments)
        )
    return items


def finish(response: ResponseObject, generation: Generation, output: list[OutputItem]) -> None:
    """Completes `response` with its output, status and usage."""
    choice = generation.choices[0]
    is_complete = choice.finish_reason != "length"
    response.status = "completed" if is_complete else "incomplete"
    if not is_complete:
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
    response.output = output
    num_input, num_output = generation.num_prompt_tokens, generation.num_completion_tokens
    response.usage = ResponseUsage(
        input_tokens=num_input,
        input_tokens_details=InputTokensDetails(cached_tokens=generation.num_cached_tokens),
        output_tokens=num_output,
        total_tokens=num_input + num_output,
    )


class _Events:
    """Numbers events and writes each as one server-sent event."""

    def __init__(self) -> None:
        self._sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"


class _StreamedItems:
    """The output items of one streamed response, opened and closed as fragments arrive."""

    def __init__(self, events: _Events) -> None:
        self.items: list[OutputItem] = []
        self._event = events
        self._message: OutputMessage | None = None  # open, taking text
        self._calls: dict[int, FunctionCallItem] = {}  # open, by the chat delta's call index

    def feed(self, delta: DeltaMessage) -> list[str]:
        """The events of one chat delta (`ToolCallStreamer.feed`)."""
        events = self._text(delta.content) if delta.content else []
        for fragment in delta.tool_calls or ():
            events += self._call(fragment)
        return events

    def close(self, status: str) -> list[str]:
        """The events that close every open item, in output order."""
        events = self._close_message(status)
        for call in self._calls.values():
            call.status = status  # type: ignore[assignment]
            index = self.items.index(call)
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=call.id,
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                )
            )
            events.append(self._done(call))
        self._calls = {}
        return events

    def _text(self, text: str) -> list[str]:
        events: list[str] = []
        message = self._message
        if message is None:
            message = self._message = self._add(OutputMessage(status="in_progress"), events)
            message.content.append(OutputText(text=""))
            events.append(self._part_event("response.content_part.added", message))
        message.content[0].text += text
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=message.id,
                output_index=self.items.index(message),
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _call(self, fragment: DeltaToolCall) -> list[str]:
        events: list[str] = []
        call = self._calls.get(fragment.index)
        if call is None:  # a call's first fragment: its id and name
            events += self._close_message("completed")
            assert fragment.id is not None and fragment.function.name is not None
            item = FunctionCallItem(call_id=fragment.id, name=fragment.function.name)
            call = self._calls[fragment.index] = self._add(item, events, status="in_progress")
        arguments = fragment.function.arguments or ""
        if arguments:
            call.arguments += arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=call.id,
                    output_index=self.items.index(call),
                    delta=arguments,
                )
            )
        return events

    def _close_message(self, status: str) -> list[str]:
        message, self._message = self._message, None
        if message is None:
            return []
        message.status = status  # type: ignore[assignment]
        part = message.content[0]
        index = self.items.index(message)
        return [
            self._event(
                "response.output_text.done",
                item_id=message.id,
                output_index=index,
                content_index=0,
                text=part.text,
                logprobs=[],
            ),
            self._part_event("response.content_part.done", message),
            self._done(message),
        ]

    def _add(self, item: Any, events: list[str], status: str = "in_progress") -> Any:
        item.status = status
        self.items.append(item)
        added = self._event(
            "response.output_item.added", output_index=len(self.items) - 1, item=item.model_dump()
        )
        events.append(added)
        return item

    def _part_event(self, kind: str, message: OutputMessage) -> str:
        return self._event(
            kind,
            item_id=message.id,
            output_index=self.items.index(message),
            content_index=0,
            part=message.content[0].model_dump(),
        )

    def _done(self, item: OutputItem) -> str:
        return self._event(
            "response.output_item.done", output_index=self.items.index(item), item=item.model_dump()
        )


async def stream_response(
    generation: Generation, mode: ToolMode, response: ResponseObject
) -> AsyncIterator[str]:
    """The events of `response` as `generation` produces it (see the module docstring)."""
    event = _Events()
    yield event("response.created", response=response.dump())
    yield event("response.in_progress", response=response.dump())
    items = _StreamedItems(event)
    streamer = ToolCallStreamer(mode)
    try:
        async for _, delta in generation.deltas():
            for text in items.feed(streamer.feed(delta.text, delta.finish_reason is not None)):
                yield text
        choice = generation.choices[0]
        for text in items.close("completed" if choice.finish_reason != "length" else "incomplete"):
            yield text
        finish(response, generation, items.items)
    except Exception as e:  # headers are sent: the error travels as events
        error = from_exception(e)
        code = str(error.code or int(error.status))
        yield event("error", code=code, message=error.message, param=error.param)
        response.status = "failed"
        response.error = {"code": "server_error", "message": error.message}
        yield event("response.failed", response=response.dump())
        return
    kind = "response.completed" if response.status == "completed" else "response.incomplete"
    yield event(kind, response=response.dump())
