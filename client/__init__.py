"""Clients of engine cores: the seed's MPClient family, DP load balancing, and `LLM` / `AsyncLLM`."""

from client.async_llm import AsyncLLM
from client.llm import LLM
from client.outputs import CompletionOutput, RequestOutput
from engine.protocol import SamplingParams

__all__ = ["LLM", "AsyncLLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
