"""Reading tool calls from a model's own text (`tool_choice: auto`), one parser per format.

- `hermes` (Hermes 2/3, Qwen 2/2.5/3): each call is `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; text outside the tags is content.
- `llama3_json` (Llama 3.1/3.2 JSON tool calling): the whole output is one call
  `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`), or several joined
  by `;`; any other output is content.

A parser also says where, in text streamed so far, a call may begin (`hold_from`): content
before that point can be streamed at once, the rest waits until the output ends.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text


class ToolParser(ABC):
    """Finds calls in one finished output."""

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls); content is None when the output was only calls."""

    @abstractmethod
    def hold_from(self, text: str) -> int | None:
        """The offset in a partial output from which a call may be under way, or None."""


def _call_of(item: Any, arguments_key: str) -> ParsedCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get(arguments_key, item.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(item["name"], json.dumps(arguments, ensure_ascii=False))


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        if self.START not in text:
            return text, []
        calls = []
        for match in self._CALL.finditer(text):
            try:
                call = _call_of(json.loads(match.group(1)), "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []  # a malformed call: the text is returned as it is
            calls.append(call)
        content = self._CALL.sub("", text).strip()
        return content or None, calls

    def hold_from(self, text: str) -> int | None:
        index = text.find(self.START)
        if index >= 0:
            return index
        # A tag may be cut between two deltas: hold a suffix that begins it.
        for size in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-size:]):
                return len(text) - size
        return None


class Llama3JsonToolParser(ToolParser):
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                item, end = decoder.raw_decode(body, position)
            except ValueError:
                return text, []
            call = _call_of(item, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            position = end
            rest = body[position:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return text, []
            position = len(body) - len(rest)
        return None, calls

    def hold_from(self, text: str) -> int | None:
        stripped = text.lstrip()
        if not stripped:
            return 0  # only whitespace so far: a call may still follow
        body = stripped.removeprefix(self.PYTHON_TAG).lstrip()
        if body.startswith("{") or self.PYTHON_TAG.startswith(stripped[: len(self.PYTHON_TAG)]):
            return 0
        return None


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
