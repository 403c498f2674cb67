"""User-facing results: `RequestOutput` and `CompletionOutput`, and a pooling engine's
`EmbeddingRequestOutput`, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One candidate token's log-probability at one position."""

    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    `finish_reason` is "stop", "length", "abort" or "error" once finished, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request's milestones."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    queue_time: float | None = None  # seconds the engine held it before first scheduling it

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request as streamed to, or returned to, the caller.

    Attributes:
        error: set (with finish_reason "error") when the request was rejected or failed.
        data_parallel_rank: the engine rank that served it, when known.
        num_cached_tokens: prompt tokens found in the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    data_parallel_rank: int | None = None
    error: str | None = None
    new_token_ids: list[int] = field(default_factory=list)  # tokens since the previous output
    pooled: list[float] | None = None  # a pooling request's vector, once finished


@dataclass
class EmbeddingOutput:
    """The pooled final hidden state of one prompt."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (`LLM.embed`, `AsyncLLM.encode`), as vLLM's.

    Attributes:
        error: set (and the embedding empty) when the request was rejected or failed.
        data_parallel_rank: the engine rank that served it, when known.
    """

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None
    metrics: RequestMetrics | None = None
    data_parallel_rank: int | None = None

    @classmethod
    def of(cls, output: RequestOutput) -> EmbeddingRequestOutput:
        """The embedding a pooling request's final `RequestOutput` carries."""
        return cls(
            output.request_id,
            EmbeddingOutput(list(output.pooled or [])),
            output.prompt_token_ids,
            output.finished,
            output.error,
            output.metrics,
            output.data_parallel_rank,
        )
