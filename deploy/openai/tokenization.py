"""`POST /tokenize` and `POST /detokenize`, with vLLM's bodies: text or a conversation to ids,
and ids back to text, using the served model's tokenizer."""

from __future__ import annotations

from shoal.deploy.openai.chat import render_chat
from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from shoal.deploy.openai.state import ServerState


def tokenize(state: ServerState, request: TokenizeRequest) -> TokenizeResponse:
    """Raises OpenAIError: neither or both of `prompt` and `messages` (400)."""
    state.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise OpenAIError("give exactly one of `prompt` and `messages`", param="prompt")
    if request.messages is not None:
        rendered = render_chat(state.tokenizer, request.messages, request.add_generation_prompt)
        tokens = list(rendered["prompt_token_ids"])
    else:
        assert request.prompt is not None
        tokens = state.tokenizer.encode(
            request.prompt, add_special_tokens=request.add_special_tokens
        )
    return TokenizeResponse(count=len(tokens), max_model_len=state.max_model_len, tokens=tokens)


def detokenize(state: ServerState, request: DetokenizeRequest) -> DetokenizeResponse:
    """Raises OpenAIError: an id outside the vocabulary (400)."""
    state.check_model(request.model)
    vocab_size = state.tokenizer.vocab_size
    bad = [t for t in request.tokens if not 0 <= t < vocab_size]
    if bad:
        raise OpenAIError(
            f"token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}", param="tokens"
        )
    return DetokenizeResponse(prompt=state.tokenizer.decode(request.tokens))
