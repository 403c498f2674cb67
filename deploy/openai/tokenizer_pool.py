"""`TokenizerPool`: tokenizing, detokenizing and chat templating off the event loop.

The endpoints hand the work on large inputs to a few threads and await it, so a 5 MB prompt
being tokenized never delays `/health` or another request's stream; small inputs (under
`SMALL_INPUT` characters or ids, well under a millisecond of work) run inline, so they never
queue behind a large one: the tokenizer's calls for long inputs
release the GIL (`shoal.engine.tokenizer`), and Python work such as a chat template yields it
every switch interval. The pool is bounded twice: `num_workers` threads (half the cores, at
most 4), and at most `max_pending` calls waiting or running; past that a call is refused with
503 at once. Its threads run at a lower CPU priority (nice +5), so on a busy machine the event
loop and the engines come first.

Memory: a tokenizer's working set is about 150 bytes per character of input (a 7 MB text
holds a gigabyte while it is tokenized), and the C allocator keeps what a thread freed for
later. So inputs of `LARGE_INPUT` characters (or ids) and more run one at a time (the others
wait their turn, counted in `max_pending`), and after each call of `TRIM_INPUT` and more its
thread hands freed memory back to the system (`malloc_trim`, glibc only): a burst of large
`/tokenize` calls leaves the front end near the size it had before (`bench/attack.py`
measures it).

It also holds the cheap bound on a prompt's length: no token spells more than
`max_token_chars` characters, so a text over `max_model_len * max_token_chars` characters
(times a margin for normalizers that shrink text) cannot fit, and is refused untokenized.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import TypeVar

from shoal.deploy.openai.errors import OpenAIError
from shoal.engine.tokenizer import Tokenizer

T = TypeVar("T")

logger = logging.getLogger(__name__)

DEFAULT_NUM_WORKERS = max(1, min(4, (os.cpu_count() or 2) // 2))
DEFAULT_MAX_PENDING = 64
# Inputs smaller than this (characters, or token ids) are worked on inline.
SMALL_INPUT = 16384
# Inputs this large run one at a time.
LARGE_INPUT = 1 << 20
# After a call on an input this large, its thread returns freed memory to the system.
TRIM_INPUT = 1 << 18
_WORKER_NICENESS = 5
# Normalizers (NFC, ...) may shrink a text before it is split into tokens.
_SHRINK_MARGIN = 2


class TokenizerPool:
    """A bounded pool of threads for one tokenizer's work.

    Args:
        tokenizer: the served model's tokenizer.
        num_workers: threads doing the work.
        max_pending: calls waiting or running, at most; past it `run` raises (503).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        num_workers: int = DEFAULT_NUM_WORKERS,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_pending = max_pending
        self._num_pending = 0
        self._large_turn: asyncio.Semaphore | None = None  # made in the serving loop
        self._executor = ThreadPoolExecutor(
            num_workers, thread_name_prefix="shoal-tokenizer", initializer=_lower_priority
        )

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters any one token spells."""
        vocab = self.tokenizer.backend.get_vocab(with_added_tokens=True)
        return max((len(token) for token in vocab), default=1)

    async def run(self, fn: Callable[..., T], *args: object, size: int) -> T:
        """`fn(*args)` on a worker thread, or inline if `size` (of the input it works on, in
        characters or ids) is under `SMALL_INPUT`.

        Raises:
            OpenAIError: `max_pending` calls are waiting already (503); or what `fn` raises.
        """
        if size < SMALL_INPUT:
            return fn(*args)
        if self._num_pending >= self.max_pending:
            raise OpenAIError(
                f"the tokenizer has {self.max_pending} requests queued; retry shortly",
                HTTPStatus.SERVICE_UNAVAILABLE,
                code="tokenizer_busy",
            )
        self._num_pending += 1
        try:
            loop = asyncio.get_running_loop()
            call = functools.partial(_trimmed if size >= TRIM_INPUT else _plain, fn, *args)
            if size < LARGE_INPUT:
                return await loop.run_in_executor(self._executor, call)
            if self._large_turn is None:
                self._large_turn = asyncio.Semaphore(1)
            async with self._large_turn:
                return await loop.run_in_executor(self._executor, call)
        finally:
            self._num_pending -= 1

    def check_text_length(self, num_chars: int, max_model_len: int | None, param: str) -> None:
        """Refuses, untokenized, a text too long to fit in `max_model_len` tokens.

        Raises:
            OpenAIError: the text has more characters than any fitting prompt (400).
        """
        if max_model_len is None:
            return
        max_chars = max_model_len * self.max_token_chars * _SHRINK_MARGIN
        if num_chars > max_chars:
            raise OpenAIError(
                f"the prompt has {num_chars} characters, more than {max_model_len} tokens (this "
                f"model's maximum context length) can spell ({max_chars} characters at most)",
                param=param,
            )

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _plain(fn: Callable[..., T], *args: object) -> T:
    return fn(*args)


def _trimmed(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)`, then the freed memory of the allocator goes back to the system."""
    try:
        return fn(*args)
    finally:
        release_free_memory()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    with contextlib.suppress(OSError, AttributeError):
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
        return trim
    return None


def release_free_memory() -> None:
    """Returns the memory the C allocator holds free, in every arena, to the system (about
    10-20 ms after a large call; nothing where the C library is not glibc)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _lower_priority() -> None:
    """Lowers the calling thread's CPU priority (Linux: a thread id is a process id to
    setpriority); elsewhere, or where not allowed, leaves it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _WORKER_NICENESS)
    except (AttributeError, OSError) as e:
        logger.debug("tokenizer thread priority left as it is: %s", e)
