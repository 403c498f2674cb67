"""shoal: LLM serving on a Ray cluster.

The user's import is `from shoal import LLM, AsyncLLM, SamplingParams`. The layers are
subpackages, each kept in its own top-level folder of the repository: `shoal.engine` (one rank,
no Ray), `shoal.actors` (Ray actors), `shoal.cluster` (placement and launch), `shoal.client`
(the engine-core clients and the user APIs) and `shoal.deploy` (CLI, job entrypoint, demo).
"""

from __future__ import annotations

from shoal.client.async_llm import AsyncLLM
from shoal.client.llm import LLM
from shoal.client.outputs import CompletionOutput, RequestOutput
from shoal.engine.protocol import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncLLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
