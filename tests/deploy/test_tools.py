"""Tool calls through the official `openai` client, and what `tool_choice` means on a server.

The served tiny model's template renders the tools (Qwen's layout); `required` and a named
choice are enforced by the engine's grammar, so a random model still returns a valid call.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import jsonschema
import openai
import pytest

from shoal.deploy.openai.chat import render_chat, template_variables
from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.protocol import ChatCompletionRequest
from shoal.deploy.openai.server import add_api_server_args, front_end_config
from shoal.deploy.openai.tools import ToolCallConfig, ToolCallStreamer, tool_mode
from shoal.engine.tokenizer import Tokenizer
from tests.deploy.inproc_server import HERMES_TOOLS_TEMPLATE, MODEL_NAME
from tests.factories import make_tokenizer_json

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES: Any = [{"role": "user", "content": "Weather in Paris?"}]


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_required_and_named_choices_return_parsed_calls(
    inproc_client: openai.OpenAI, temperature: float
) -> None:
    named: Any = {"type": "function", "function": {"name": "get_time"}}
    for choice, reason in (("required", "tool_calls"), (named, "stop")):
        response = inproc_client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            temperature=temperature,
            max_tokens=80,
        )
        message = response.choices[0].message
        assert response.choices[0].finish_reason == reason
        assert message.content is None and message.tool_calls and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.type == "function" and call.id
        if choice == named:
            assert call.function.name == "get_time"
        _check_call(call.function.name, call.function.arguments)


@pytest.mark.slow
def test_streamed_calls_accumulate_as_openai_streams_them(inproc_client: openai.OpenAI) -> None:
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        chunks = list(
            inproc_client.chat.completions.create(
                model=MODEL_NAME,
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice=choice,
                parallel_tool_calls=False,
                max_tokens=80,
                stream=True,
            )
        )
        fragments = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
        assert fragments and fragments[0].id and fragments[0].function
        name = fragments[0].function.name
        assert name and all(f.index == 0 for f in fragments)
        arguments = "".join((f.function and f.function.arguments) or "" for f in fragments)
        _check_call(name, arguments)
        assert chunks[-1].choices[0].finish_reason in ("tool_calls", "stop")


@pytest.mark.slow
def test_auto_returns_content_when_the_model_calls_nothing(inproc_client: openai.OpenAI) -> None:
    response = inproc_client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=6, temperature=0.0
    )
    message = response.choices[0].message
    assert not message.tool_calls and message.content is not None
    assert response.choices[0].finish_reason == "length"


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_parses_a_hermes_call_from_the_text(
    inproc_client: openai.OpenAI, stream: bool
) -> None:
    # A regex makes the random model write Qwen's call format, which the hermes parser reads.
    regex = r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"zone": "(utc|cet)"\}\}</tool_call>'
    kwargs: Any = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": 80,
        "extra_body": {"structured_outputs": {"regex": regex}},
    }
    if not stream:
        choice = inproc_client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
        calls = choice.message.tool_calls or []
        assert [c.function.name for c in calls] == ["get_time"]
        _check_call("get_time", calls[0].function.arguments)
        return
    chunks = list(inproc_client.chat.completions.create(stream=True, **kwargs))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    fragments = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert content == "Sure. " and len(fragments) == 1 and fragments[0].function
    assert fragments[0].function.name == "get_time"
    _check_call("get_time", fragments[0].function.arguments or "")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def _request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def test_tool_choice_needs_tools_a_known_name_and_a_parser_for_auto() -> None:
    auto_on = ToolCallConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert tool_mode(_request(), ToolCallConfig()).kind == "none"
    assert tool_mode(_request(tools=TOOLS, tool_choice="none"), ToolCallConfig()).kind == "none"
    # Tools without a choice mean auto, which needs the parser flags (vLLM's 400).
    with pytest.raises(OpenAIError, match="--enable-auto-tool-choice"):
        tool_mode(_request(tools=TOOLS), ToolCallConfig())
    assert tool_mode(_request(tools=TOOLS), auto_on).kind == "auto"
    assert tool_mode(_request(tools=TOOLS, tool_choice="none"), auto_on).kind == "none"
    with pytest.raises(OpenAIError, match="--enable-auto-tool-choice"):
        tool_mode(_request(tools=TOOLS, tool_choice="auto"), ToolCallConfig())
    with pytest.raises(OpenAIError, match="needs tools"):
        tool_mode(_request(tool_choice="required"), auto_on)
    unknown = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(OpenAIError, match="not in tools"):
        tool_mode(_request(tools=TOOLS, tool_choice=unknown), auto_on)
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ToolCallConfig(enable_auto_tool_choice=True)


def test_the_template_renders_tools_and_chat_template_kwargs(tmp_path: Any) -> None:
    backend = make_tokenizer_json(tmp_path)
    template = HERMES_TOOLS_TEMPLATE + "{% if flag %}FLAG{% endif %}"
    tokenizer = Tokenizer(backend, eos_token_ids=(0,), chat_template=template)
    request = _request(tools=TOOLS, chat_template_kwargs={"flag": True})
    prompt = render_chat(tokenizer, request.messages, True, template_variables(request))
    assert prompt.text is not None
    assert '"name": "get_weather"' in prompt.text and prompt.text.endswith("FLAG")
    plain = render_chat(tokenizer, request.messages, True)
    assert plain.text is not None and "get_weather" not in plain.text


def test_auto_streaming_sends_content_before_a_call_and_the_call_at_the_end() -> None:
    auto_on = ToolCallConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    streamer = ToolCallStreamer(tool_mode(_request(tools=TOOLS), auto_on))
    pieces = [
        "Let me ",
        "check. <tool",
        '_call>{"name": "get_time", ',
        '"arguments": {"zone": "utc"}}',
        "</tool_call>",
    ]
    deltas = [streamer.feed(p, finished=False) for p in pieces[:-1]]
    deltas.append(streamer.feed(pieces[-1], finished=True))
    assert "".join(d.content or "" for d in deltas) == "Let me check. "
    calls = deltas[-1].tool_calls
    assert calls and calls[0].function.name == "get_time" and streamer.num_calls == 1
    assert json.loads(calls[0].function.arguments or "") == {"zone": "utc"}


def test_vllm_tool_flags_reach_the_front_end_config() -> None:
    parser = argparse.ArgumentParser()
    add_api_server_args(parser)
    argv = ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    config = front_end_config(parser.parse_args(argv), 8000)
    assert config.tool_calls == ToolCallConfig(True, "llama3_json")
    assert front_end_config(parser.parse_args([]), 8000).tool_calls == ToolCallConfig()
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        front_end_config(parser.parse_args(["--enable-auto-tool-choice"]), 8000)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "nonexistent"])
