"""What both output consumers do with a decision, thread or task alike: pending calls, deaths.

`PendingCalls` holds the futures of the utility calls (HELLOs among them) waiting for their
reply, with the engine each went to, so a reply completes its future and a death fails those
of the dead engine. `learn_death` records a death notice in the engine set and says whether it
is news to tell. The errors a consumer sees are shaped here too. It owns no socket: the
blocking client's thread and the asyncio client's task call it
(`shoal.client.transport.output_classifier` names what each message is).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import zmq

from shoal.client.transport.engine_set import EngineSet
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import UtilityOutput

logger = logging.getLogger(__name__)

AnyFuture = Any  # a concurrent.futures.Future (sync client) or an asyncio.Future


class EngineUtilityError(RuntimeError):
    """A utility call failed on the engine (or was refused); the engine itself is fine."""


class PendingCalls:
    """The calls waiting for their reply: call id → future, and the engine it went to.

    Safe between one caller thread and the output thread: each change is one dict operation,
    and `fail` walks a copy.
    """

    def __init__(self) -> None:
        self._futures: dict[int, AnyFuture] = {}
        self._engines: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._futures)

    def items(self) -> list[tuple[int, AnyFuture]]:
        """(call id, future) of every pending call."""
        return list(self._futures.items())

    def add(self, call_id: int, engine_index: int, future: AnyFuture) -> None:
        """Registers a call before it is sent (the reply may come before the send returns)."""
        self._futures[call_id] = future
        self._engines[call_id] = engine_index

    def discard(self, call_id: int) -> None:
        self._futures.pop(call_id, None)
        self._engines.pop(call_id, None)

    @contextlib.contextmanager
    def waiting(self, call_id: int, engine_index: int, future: AnyFuture) -> Iterator[None]:
        """Holds a call registered while the caller waits for it (a HELLO)."""
        self.add(call_id, engine_index, future)
        try:
            yield
        finally:
            self.discard(call_id)

    def complete(self, output: UtilityOutput) -> None:
        """Completes the future of a reply with its result or its failure."""
        self._engines.pop(output.call_id, None)
        future = self._futures.pop(output.call_id, None)
        if future is None or future.done():
            return  # the caller gave up (cancelled) or the engine was declared dead first
        if output.failure_message is not None:
            future.set_exception(EngineUtilityError(output.failure_message))
        else:
            future.set_result(output.result.result if output.result is not None else None)

    def fail(self, engine_index: int | None, error: BaseException) -> None:
        """Fails the calls of one engine (all engines if `engine_index` is None)."""
        for call_id, index in list(self._engines.items()):
            if engine_index is not None and index != engine_index:
                continue
            self._engines.pop(call_id, None)
            future = self._futures.pop(call_id, None)
            if future is not None and not future.done():
                future.set_exception(error)


def learn_death(engine_index: int, engines: EngineSet) -> EngineDeadError | None:
    """Records a death notice in the engine set.

    Returns:
        The `EngineDeadError` to tell the consumer: on the first notice that an engine died,
        and once more when an engine counted dead that could come back no longer can (its
        process exited). None for a repeated notice, or one that names no engine of the set.
    """
    if not engines.learn_death(engine_index):
        return None
    return EngineDeadError(
        "it sent ENGINE_CORE_DEAD, disappeared, or let this client go", engine_index=engine_index
    )


def format_exception(error: BaseException) -> EngineDeadError:
    """The consumer-facing form of an output failure: always EngineDeadError, cause attached."""
    if isinstance(error, EngineDeadError):
        return error
    dead = EngineDeadError(f"the output stream failed: {type(error).__name__}: {error}")
    dead.__cause__ = error
    return dead


def as_engine_error(error: zmq.ZMQError, engine_index: int) -> Exception:
    if error.errno == zmq.EHOSTUNREACH:
        return EngineDeadError("its input connection is gone", engine_index=engine_index)
    return error
