"""`FrontEndLimits`: every bound one HTTP front end puts on what a client may ask of it.

The bounds on a request's fields are checked here, before any work (tokenizing, routing):
each refusal is a 400 that names the field and the limit. The bounds on bytes and connections
(`max_request_body_bytes`, `http_read_timeout_s`, `max_connections`) are enforced by
`body_guard` and `connections`; this module only holds and parses them.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from shoal.deploy.openai.errors import OpenAIError
from shoal.deploy.openai.protocol import ChatCompletionRequest, CompletionRequest

# OpenAI's own cap on `n`.
DEFAULT_MAX_N = 128
# Sequences (prompts x n) one request may start: a full batch of 1,024 prompts at n=1, or
# n=128 for 8 prompts; about four engine batches (`--max-num-seqs` 256) on a rank.
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 1024
# Enough for a long context of text even with JSON's \uXXXX escapes, far below what hurts.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
# A request's head and body must both arrive within this long of the connection (or of the
# previous response on it): slow-header and slow-body clients are closed.
DEFAULT_HTTP_READ_TIMEOUT_S = 30.0
# uvicorn's default: an idle keep-alive connection is closed after this long.
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0
# Open HTTP connections at most (lowered further to fit under the open-file limit).
DEFAULT_MAX_CONNECTIONS = 4096
# Stop strings and stop token ids one request may give (checked on every generated token).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class FrontEndLimits:
    """The bounds of one front end (`shoal serve --port`, `shoal api-server`)."""

    max_n: int = DEFAULT_MAX_N
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    http_read_timeout_s: float = DEFAULT_HTTP_READ_TIMEOUT_S
    timeout_keep_alive_s: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # The most ranks `/scale_elastic_ep` may ask for; None: what the Ray cluster holds now.
    max_data_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_n < 1:
            raise ValueError(f"--max-n must be at least 1, got {self.max_n}")
        if self.max_sequences_per_request < 1:
            raise ValueError(
                "--max-sequences-per-request must be at least 1, got "
                f"{self.max_sequences_per_request}"
            )
        if self.max_request_body_bytes < 1024:
            raise ValueError("--max-request-body-bytes must be at least 1024")
        if self.http_read_timeout_s <= 0 or self.timeout_keep_alive_s <= 0:
            raise ValueError("--http-read-timeout and --timeout-keep-alive must be positive")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")
        if self.max_data_parallel_size is not None and self.max_data_parallel_size < 1:
            raise ValueError("--max-data-parallel-size must be at least 1")

    def check_request(
        self, request: CompletionRequest | ChatCompletionRequest, num_prompts: int = 1
    ) -> None:
        """Refuses a generation request past a bound, before any work on it.

        Args:
            num_prompts: the prompts it batches (a completion may give a list).

        Raises:
            OpenAIError: `n`, `best_of`, the sequences it would start (prompts x n x best_of,
                where best_of can only equal n), or the stop conditions over their limits
                (400).
        """
        for name in ("n", "best_of"):
            value = getattr(request, name)
            if value is not None and value > self.max_n:
                raise OpenAIError(
                    f"{name}={value} exceeds this server's limit of {self.max_n} (--max-n)",
                    param=name,
                )
        num_sequences = num_prompts * max(request.n or 1, request.best_of or 1)
        self.check_num_sequences(num_sequences, f"{num_prompts} prompts x n={request.n or 1}")
        stop = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise OpenAIError(f"stop has more than {MAX_STOP_STRINGS} strings", param="stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise OpenAIError(
                f"a stop string is longer than {MAX_STOP_STRING_CHARS} characters", param="stop"
            )
        if len(request.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise OpenAIError(
                f"stop_token_ids has more than {MAX_STOP_TOKEN_IDS} ids", param="stop_token_ids"
            )

    def check_num_sequences(self, num_sequences: int, what: str, param: str = "n") -> None:
        """Refuses a request that would start more than `max_sequences_per_request`.

        Raises:
            OpenAIError: past the bound (400), naming `what` the sequences are.
        """
        if num_sequences > self.max_sequences_per_request:
            raise OpenAIError(
                f"this request would start {num_sequences} sequences ({what}), more than this "
                f"server's limit of {self.max_sequences_per_request} "
                "(--max-sequences-per-request)",
                param=param,
            )


def add_limit_args(parser: argparse._ActionsContainer) -> None:
    """The flags of `FrontEndLimits`."""
    parser.add_argument(
        "--max-n",
        type=int,
        default=DEFAULT_MAX_N,
        help=f"most sequences (`n`) one request may ask for (default {DEFAULT_MAX_N})",
    )
    parser.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
        help="most sequences one request may start, its prompts times n; more is refused "
        f"with 400 before anything is queued (default {DEFAULT_MAX_SEQUENCES_PER_REQUEST})",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="largest HTTP request body; larger ones are refused with 413 "
        f"(default {DEFAULT_MAX_REQUEST_BODY_BYTES})",
    )
    parser.add_argument(
        "--http-read-timeout",
        type=float,
        default=DEFAULT_HTTP_READ_TIMEOUT_S,
        help="seconds a request's headers and body may take to arrive before the connection "
        f"is closed (default {DEFAULT_HTTP_READ_TIMEOUT_S:.0f})",
    )
    parser.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
        help="seconds an idle keep-alive connection stays open "
        f"(default {DEFAULT_TIMEOUT_KEEP_ALIVE_S:.0f})",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="most open HTTP connections, lowered to fit the open-file limit; past it idle "
        f"connections are closed first, else new ones get 503 (default {DEFAULT_MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--max-data-parallel-size",
        type=int,
        default=None,
        help="the most ranks POST /scale_elastic_ep (and `shoal serve --autoscale`) may ask for; "
        "up to it a resize may wait for nodes an autoscaler adds (default: only what the Ray "
        "cluster's nodes hold now)",
    )


def limits_from_args(args: argparse.Namespace) -> FrontEndLimits:
    return FrontEndLimits(
        max_n=args.max_n,
        max_sequences_per_request=args.max_sequences_per_request,
        max_request_body_bytes=args.max_request_body_bytes,
        http_read_timeout_s=args.http_read_timeout,
        timeout_keep_alive_s=args.timeout_keep_alive,
        max_connections=args.max_connections,
        max_data_parallel_size=args.max_data_parallel_size,
    )


def non_negative_int(value: str) -> int:
    """An argparse type: an integer >= 0."""
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {number}")
    return number


def non_negative_float(value: str) -> float:
    """An argparse type: a finite number >= 0."""
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {value}")
    return number
