"""Lenient request bodies: unknown fields and nulls accepted (one warning per name), fields
shoal cannot honour refused each with its own message, SDK defaults served."""

from __future__ import annotations

import logging
from typing import Any

import openai
import pytest

from shoal.deploy.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.deploy.inproc_server import MODEL_NAME

MESSAGES: Any = [{"role": "user", "content": "Hello"}]


def test_unknown_fields_are_dropped_with_one_warning_per_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = {"messages": MESSAGES, "x_unknown_a": 1, "x_unknown_b": None}
    with caplog.at_level(logging.WARNING, logger="shoal.deploy.openai.protocol"):
        for _ in range(3):
            request = ChatCompletionRequest.model_validate(body)
    warned = [r.getMessage() for r in caplog.records if "x_unknown" in r.getMessage()]
    assert sorted(warned) == [
        "ignoring the unknown request field 'x_unknown_a'",
        "ignoring the unknown request field 'x_unknown_b'",
    ]
    assert not hasattr(request, "x_unknown_a")


def test_null_means_the_default_and_nested_bodies_are_lenient_too() -> None:
    request = CompletionRequest.model_validate(
        {
            "prompt": "x",
            "presence_penalty": None,
            "n": None,
            "echo": None,
            "stream_options": {"include_usage": True, "continuous_usage_stats": False},
        }
    )
    assert request.presence_penalty == 0.0 and request.n == 1 and request.echo is False
    assert request.stream_options is not None and request.stream_options.include_usage
    assert request.max_tokens == 16
    # A nullable field keeps its null: max_tokens null is "up to the context".
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).max_tokens is None


@pytest.mark.slow
def test_what_sdks_send_by_default_is_served(inproc_client: openai.OpenAI) -> None:
    response = inproc_client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=3,
        tools=None,  # type: ignore[arg-type]
        tool_choice=None,  # type: ignore[arg-type]
        parallel_tool_calls=True,
        metadata={"trace": "abc"},
        store=False,
        service_tier="auto",
        user="someone",
        response_format={"type": "text"},
        stream_options=None,
        extra_body={
            "chat_template_kwargs": {"enable_thinking": False},
            "some_future_field": {"nested": [1]},
            "guided_decoding_backend": "auto",
        },
    )
    assert response.choices[0].message.content is not None
    assert response.usage is not None and response.usage.completion_tokens == 3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("endpoint", "fields", "message"),
    [
        ("chat", {"logit_bias": {"5": 1.0}}, "logit_bias is not supported"),
        ("chat", {"prompt_logprobs": 1}, "prompt_logprobs is not supported"),
        ("chat", {"functions": [{"name": "f"}]}, "use tools and tool_choice"),
        ("completions", {"echo": True}, "echo is not supported"),
        ("completions", {"suffix": "z"}, "suffix is not supported"),
        ("completions", {"best_of": 3}, "best_of other than n"),
    ],
)
def test_fields_shoal_cannot_honour_are_refused_each_with_its_message(
    inproc_client: openai.OpenAI, endpoint: str, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        if endpoint == "chat":
            inproc_client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, max_tokens=2, extra_body=fields
            )
        else:
            inproc_client.completions.create(
                model=MODEL_NAME, prompt="x", max_tokens=2, extra_body=fields
            )


@pytest.mark.slow
def test_a_prompt_past_the_context_is_the_same_400_from_either_endpoint(
    inproc_client: openai.OpenAI,
) -> None:
    """Checked once, in tokens, before a request is made (this server's context: 1024)."""
    too_long = "maximum context length is 1024 tokens; the request has"
    with pytest.raises(openai.BadRequestError, match=too_long) as ids:
        inproc_client.completions.create(model=MODEL_NAME, prompt=[5] * 1100, max_tokens=2)
    assert ids.value.body["param"] == "prompt"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match=f"{too_long} .* asks for 1100 more") as asks:
        inproc_client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=1100)
    assert asks.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match=too_long):
        inproc_client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hello " * 1100}], max_tokens=2
        )
