"""`RequestIntake`: what every rank engine does with an ADD before its scheduler sees it, and
with a step's outputs before they leave.

Whatever engine a rank hosts (`shoal.engine.core.rank_engine`), an ADD is counted for its
client's load accounting, a duplicate of a live request id is dropped, and an invalid request
becomes an ERROR output for that request alone, delivered with the next step. A step's outputs
are packed per client with the rank's stats. It knows no scheduler and no model: the engine
says which ids are live and what its limits are.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from shoal.engine.core.rate_limit import LogRateLimiter
from shoal.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)

logger = logging.getLogger(__name__)
_duplicates = LogRateLimiter(logger)

# A request id longer than this is refused; logs show at most `_LOGGED_ID_CHARS` of any id.
MAX_REQUEST_ID_CHARS = 256
_LOGGED_ID_CHARS = 64


@dataclass(frozen=True)
class RequestLimits:
    """What an engine can take, as it found at start-up.

    Attributes:
        max_model_len: the context length served.
        vocab_size: token ids are in [0, vocab_size).
        max_logprobs: the most logprobs a request may ask for per token.
        num_kv_cache_tokens: the tokens the whole KV pool holds.
        is_pooling: the engine pools (`--runner pooling`): it answers embedding requests
            only, and a generating engine answers no embedding request.
    """

    max_model_len: int
    vocab_size: int
    max_logprobs: int
    num_kv_cache_tokens: int
    is_pooling: bool = False

    @property
    def max_num_tokens(self) -> int:
        """The most tokens one request may hold: the context and the KV pool bound it."""
        return min(self.max_model_len, self.num_kv_cache_tokens)


def validate_request(request: EngineCoreRequest, limits: RequestLimits) -> str | None:
    """Why `request` cannot be served within `limits`, or None if it can."""
    if not request.request_id:
        return "request_id must not be empty"
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        return f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters"
    prompt = request.prompt_token_ids
    if not prompt:
        return "the prompt is empty"
    error = _validate_kind(request, limits)
    if error is not None:
        return error
    if request.pooling_params is not None and len(prompt) > limits.max_model_len:
        return (
            f"the prompt has {len(prompt)} tokens, but the maximum context length is "
            f"{limits.max_model_len}"
        )
    if request.pooling_params is None and len(prompt) >= limits.max_model_len:
        return (
            f"the prompt has {len(prompt)} tokens, but the maximum context length is "
            f"{limits.max_model_len} and at least one token must be generated"
        )
    vocab_size = limits.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        return f"prompt token ids must be in [0, {vocab_size})"
    params = request.sampling_params
    try:
        params.__post_init__()  # fields may have been changed after construction
    except ValueError as e:
        return str(e)
    max_logprobs = min(limits.max_logprobs, vocab_size)
    if params.logprobs is not None and params.logprobs > max_logprobs:
        return f"logprobs={params.logprobs} exceeds the maximum of {max_logprobs}"
    if any(t >= vocab_size for t in params.stop_token_ids):
        return f"stop_token_ids must be in [0, {vocab_size})"
    if request.resumed_output_token_ids:
        return _validate_resumed(request, limits)
    return None


def _validate_kind(request: EngineCoreRequest, limits: RequestLimits) -> str | None:
    """A pooling request on a generating engine, or the reverse."""
    if request.pooling_params is not None and not limits.is_pooling:
        return (
            "this engine generates; pooling (embeddings) needs an engine started with "
            "--runner pooling"
        )
    if request.pooling_params is None and limits.is_pooling:
        return "this engine pools (--runner pooling): it answers embedding requests only"
    return None


def _validate_resumed(request: EngineCoreRequest, limits: RequestLimits) -> str | None:
    """A resumed request's output so far: valid ids, room for one more token, under
    max_tokens (the rank that generated it would have finished it otherwise)."""
    resumed = request.resumed_output_token_ids
    vocab_size = limits.vocab_size
    if min(resumed) < 0 or max(resumed) >= vocab_size:
        return f"resumed output token ids must be in [0, {vocab_size})"
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None and len(resumed) >= max_tokens:
        return (
            f"the request resumes with {len(resumed)} output tokens, which already reach "
            f"max_tokens={max_tokens}"
        )
    num_tokens = len(request.prompt_token_ids) + len(resumed)
    # The scheduler ends a request that fills the context or the whole KV pool, so a
    # resumed one must leave room for at least one more token in both.
    if num_tokens >= limits.max_num_tokens:
        return (
            f"the prompt and the resumed output have {num_tokens} tokens, but at most "
            f"{limits.max_num_tokens - 1} leave room for a generated token (max_model_len="
            f"{limits.max_model_len}, KV cache {limits.num_kv_cache_tokens} tokens)"
        )
    return None


class RequestIntake:
    """One engine's intake: ADD accounting, duplicate and invalid requests, output packing.

    Args:
        engine_index: stamped on every `EngineCoreOutputs`.
        limits: what the engine can take.
    """

    def __init__(self, engine_index: int, limits: RequestLimits) -> None:
        self.engine_index = engine_index
        self.limits = limits
        # client index → ADDs taken in from that client (accepted or rejected), reported with
        # the stats so a load balancer knows which of its sends they include.
        self.requests_seen: dict[int, int] = {}
        # Error outputs of rejected requests, delivered with the next step.
        self._rejected: dict[int, list[EngineCoreOutput]] = {}

    def admit(self, request: EngineCoreRequest, is_live: Callable[[str], bool]) -> bool:
        """Counts an ADD; True if the engine should take it, False if it was dropped (a
        duplicate of a live id) or rejected (its ERROR output is queued)."""
        client = request.client_index
        self.requests_seen[client] = self.requests_seen.get(client, 0) + 1
        if is_live(request.request_id):
            # An answer would carry the live request's id and finish it a second time: the
            # duplicate is dropped, and the live request finishes exactly once.
            _duplicates.warning(
                "duplicate-id",
                "engine %d dropped an ADD whose request_id %r is live already",
                self.engine_index,
                loggable(request.request_id),
            )
            return False
        error = validate_request(request, self.limits)
        if error is not None:
            self.reject(request, error)
            return False
        return True

    def reject(self, request: EngineCoreRequest, message: str) -> None:
        """Queues an ERROR output for `request`, delivered with the next step."""
        logger.info("rejected request %r: %s", loggable(request.request_id), message)
        output = EngineCoreOutput(
            request_id=request.request_id, finish_reason=FinishReason.ERROR, error_message=message
        )
        self._rejected.setdefault(request.client_index, []).append(output)

    def forget_client(self, client_index: int) -> None:
        """Drops a detached client's queued rejections and its count (it counts afresh)."""
        self._rejected.pop(client_index, None)
        self.requests_seen.pop(client_index, None)

    def has_rejected(self) -> bool:
        return bool(self._rejected)

    def take_rejected(self) -> dict[int, list[EngineCoreOutput]]:
        """The queued ERROR outputs by client, handed over once."""
        rejected, self._rejected = self._rejected, {}
        return rejected

    def pack(
        self, per_client: dict[int, list[EngineCoreOutput]], stats: Callable[[], SchedulerStats]
    ) -> dict[int, EngineCoreOutputs]:
        """Each client's outputs of a step as one frame, with the rank's stats (read only when
        there is something to send)."""
        if not per_client:
            return {}
        scheduler_stats = stats()
        now = time.time()
        return {
            client_index: EngineCoreOutputs(
                engine_index=self.engine_index,
                outputs=outputs,
                scheduler_stats=scheduler_stats,
                timestamp=now,
                requests_seen=self.requests_seen.get(client_index, 0),
            )
            for client_index, outputs in per_client.items()
        }


def loggable(request_id: str) -> str:
    """`request_id` cut to what a log line shows: a peer's 10 MB id costs the log 64 chars."""
    if len(request_id) <= _LOGGED_ID_CHARS:
        return request_id
    return f"{request_id[:_LOGGED_ID_CHARS]}...({len(request_id)} chars)"
