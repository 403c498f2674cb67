"""`POST /tokenize` and `POST /detokenize`, with vLLM's bodies: text or a conversation to ids,
and ids back to text, using the served model's tokenizer.

All the work, the JSON of a long answer included, runs on the tokenizer pool, off the event
loop; the ids are written to JSON in slices, so the thread yields the GIL between them.
"""

from __future__ import annotations

import json

from fastapi import Response

from shoal.deploy.openai.chat import render_chat_off_loop
from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
)
from shoal.deploy.openai.state import ServerState
from shoal.engine.tokenizer import Tokenizer

# Ids written to JSON per slice (a few milliseconds each).
_JSON_SLICE = 65536


async def tokenize(state: ServerState, request: TokenizeRequest) -> Response:
    """The `TokenizeResponse` as JSON.

    Raises:
        OpenAIError: neither or both of `prompt` and `messages`, a template error (400); the
            pool busy (503).
    """
    state.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise OpenAIError("give exactly one of `prompt` and `messages`", param="prompt")
    if request.messages is not None:
        rendered = await render_chat_off_loop(
            state, request.messages, request.add_generation_prompt
        )
        tokens = list(rendered.token_ids)
        body = await state.pool.run(_tokenize_json, tokens, state.max_model_len, size=len(tokens))
    else:
        assert request.prompt is not None
        body = await state.pool.run(
            _encode_json,
            state.tokenizer,
            request.prompt,
            request.add_special_tokens,
            state.max_model_len,
            size=len(request.prompt),
        )
    return Response(body, media_type="application/json")


async def detokenize(state: ServerState, request: DetokenizeRequest) -> DetokenizeResponse:
    """Raises OpenAIError: an id outside the vocabulary (400); the pool busy (503)."""
    state.check_model(request.model)
    vocab_size = state.tokenizer.vocab_size
    bad = [t for t in request.tokens if not 0 <= t < vocab_size]
    if bad:
        raise OpenAIError(
            f"token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}", param="tokens"
        )
    text = await state.pool.run(state.tokenizer.decode, request.tokens, size=len(request.tokens))
    return DetokenizeResponse(prompt=text)


def _encode_json(
    tokenizer: Tokenizer, text: str, add_special_tokens: bool, max_model_len: int | None
) -> bytes:
    tokens = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return _tokenize_json(tokens, max_model_len)


def _tokenize_json(tokens: list[int], max_model_len: int | None) -> bytes:
    """`TokenizeResponse(count, max_model_len, tokens)` as JSON, written in slices."""
    slices = (
        json.dumps(tokens[i : i + _JSON_SLICE])[1:-1] for i in range(0, len(tokens), _JSON_SLICE)
    )
    ids = ",".join(slices)
    head = json.dumps({"count": len(tokens), "max_model_len": max_model_len})[:-1]
    return f'{head}, "tokens": [{ids}]}}'.encode()
