"""What one message of a client's output socket is: one classifier, a frame in, a decision out.

The output socket carries engines' outputs, utility replies (HELLO answers among them),
elastic notifications, and the notices the client's own engine monitor pushes into it
(`shoal.client.transport.attach.read_notice`). `OutputClassifier.classify` decodes a message
and names it, touching no client state; the output consumers (the asyncio task's
`process_outputs_socket`, the blocking client's thread) act on the decision:

    frames ──classify──▶ EngineCoreOutputs    an engine's outputs, stats or KV events
                       ▶ UtilityOutput        the reply to a pending call (or HELLO)
                       ▶ ScaleNotification    an elastic notification (EEP_NOTIFICATION_CALL_ID)
                       ▶ DeathNotice          an engine died or is lost (the monitor, the engine)
                       ▶ RecheckNotice        this client may have been let go: recheck
                       ▶ Dropped              malformed: logged, and nothing else happens

The two most frequent decisions are the decoded messages themselves, so the hot path makes no
object of its own. The PULL takes connections from anyone who can reach it: a message no
engine would send is dropped, and the client goes on serving.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from shoal.client.transport.attach import DeathNotice, MalformedNotice, RecheckNotice, read_notice
from shoal.engine.protocol import EEP_NOTIFICATION_CALL_ID, EngineCoreOutputs, UtilityOutput
from shoal.engine.serial import MsgpackDecoder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScaleNotification:
    """An elastic notification: `(kind, payload)` (`shoal.engine.parallel.elastic`)."""

    notification: Sequence[Any]


@dataclass(frozen=True)
class Dropped:
    """A message no engine or monitor sends; `reason` says what was wrong with it."""

    reason: str


Decision = (
    EngineCoreOutputs | UtilityOutput | ScaleNotification | DeathNotice | RecheckNotice | Dropped
)


class OutputClassifier:
    """Decodes and names the messages of one client's output socket (see the module docstring).

    `num_dropped` counts the malformed messages; the 1st, 2nd, 4th, 8th, ... are logged.
    """

    def __init__(self) -> None:
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self.num_dropped = 0

    def classify(self, frames: Sequence[zmq.Frame]) -> Decision:
        notice = read_notice(frames)
        if notice is not None:
            if isinstance(notice, MalformedNotice):
                return self._drop(f"a death notice that names no engine: {notice.detail!r}")
            return notice
        try:
            outputs: EngineCoreOutputs = self._decoder.decode(frames)
        except Exception as e:  # a peer's bytes must never end the output loop
            return self._drop(f"{type(e).__name__}: {e}")
        utility = outputs.utility_output
        if utility is None:
            return outputs
        if utility.call_id != EEP_NOTIFICATION_CALL_ID:
            return utility
        notification = utility.result.result if utility.result is not None else None
        if not isinstance(notification, list | tuple) or len(notification) != 2:
            return self._drop(f"an elastic notification that is not (kind, payload): {utility}")
        return ScaleNotification(notification)

    def _drop(self, reason: str) -> Dropped:
        self.num_dropped += 1
        if self.num_dropped & (self.num_dropped - 1) == 0:
            logger.warning(
                "dropped a malformed message on the output socket (%d so far): %s",
                self.num_dropped,
                reason,
            )
        return Dropped(reason)
