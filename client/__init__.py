"""Clients of engine cores: the seed's MPClient family, DP load balancing, and `LLM` / `AsyncLLM`."""

from engine.protocol import SamplingParams

__all__ = ["SamplingParams"]
