"""Clients of engine cores: the seed's MPClient family, DP load balancing, and `LLM` / `AsyncLLM`.

The public names load on first use: `AsyncLLM` and the clients drive engines in other processes
and never import torch; `LLM` runs the engine (and torch) in this process.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoal.client.async_llm import AsyncLLM
    from shoal.client.llm import LLM
    from shoal.client.outputs import CompletionOutput, RequestOutput
    from shoal.engine.protocol import SamplingParams, StructuredOutputsParams

_PUBLIC = {
    "AsyncLLM": "shoal.client.async_llm",
    "LLM": "shoal.client.llm",
    "CompletionOutput": "shoal.client.outputs",
    "RequestOutput": "shoal.client.outputs",
    "SamplingParams": "shoal.engine.protocol",
    "StructuredOutputsParams": "shoal.engine.protocol",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'shoal.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value
