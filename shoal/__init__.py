"""shoal: LLM serving on a Ray cluster.

The user's import is `from shoal import LLM, AsyncLLM, SamplingParams`. The layers are
subpackages, each kept in its own top-level folder of the repository: `shoal.engine` (one rank,
no Ray), `shoal.actors` (Ray actors), `shoal.cluster` (placement and launch), `shoal.client`
(the engine-core clients and the user APIs) and `shoal.deploy` (CLI, job entrypoint, HTTP
front end, demo). The public names load on first use, so importing a light module such as
`shoal.engine.scheduler` does not pull in torch or Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoal.client.api.async_llm import AsyncLLM
    from shoal.client.api.llm import LLM
    from shoal.client.api.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
    from shoal.engine.protocol import (
        LoRARequest,
        PoolingParams,
        SamplingParams,
        StructuredOutputsParams,
    )

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'shoal' has no attribute {name!r}")
    value = getattr(importlib.import_module("shoal.client"), name)  # loads on first use too
    globals()[name] = value  # later lookups skip this hook
    return value
