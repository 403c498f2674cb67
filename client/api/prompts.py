"""Prompt forms users pass (text, token ids, vLLM prompt dicts) and the one form they become.

Whatever a caller passes, `tokenize_prompt` turns it into a `TokenizedPrompt` (token ids, and
the text when known), once; a `TokenizedPrompt` passed in (the HTTP front end tokenizes off its
event loop, a chat is rendered and tokenized together) is taken as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from shoal.engine.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    """A prompt as the engines take it: its token ids, and its text when known."""

    token_ids: list[int]
    text: str | None = None


# Text, token ids, vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": ...}, or a prompt
# tokenized already.
PromptType: TypeAlias = "str | list[int] | dict[str, Any] | TokenizedPrompt"


def tokenize_prompt(tokenizer: Tokenizer, prompt: PromptType) -> TokenizedPrompt:
    """The one form of a prompt (a `TokenizedPrompt` is returned as it is).

    Raises:
        KeyError: for a dict prompt with neither "prompt" nor "prompt_token_ids".
    """
    if isinstance(prompt, TokenizedPrompt):
        return prompt
    if isinstance(prompt, str):
        return TokenizedPrompt(tokenizer.encode(prompt), prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return TokenizedPrompt(list(prompt["prompt_token_ids"]), prompt.get("prompt"))
        return TokenizedPrompt(tokenizer.encode(prompt["prompt"]), prompt["prompt"])
    return TokenizedPrompt(list(prompt))


def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt or many → a list of prompts (a flat list of ints is one prompt)."""
    if isinstance(prompts, str | dict | TokenizedPrompt):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]
    return items


def chat_prompt(
    tokenizer: Tokenizer,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> TokenizedPrompt:
    """One conversation as a prompt, rendered with the model's chat template.

    The template writes whatever special tokens the model wants (BOS included), so the text is
    tokenized without adding any, as vLLM does for chat.

    Args:
        tools: OpenAI-style tool definitions, the template's `tools` variable.
        chat_template_kwargs: more variables for the template (e.g. `enable_thinking`).

    Raises:
        ValueError: the model has no chat template, or the template raised.
    """
    variables = {
        k: v
        for k, v in (chat_template_kwargs or {}).items()
        if k not in ("messages", "add_generation_prompt")
    }
    if tools is not None:
        variables["tools"] = list(tools)
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, **variables
    )
    return TokenizedPrompt(tokenizer.encode(text, add_special_tokens=False), text)
