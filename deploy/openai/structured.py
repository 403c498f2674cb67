"""A request body's output constraint, as the engine's `StructuredOutputsParams`.

Three spellings reach the same constraint: OpenAI's `response_format`, vLLM's
`structured_outputs`, and vLLM's older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`; a chat request whose `tool_choice` is `required` or names a function gets
its constraint from `tools.py`. A body may use one of them. Whether the constraint compiles
is checked before routing, in the front end's sandbox (`grammar_sandbox.py`: a 400 for that
request), and the engine compiles what passed.
"""

from __future__ import annotations

from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    StructuredOutputsRequest,
)
from shoal.deploy.openai.tools import tool_choice_constraint
from shoal.engine.protocol import StructuredOutputsParams


def constraint_of(
    request: CompletionRequest | ChatCompletionRequest,
) -> StructuredOutputsParams | None:
    """The output constraint a body asks for, or None.

    Raises:
        OpenAIError: several spellings at once, or one that is incomplete (400).
    """
    found: list[tuple[str, StructuredOutputsParams]] = []
    if request.response_format is not None:
        params = _from_response_format(request.response_format)
        if params is not None:
            found.append(("response_format", params))
    if request.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured(request.structured_outputs)))
    guided = _from_guided(request)
    if guided is not None:
        found.append(guided)
    if isinstance(request, ChatCompletionRequest):
        tool_constraint = tool_choice_constraint(request)
        if tool_constraint is not None:
            found.append(("tool_choice", tool_constraint))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise OpenAIError(f"{names} constrain the output at once; use one", param=found[1][0])
    return found[0][1] if found else None


def _from_response_format(response_format: ResponseFormat) -> StructuredOutputsParams | None:
    if response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    schema = response_format.json_schema
    if schema is None or schema.schema_ is None:
        raise OpenAIError(
            "response_format of type json_schema needs json_schema.schema",
            param="response_format",
        )
    return StructuredOutputsParams(json=schema.schema_)


def _from_structured(body: StructuredOutputsRequest) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(
            json=body.json_,
            regex=body.regex,
            choice=body.choice,
            grammar=body.grammar,
            json_object=bool(body.json_object),
            whitespace_flexible=body.disable_any_whitespace is False,
        )
    except ValueError as e:
        raise OpenAIError(str(e), param="structured_outputs") from e


def _from_guided(
    request: CompletionRequest | ChatCompletionRequest,
) -> tuple[str, StructuredOutputsParams] | None:
    fields = {
        "guided_json": request.guided_json,
        "guided_regex": request.guided_regex,
        "guided_choice": request.guided_choice,
        "guided_grammar": request.guided_grammar,
    }
    given = [name for name, value in fields.items() if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise OpenAIError(f"{' and '.join(given)} given at once; use one", param=given[1])
    try:
        params = StructuredOutputsParams(
            json=request.guided_json,
            regex=request.guided_regex,
            choice=request.guided_choice,
            grammar=request.guided_grammar,
        )
    except ValueError as e:
        raise OpenAIError(str(e), param=given[0]) from e
    return given[0], params
