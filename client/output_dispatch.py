"""What a client's output consumer does with each message, thread or task alike.

The output socket carries engines' outputs, utility replies (HELLO answers among them) and the
notices of the client's own engine monitor (`shoal.client.attach.read_notice`). This module
decodes the first two, turns a death notice into the `EngineDeadError` to tell, completes or
fails pending calls' futures, and shapes the errors a consumer sees. It owns no socket: the
sync client's thread and the asyncio client's task call it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import zmq

from shoal.client.attach import DeathNotice, MalformedNotice, Notice
from shoal.client.engine_set import EngineSet
from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import EngineCoreOutputs, UtilityOutput
from shoal.engine.serial import MsgpackDecoder

logger = logging.getLogger(__name__)

AnyFuture = Any  # a concurrent.futures.Future (sync client) or an asyncio.Future


class EngineUtilityError(RuntimeError):
    """A utility call failed on the engine (or was refused); the engine itself is fine."""


class OutputDecoder:
    """Decodes the messages of a client's output socket, dropping the ones that are malformed.

    The PULL takes connections from anyone who can reach it; a message no engine would send (a
    broken or foreign peer's) is logged and dropped, and the client goes on serving.
    """

    def __init__(self) -> None:
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self.num_dropped = 0

    def decode(self, frames: Sequence[zmq.Frame]) -> EngineCoreOutputs | None:
        """The message's outputs, or None if it is malformed."""
        try:
            outputs: EngineCoreOutputs = self._decoder.decode(frames)
            return outputs
        except Exception as e:  # a peer's bytes must never end the output loop
            self.num_dropped += 1
            if self.num_dropped & (self.num_dropped - 1) == 0:  # 1st, 2nd, 4th, 8th, ...
                logger.warning(
                    "dropped a malformed message on the output socket (%d so far): %s: %s",
                    self.num_dropped,
                    type(e).__name__,
                    e,
                )
            return None


def learn_notice(notice: Notice, engines: EngineSet) -> EngineDeadError | None:
    """Records what a death notice says in the engine set.

    Returns:
        The `EngineDeadError` to tell the consumer: on the first notice that an engine died,
        and once more when an engine counted dead that could come back no longer can (its
        process exited). None for a repeated notice, one that names no engine of the set, a
        malformed one (dropped) and a recheck notice (the caller acts on it).
    """
    if isinstance(notice, MalformedNotice):
        logger.warning("dropped a malformed death notice: %r", notice.detail)
        return None
    if not isinstance(notice, DeathNotice) or not engines.learn_death(notice.engine_index):
        return None
    return EngineDeadError(
        "it sent ENGINE_CORE_DEAD, disappeared, or let this client go",
        engine_index=notice.engine_index,
    )


def process_utility_output(output: UtilityOutput, utility_results: dict[int, AnyFuture]) -> None:
    """Completes the future of a utility call (concurrent or asyncio) with its result."""
    future = utility_results.pop(output.call_id, None)
    if future is None or future.done():
        return  # the caller gave up (cancelled) or the engine was declared dead first
    if output.failure_message is not None:
        future.set_exception(EngineUtilityError(output.failure_message))
    else:
        future.set_result(output.result.result if output.result is not None else None)


def fail_utility_calls(
    utility_results: dict[int, AnyFuture],
    utility_engines: dict[int, int],
    engine_index: int | None,
    error: BaseException,
) -> None:
    """Fails the pending utility calls of one engine (all engines if `engine_index` is None)."""
    for call_id, index in list(utility_engines.items()):
        if engine_index is not None and index != engine_index:
            continue
        del utility_engines[call_id]
        future = utility_results.pop(call_id, None)
        if future is not None and not future.done():
            future.set_exception(error)


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
