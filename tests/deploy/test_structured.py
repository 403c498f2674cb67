"""Structured outputs through the official `openai` client: every spelling, streamed or not.

The tiny random model follows the engine's grammar mask, so these check enforcement: the
output validates against the schema (`jsonschema`) whatever the model would have written.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from tests.deploy.inproc_server import MODEL_NAME

pytestmark = pytest.mark.slow  # one in-process server for the session (~10 s)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
MESSAGES: Any = [{"role": "user", "content": "The weather, please."}]
RESPONSE_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}


def _chat_text(client: openai.OpenAI, stream: bool, max_tokens: int = 120, **kwargs: Any) -> str:
    """The output of one chat request, which must end by itself (its grammar's end)."""
    if not stream:
        response = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=max_tokens, **kwargs
        )
        assert response.choices[0].finish_reason == "stop"
        return response.choices[0].message.content or ""
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=max_tokens, stream=True, **kwargs
        )
    )
    assert chunks[-1].choices[0].finish_reason == "stop"
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_json_schema_output_validates(
    inproc_client: openai.OpenAI, stream: bool, temperature: float
) -> None:
    text = _chat_text(
        inproc_client, stream, temperature=temperature, response_format=RESPONSE_FORMAT
    )
    jsonschema.validate(json.loads(text), SCHEMA)


def test_vllm_spellings_and_the_completions_endpoint(inproc_client: openai.OpenAI) -> None:
    regex = r"[a-z]{3}-[0-9]{2}"
    text = _chat_text(inproc_client, False, extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, text)
    text = _chat_text(inproc_client, True, extra_body={"guided_choice": ["left", "right"]})
    assert text in ("left", "right")
    text = _chat_text(inproc_client, False, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(text), SCHEMA)
    grammar = 'start: "n=" /[0-9]{2}/'
    text = _chat_text(inproc_client, False, extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"n=[0-9]{2}", text)
    completion = inproc_client.completions.create(
        model=MODEL_NAME,
        prompt="Weather:",
        max_tokens=120,
        temperature=1.0,
        extra_body={"structured_outputs": {"json": SCHEMA}},
    )
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)
    # `text` is no constraint; json_object starts an object.
    text_response = inproc_client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=4, response_format={"type": "text"}
    )
    assert text_response.usage and text_response.usage.completion_tokens >= 1
    chunks = inproc_client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=8,
        response_format={"type": "json_object"},
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)[0] == "{"


def _bad_request(client: openai.OpenAI, **kwargs: Any) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, **kwargs)
    return str(info.value)


def test_a_constraint_that_cannot_compile_is_a_400_for_that_request(
    inproc_client: openai.OpenAI,
) -> None:
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bad"}}}
    assert "does not compile" in _bad_request(inproc_client, response_format=bad_schema)
    assert "regex" in _bad_request(inproc_client, extra_body={"guided_regex": "(("})
    message = _bad_request(
        inproc_client, response_format=RESPONSE_FORMAT, extra_body={"guided_regex": "a"}
    )
    assert "use one" in message
    assert "exactly one" in _bad_request(inproc_client, extra_body={"structured_outputs": {}})
    # The server keeps serving.
    text = _chat_text(inproc_client, False, response_format=RESPONSE_FORMAT)
    jsonschema.validate(json.loads(text), SCHEMA)
