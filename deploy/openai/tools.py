"""Tool calls in chat: what `tool_choice` asks of the output, and the calls read back from it.

- `none`: the template still renders `tools`; the output is plain content.
- a named function: the output is constrained to that function's arguments object (its
  `parameters` schema), and becomes one call to it.
- `required`: the output is constrained to a JSON array of `{"name", "parameters"}` objects
  (one item when `parallel_tool_calls` is false), each a call.
- `auto` (the default whenever `tools` are given, as in OpenAI's API and vLLM's): the model
  writes calls in its own format, which the server's `--tool-call-parser` finds in the text
  (`tool_parsers.py`); any other text is content. A server started without
  `--enable-auto-tool-choice` and a parser answers `auto` with a 400, as vLLM does, rather
  than returning calls as plain text.
"""

from __future__ import annotations

import argparse
import json
import uuid
from dataclasses import dataclass
from typing import Any

from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from shoal.deploy.openai.tool_parsers import TOOL_PARSERS, ParsedCall, ToolParser
from shoal.engine.protocol import StructuredOutputsParams


@dataclass(frozen=True)
class ToolCallConfig:
    """The server's tool-call settings (vLLM's flags of the same names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            names = ", ".join(sorted(TOOL_PARSERS))
            raise ValueError(f"unknown --tool-call-parser {self.tool_call_parser!r}; use {names}")


def add_tool_args(parser: argparse._ActionsContainer) -> None:
    """--enable-auto-tool-choice and --tool-call-parser."""
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let the model decide when to call tools (tool_choice auto, the default with tools);"
        " needs --tool-call-parser",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how tool calls are read from the model's text: hermes (Hermes, Qwen: "
        "<tool_call>{...}</tool_call>) or llama3_json (Llama 3: a JSON object) (default: none)",
    )


def tool_config_from_args(args: argparse.Namespace) -> ToolCallConfig:
    """Raises ValueError: --enable-auto-tool-choice without --tool-call-parser."""
    return ToolCallConfig(
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
    )


@dataclass(frozen=True)
class ToolMode:
    """How one request's output turns into tool calls."""

    kind: str  # "none", "named", "required" or "auto"
    function_name: str | None = None  # for "named"
    parser: ToolParser | None = None  # for "auto"


def tool_mode(request: ChatCompletionRequest, config: ToolCallConfig) -> ToolMode:
    """What the request's `tool_choice` means on this server.

    Raises:
        OpenAIError: a choice that needs tools, a function not among them, or `auto` on a
            server without a parser (400).
    """
    choice = request.tool_choice
    tools = request.tools or []
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolMode("none")
    if not tools:
        raise OpenAIError("tool_choice needs tools", param="tool_choice")
    if choice == "required":
        return ToolMode("required")
    if choice == "auto":
        if not config.enable_auto_tool_choice or config.tool_call_parser is None:
            raise OpenAIError(
                'tool_choice "auto" (the default when tools are given) needs a server started '
                "with --enable-auto-tool-choice and --tool-call-parser; without them, send "
                'tool_choice "none", "required" or a named function',
                param="tool_choice",
            )
        return ToolMode("auto", parser=TOOL_PARSERS[config.tool_call_parser]())
    assert not isinstance(choice, str), f"unexpected tool_choice {choice!r}"
    name = choice.function.name
    if name not in {t.function.name for t in tools}:
        raise OpenAIError(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
    return ToolMode("named", function_name=name)


def tool_choice_constraint(request: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The grammar that enforces a `required` or named `tool_choice`, else None."""
    choice = request.tool_choice
    tools = request.tools or []
    if not tools or choice is None or (isinstance(choice, str) and choice != "required"):
        return None
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "parameters": _parameters_schema(t.function.parameters),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if request.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)
    assert not isinstance(choice, str)
    tool = next((t for t in tools if t.function.name == choice.function.name), None)
    if tool is None:
        return None  # `tool_mode` refuses it with its message
    return StructuredOutputsParams(json=_parameters_schema(tool.function.parameters))


def _parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters if parameters else {"type": "object", "properties": {}}


def parse_tool_calls(mode: ToolMode, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output under `mode`.

    An output that does not hold calls in the expected form (cut short by max_tokens, say)
    stays content, with no calls.
    """
    if mode.kind == "none":
        return text, []
    if mode.kind == "named":
        assert mode.function_name is not None
        return _calls_or_content(text, [ParsedCall(mode.function_name, text)])
    if mode.kind == "required":
        return _calls_or_content(text, _required_calls(text))
    assert mode.parser is not None
    content, parsed = mode.parser.parse(text)
    if not parsed:
        return text, []
    return content, [_tool_call(call) for call in parsed]


def _required_calls(text: str) -> list[ParsedCall] | None:
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
        calls.append(ParsedCall(item["name"], arguments))
    return calls


def _calls_or_content(
    text: str, calls: list[ParsedCall] | None
) -> tuple[str | None, list[ToolCall]]:
    if not calls or not all(_is_json_object(c.arguments) for c in calls):
        return text, []
    return None, [_tool_call(c) for c in calls]


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(function=FunctionCall(name=call.name, arguments=call.arguments))


def finish_reason_of(mode: ToolMode, num_calls: int, reason: str | None) -> str | None:
    """OpenAI's finish reason: `tool_calls` when the model called tools (a named choice keeps
    `stop`, as OpenAI's does)."""
    if reason == "stop" and num_calls and mode.kind != "named":
        return "tool_calls"
    return reason


class ToolCallStreamer:
    """One streamed choice's deltas under a tool mode, as OpenAI streams them.

    A named call streams its arguments as they are generated (the first fragment carries the
    call's id and name); `required` calls, and calls found by the parser under `auto`, are sent
    when the output ends, each as one fragment with its whole arguments. Under `auto`, text
    before a possible call streams as content at once.
    """

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.num_calls = 0
        self._text = ""
        self._num_sent = 0  # characters of _text already sent as content

    def feed(self, text: str, finished: bool) -> DeltaMessage:
        """The delta to send for `text`, new output of this choice."""
        self._text += text
        kind = self.mode.kind
        if kind == "none":
            return DeltaMessage(content=text)
        if kind == "named":
            return self._named_fragment(text)
        if not finished:
            if kind == "required" or self.mode.parser is None:
                return DeltaMessage()
            hold = self.mode.parser.hold_from(self._text)
            return self._content_until(len(self._text) if hold is None else hold)
        _, calls = parse_tool_calls(self.mode, self._text)
        if not calls:
            return self._content_until(len(self._text))
        self.num_calls = len(calls)
        return DeltaMessage(
            tool_calls=[
                DeltaToolCall(
                    index=i,
                    id=call.id,
                    type="function",
                    function=DeltaFunctionCall(
                        name=call.function.name, arguments=call.function.arguments
                    ),
                )
                for i, call in enumerate(calls)
            ]
        )

    def _content_until(self, end: int) -> DeltaMessage:
        content = self._text[self._num_sent : end] if end > self._num_sent else ""
        self._num_sent = max(self._num_sent, end)
        return DeltaMessage(content=content or None)

    def _named_fragment(self, text: str) -> DeltaMessage:
        if self.num_calls:
            if not text:
                return DeltaMessage()
            return DeltaMessage(
                tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))]
            )
        self.num_calls = 1
        first = DeltaToolCall(
            index=0,
            id=f"call-{uuid.uuid4().hex}",
            type="function",
            function=DeltaFunctionCall(name=self.mode.function_name, arguments=text),
        )
        return DeltaMessage(tool_calls=[first])
