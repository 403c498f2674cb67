"""From an OpenAI request body to `SamplingParams`, and from engine logprobs to OpenAI's shapes.

Parameters shoal does not have (a non-empty `logit_bias`, `best_of` other than `n`, `echo`,
`suffix`, `prompt_logprobs`, the deprecated `functions`) are refused with a 400 naming them,
each with its own message, rather than ignored. The output constraint comes from
`structured.py`.
"""

from __future__ import annotations

from typing import Any

from shoal.client.api.outputs import CompletionOutput, Logprob
from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.protocol import (
    ChatCompletionRequest,
    CompletionLogprobs,
    CompletionRequest,
    TokenLogprob,
    TopLogprob,
)
from shoal.deploy.openai.structured import constraint_of
from shoal.engine.protocol import RequestOutputKind, SamplingParams
from shoal.engine.tokenizer import Tokenizer

# A request may ask for at most this many top logprobs per position (OpenAI's limit is 20),
# unless the engines' `--max-logprobs` says otherwise (`ServerState.max_logprobs`).
MAX_LOGPROBS = 20


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int | None,
    max_logprobs: int = MAX_LOGPROBS,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """The engine's `SamplingParams` for a request body, with `defaults` (the front end's
    `--generation-config`, `generation_config.py`) where the body is silent or null.

    Raises:
        OpenAIError: a parameter out of range or not supported (400, naming it).
    """
    _refuse_unsupported(request)
    logprobs: int | None
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        param = "top_logprobs"
    else:
        logprobs = request.logprobs
        param = "logprobs"
    if logprobs is not None and not 0 <= logprobs <= max_logprobs:
        raise OpenAIError(f"{param} must be in [0, {max_logprobs}], got {logprobs}", param=param)
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    kwargs: dict[str, Any] = {
        "n": request.n,
        "max_tokens": max_tokens,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "top_k": request.top_k or 0,
        "min_p": request.min_p or 0.0,
        "seed": request.seed,
        "stop": stop,
        "stop_token_ids": list(request.stop_token_ids or []),
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "ignore_eos": request.ignore_eos,
        "min_tokens": request.min_tokens,
        "logprobs": logprobs,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "skip_special_tokens": request.skip_special_tokens,
        "output_kind": RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
        "structured_outputs": constraint_of(request),
    }
    for name, value in (defaults or {}).items():
        if name == "max_tokens":  # chat's max_completion_tokens or max_tokens, resolved
            is_silent = max_tokens is None
        else:
            is_silent = name not in request.model_fields_set or getattr(request, name) is None
        if is_silent:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        message = str(e)
        name = message.split(" ", 1)[0]
        raise OpenAIError(message, param=name if name in kwargs else None) from e


def _refuse_unsupported(request: CompletionRequest | ChatCompletionRequest) -> None:
    if request.logit_bias:
        raise OpenAIError("logit_bias is not supported", param="logit_bias")
    if request.best_of is not None and request.best_of != request.n:
        raise OpenAIError("best_of other than n is not supported", param="best_of")
    if request.prompt_logprobs is not None:
        raise OpenAIError(
            "prompt_logprobs is not supported: logprobs cover generated tokens only",
            param="prompt_logprobs",
        )
    if isinstance(request, ChatCompletionRequest) and (
        request.functions is not None or request.function_call is not None
    ):
        raise OpenAIError(
            "functions and function_call are not supported; use tools and tool_choice",
            param="functions" if request.functions is not None else "function_call",
        )
    if isinstance(request, CompletionRequest):
        if request.echo:
            raise OpenAIError("echo is not supported", param="echo")
        if request.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")


def _top(position: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The `num_top` likeliest candidates at one position, likeliest first."""
    ranked = [(t, lp) for t, lp in position.items() if lp.rank is not None and lp.rank <= num_top]
    return sorted(ranked, key=lambda kv: kv[1].rank or 0)


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer, output: CompletionOutput, num_top: int, text_offset: int
) -> CompletionLogprobs:
    """The legacy completions shape: parallel lists of tokens, logprobs, top-n dicts, offsets."""
    result = CompletionLogprobs()
    offset = text_offset
    for token_id, position in zip(output.token_ids, output.logprobs or [], strict=False):
        text = _token_text(tokenizer, token_id)
        result.tokens.append(text)
        result.token_logprobs.append(position[token_id].logprob if token_id in position else None)
        top = _top(position, num_top)
        result.top_logprobs.append(
            {_token_text(tokenizer, t): lp.logprob for t, lp in top} if num_top else None
        )
        result.text_offset.append(offset)
        offset += len(text)
    return result


def chat_logprobs(
    tokenizer: Tokenizer, output: CompletionOutput, num_top: int
) -> list[TokenLogprob]:
    """The chat shape: one entry per generated token, each with its top-n alternatives."""
    entries = []
    for token_id, position in zip(output.token_ids, output.logprobs or [], strict=False):
        text = _token_text(tokenizer, token_id)
        top = _top(position, num_top)
        entries.append(
            TokenLogprob(
                token=text,
                logprob=position[token_id].logprob if token_id in position else float("-inf"),
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=(t_text := _token_text(tokenizer, t)),
                        logprob=lp.logprob,
                        bytes=list(t_text.encode()),
                    )
                    for t, lp in top
                ],
            )
        )
    return entries
