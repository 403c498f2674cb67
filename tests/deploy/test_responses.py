"""`/v1/responses` through the official `openai` client: text (the chat path's own tokens),
structured output, tool calls, streamed as the SDK's event parser and stream helper accept
them; the stateless refusals; and `tools` without the parser flags (vLLM's 400)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.responses import as_chat_request, chat_messages
from shoal.deploy.openai.responses_protocol import ResponsesRequest
from tests.deploy.inproc_server import MODEL_NAME, serving_in_process
from tests.deploy.test_tools import SCHEMAS, TOOLS
from tests.factories import make_tiny_checkpoint

ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
JSON_FORMAT: Any = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}}
# The Responses API's flat function tools, the same as test_tools' chat tools.
FLAT_TOOLS: Any = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def plain_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """A server without --enable-auto-tool-choice or a parser."""
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("plain"))
    with serving_in_process(checkpoint) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
def test_text_is_what_the_chat_path_generates(plain_client: openai.OpenAI) -> None:
    settings: Any = {"model": MODEL_NAME, "temperature": 0.0}
    response = plain_client.responses.create(
        **settings, instructions="Be brief.", input="Say hello", max_output_tokens=12
    )
    chat = plain_client.chat.completions.create(
        **settings,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hello"},
        ],
        max_completion_tokens=12,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == (chat.choices[0].message.content or "")
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    is_cut = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if is_cut else "completed")
    if is_cut:
        assert (
            response.incomplete_details
            and response.incomplete_details.reason == "max_output_tokens"
        )


@pytest.mark.slow
def test_a_stream_is_openais_event_sequence(plain_client: openai.OpenAI) -> None:
    settings: Any = {
        "model": MODEL_NAME,
        "input": "Is it?",
        "temperature": 0.0,
        "text": JSON_FORMAT,
    }
    whole = plain_client.responses.create(**settings)
    events = list(plain_client.responses.create(**settings, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text and json.loads(text)["answer"] in ("yes", "no")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.status == "completed"
    with plain_client.responses.stream(**settings) as stream:  # the SDK's accumulating helper
        assert stream.get_final_response().output_text == text


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_tool_choices_return_function_calls(
    inproc_client: openai.OpenAI, stream: bool
) -> None:
    for choice in ("required", {"type": "function", "name": "get_time"}):
        settings: Any = {
            "model": MODEL_NAME,
            "input": [{"role": "user", "content": "What time is it?"}],
            "tools": FLAT_TOOLS,
            "tool_choice": choice,
            "parallel_tool_calls": False,
            "max_output_tokens": 80,
        }
        if stream:
            with inproc_client.responses.stream(**settings) as events:
                response = events.get_final_response()
        else:
            response = inproc_client.responses.create(**settings)
        calls = [item for item in response.output if item.type == "function_call"]
        assert len(calls) == 1 and calls[0].call_id and calls[0].status == "completed"
        if choice != "required":
            assert calls[0].name == "get_time"
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])


@pytest.mark.slow
def test_a_conversation_with_calls_and_their_outputs_is_served(
    inproc_client: openai.OpenAI,
) -> None:
    response = inproc_client.responses.create(
        model=MODEL_NAME,
        input=[
            {"role": "user", "content": "Time in UTC?"},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_time",
                "arguments": '{"zone": "utc"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
        ],
        tools=FLAT_TOOLS,
        tool_choice="none",
        max_output_tokens=4,
    )
    assert response.status in ("completed", "incomplete")


def test_input_items_become_the_chat_conversation() -> None:
    request = ResponsesRequest.model_validate(
        {
            "instructions": "Be brief.",
            "input": [
                {"type": "message", "role": "developer", "content": "Use tools."},
                {"role": "user", "content": [{"type": "input_text", "text": "Time?"}]},
                {"type": "function_call", "call_id": "a", "name": "get_time", "arguments": "{}"},
                {"type": "function_call", "call_id": "b", "name": "get_time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "a", "output": "12:00"},
            ],
        }
    )
    calls = [
        {"id": i, "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
        for i in ("a", "b")
    ]
    assert chat_messages(request) == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "a", "content": "12:00"},
    ]
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
    with pytest.raises(OpenAIError, match="only text content"):
        chat_messages(ResponsesRequest.model_validate({"input": image}))
    with pytest.raises(OpenAIError, match="'reasoning' are not supported"):
        chat_messages(ResponsesRequest.model_validate({"input": [{"type": "reasoning"}]}))


@pytest.mark.slow
def test_priority_reaches_the_chat_request_that_serves_it() -> None:
    """Admission and the engines read the chat request's priority (tests/deploy/
    test_tenant_admission.py: a priority request overtakes queued ones of its tenant)."""
    assert as_chat_request(ResponsesRequest(input="hi", priority=-3)).priority == -3
    assert as_chat_request(ResponsesRequest(input="hi")).priority == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"store": True}, "keeps no responses"),
        ({"previous_response_id": "resp_1"}, "keeps no responses"),
        ({"background": True}, "background is not supported"),
        ({"tools": FLAT_TOOLS}, "--enable-auto-tool-choice and --tool-call-parser"),
        ({"input": []}, "input must not be empty"),
    ],
)
def test_what_shoal_cannot_honour_is_a_400(
    plain_client: openai.OpenAI, fields: dict[str, Any], message: str
) -> None:
    settings: Any = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError, match=message):
        plain_client.responses.create(**settings)


@pytest.mark.slow
def test_chat_tools_without_a_choice_mean_auto_which_needs_the_parser_flags(
    plain_client: openai.OpenAI,
) -> None:
    messages: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        plain_client.chat.completions.create(
            model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=2
        )
    served = plain_client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    assert served.choices[0].message.tool_calls in (None, [])
