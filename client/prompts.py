"""Prompt forms users pass (text, token ids, vLLM prompt dicts) and their tokenization."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

from shoal.engine.tokenizer import Tokenizer

# Text, token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": ...}.
PromptType: TypeAlias = "str | list[int] | dict[str, Any]"


def tokenize_prompt(tokenizer: Tokenizer, prompt: PromptType) -> tuple[str | None, list[int]]:
    """Returns (text if known, token ids) for one prompt.

    Raises:
        KeyError: for a dict prompt with neither "prompt" nor "prompt_token_ids".
    """
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        return prompt["prompt"], tokenizer.encode(prompt["prompt"])
    return None, list(prompt)


def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt or many → a list of prompts (a flat list of ints is one prompt)."""
    if isinstance(prompts, (str, dict)):
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
) -> dict[str, Any]:
    """One conversation as a prompt dict, rendered with the model's chat template.

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
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
