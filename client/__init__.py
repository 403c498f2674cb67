"""Clients of engine cores: the seed's MPClient family, DP load balancing, and `LLM` / `AsyncLLM`."""

from shoal.client.async_llm import AsyncLLM
from shoal.client.llm import LLM
from shoal.client.outputs import CompletionOutput, RequestOutput
from shoal.engine.protocol import SamplingParams

__all__ = ["LLM", "AsyncLLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
