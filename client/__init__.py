"""Clients of engine cores, in three parts, each importing only the parts before it:

- `transport/`: the seed's client family (`MPClient`, `SyncMPClient`, `AsyncMPClient`,
  `DPAsyncMPClient`) with its parts: sockets, the engine set, the HELLO handshake and its
  driver, the engine monitor, the output classifier. No Ray.
- `routing/`: `DPLBAsyncMPClient` and what it routes with (the request router, the policies,
  the KV-cache index, request migration), and `ClusterLink`, which keeps it in step with a
  running cluster (the only module here that speaks Ray).
- `api/`: what users call: `LLM`, `AsyncLLM`, prompts, output processing, `n > 1` fan-out.

The public names load on first use: `AsyncLLM` and the clients drive engines in other processes
and never import torch; `LLM` runs the engine (and torch) in this process.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoal.client.api.async_llm import AsyncLLM
    from shoal.client.api.llm import LLM
    from shoal.client.api.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
    from shoal.client.routing.lb_client import DPLBAsyncMPClient
    from shoal.client.transport.async_mp_client import AsyncMPClient
    from shoal.client.transport.connections import EngineAttachError
    from shoal.client.transport.dp_client import DPAsyncMPClient
    from shoal.client.transport.mp_client import MPClient
    from shoal.client.transport.output_dispatch import EngineUtilityError
    from shoal.client.transport.sync_mp_client import SyncMPClient
    from shoal.engine.protocol import (
        LoRARequest,
        PoolingParams,
        SamplingParams,
        StructuredOutputsParams,
    )

_PUBLIC = {
    "AsyncLLM": "shoal.client.api.async_llm",
    "LLM": "shoal.client.api.llm",
    "CompletionOutput": "shoal.client.api.outputs",
    "RequestOutput": "shoal.client.api.outputs",
    "EmbeddingRequestOutput": "shoal.client.api.outputs",
    "SamplingParams": "shoal.engine.protocol",
    "PoolingParams": "shoal.engine.protocol",
    "LoRARequest": "shoal.engine.protocol",
    "StructuredOutputsParams": "shoal.engine.protocol",
    # The seed's client family, for programs that drive engines directly.
    "MPClient": "shoal.client.transport.mp_client",
    "SyncMPClient": "shoal.client.transport.sync_mp_client",
    "AsyncMPClient": "shoal.client.transport.async_mp_client",
    "DPAsyncMPClient": "shoal.client.transport.dp_client",
    "DPLBAsyncMPClient": "shoal.client.routing.lb_client",
    "EngineAttachError": "shoal.client.transport.connections",
    "EngineUtilityError": "shoal.client.transport.output_dispatch",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "AsyncMPClient",
    "CompletionOutput",
    "DPAsyncMPClient",
    "DPLBAsyncMPClient",
    "EmbeddingRequestOutput",
    "EngineAttachError",
    "EngineUtilityError",
    "LoRARequest",
    "MPClient",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "SyncMPClient",
]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'shoal.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value
