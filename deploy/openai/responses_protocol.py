"""The bodies of OpenAI's Responses API as shoal serves it (`responses.py`): the request, its
output items, and the response object, named as OpenAI names them.

Tools are function tools (OpenAI's flat shape: `{"type": "function", "name", "parameters"}`);
`text.format` is `text`, `json_object` or `json_schema`. Input items are kept as JSON objects
here and read (with a 400 for what shoal cannot read) as they become chat messages.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from shoal.deploy.openai.protocol import LenientBody


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class FunctionTool(LenientBody):
    type: Literal["function"] = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class NamedFunctionChoice(LenientBody):
    type: Literal["function"] = "function"
    name: str


class TextFormat(LenientBody):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(LenientBody):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(LenientBody):
    """`POST /v1/responses`. Stateless: `store` and `previous_response_id` are refused."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, Any] | None = None  # echoed, not acted on
    # vLLM's request priority, lower first, as on chat and completions.
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    # Refused unless neutral (`responses.refuse_stateful`).
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: new_id("msg"))
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: new_id("fc"))
    call_id: str
    name: str
    arguments: str = ""  # the arguments object as JSON text
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """The response: in_progress while it streams, then completed or incomplete."""

    id: str = Field(default_factory=lambda: new_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: str | NamedFunctionChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    store: bool = False
    previous_response_id: None = None
    reasoning: None = None
    truncation: Literal["disabled"] = "disabled"

    def dump(self) -> dict[str, Any]:
        body = self.model_dump(by_alias=True)
        body["text"] = {"format": self.text.format.model_dump(by_alias=True, exclude_none=True)}
        return body
