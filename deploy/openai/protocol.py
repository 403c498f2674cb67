"""Typed bodies of the OpenAI API as shoal serves it: requests validated on arrival, responses.

Field names and defaults follow OpenAI's API, plus vLLM's extra sampling parameters (`top_k`,
`min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, ...), sent by the `openai` client
as `extra_body`. As in vLLM, an unknown field of a completions or chat body is dropped with one
warning per field name (SDKs send fields of their own), and `null` for a field means its
default; fields whose meaning shoal cannot honour are refused in `sampling.py`, each with its
own message. Range checks live in `SamplingParams`; `sampling.py` turns these bodies into one.
"""

from __future__ import annotations

import logging
import time
import types
import typing
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger(__name__)


class _Body(BaseModel):
    # strict: JSON types are kept (`"stream": "yes"` or `"n": "2"` is a 400, not coerced).
    model_config = ConfigDict(extra="forbid", strict=True)


# Unknown field names already warned about, once per process.
_warned_fields: set[str] = set()


def _admits_none(annotation: Any) -> bool:
    if annotation is Any or annotation is None:
        return True
    origin = typing.get_origin(annotation)
    return origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(annotation)


class _LenientBody(BaseModel):
    """A request body that drops unknown fields (one warning per name) and reads `null` as
    the default of a field that cannot be null."""

    model_config = ConfigDict(extra="ignore", strict=True)  # strict: as `_Body`

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown_and_null(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = {f.alias or name: f for name, f in cls.model_fields.items()}
        kept = {}
        for name, value in data.items():
            field = fields.get(name)
            if field is None:
                if name not in _warned_fields:
                    _warned_fields.add(name)
                    logger.warning("ignoring the unknown request field %r", name)
                continue
            if value is None and not _admits_none(field.annotation):
                continue
            kept[name] = value
        return kept


# The base of bodies defined beside their endpoints (`embeddings`, `responses`).
LenientBody = _LenientBody


class StreamOptions(_LenientBody):
    include_usage: bool = False


class StructuredOutputsRequest(_LenientBody):
    """vLLM's `structured_outputs` body: exactly one of its constraint kinds."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # vLLM's name: True keeps JSON compact


class JsonSchemaFormat(_LenientBody):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_LenientBody):
    """OpenAI's `response_format`: free text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_LenientBody):
    """The sampling parameters completions and chat share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # The caller's end-user id; it keeps the user's requests on one rank (session affinity)
    # unless an X-Session-ID header names another session.
    user: str | None = None
    # vLLM's request priority, lower first: orders its tenant's admission queue, and the
    # engines' waiting requests under `--scheduling-policy priority`.
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    # Accepted with their neutral values only (clients send them by default).
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None
    # Accepted and not acted on: they carry no meaning for the generation.
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Structured outputs (`structured.py`): OpenAI's, vLLM's, and vLLM's older spellings.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # one backend here: accepted, not acted on


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    # name, tool fields: passed to the template; strict: as `_Body`
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(_LenientBody):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(_LenientBody):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_LenientBody):
    name: str


class NamedToolChoice(_LenientBody):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # Tool calls (`tools.py`): the template renders `tools`; `required` and a named choice
    # are enforced by a grammar, `auto` is parsed from the text by the server's parser.
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    functions: list[dict[str, Any]] | None = None  # OpenAI's deprecated form: refused
    function_call: str | dict[str, Any] | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class ScaleElasticEPRequest(_Body):
    """`POST /scale_elastic_ep`: the size to resize the cluster to (a JSON integer: `true` or
    `"3"` are refused, not read as 1 or 3)."""

    new_data_parallel_size: int = Field(strict=True)
    switch_timeout_s: float | None = Field(default=None, gt=0)


# --- responses ----------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # the arguments object as JSON text


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: _id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed tool call's fragment: the first of a call has its id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "shoal"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ScaleElasticEPResponse(BaseModel):
    """A resize's report (`shoal.cluster.elastic.ScaleReport`), with a one-line message."""

    message: str
    epoch: int
    from_size: int
    to_size: int
    outcome: Literal["committed", "unchanged"]
    phases: dict[str, float] = Field(default_factory=dict)
    total_s: float


class IsScalingElasticEPResponse(BaseModel):
    is_scaling_elastic_ep: bool
