"""The typed messages that travel between an engine's IO threads and its busy loop.

Input thread → busy loop (`InputItem`): requests, aborts, utility calls, clients attaching and
detaching. Busy loop → output thread (`OutputItem`): outputs to send, attaches and detaches to
carry out on the PUSH sockets, stats reports, and the death notice. One small frozen class per
kind, so a queue never carries a positional tuple whose meaning lives in a comment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import zmq

from shoal.engine.parallel.elastic import ScaleNotice
from shoal.engine.protocol import EngineCoreOutputs, EngineCoreRequest, EngineStatsReport


@dataclass(frozen=True, slots=True)
class AddRequest:
    """A decoded, framing-checked ADD (the engine core validates its content)."""

    request: EngineCoreRequest


@dataclass(frozen=True, slots=True)
class AbortRequests:
    """An ABORT: only requests owned by `client_index` are aborted."""

    request_ids: list[str]
    client_index: int


@dataclass(frozen=True, slots=True)
class UtilityCall:
    """A UTILITY call on an allowed method; the answer goes to `client_index`."""

    client_index: int
    call_id: int
    method: str
    args: list[Any]


@dataclass(frozen=True, slots=True)
class AttachClient:
    """A client's HELLO was accepted: its PUSH socket, the answer to send on it first, and the
    attach's serial (how many attaches this engine has accepted)."""

    client_index: int
    push: zmq.Socket
    reply: EngineCoreOutputs
    attach_serial: int
    wants_kv_events: bool = False


@dataclass(frozen=True, slots=True)
class DetachClient:
    """A client left (GOODBYE) or was let go; its PUSH's monitor reader is the output thread's
    to close."""

    client_index: int
    monitor: zmq.Socket | None


@dataclass(frozen=True, slots=True)
class SendOutputs:
    """Outputs for one client (a step's, a utility answer, or an input-thread error)."""

    client_index: int
    outputs: EngineCoreOutputs


@dataclass(frozen=True, slots=True)
class ReportStats:
    """A load report for the coordinator."""

    report: EngineStatsReport


@dataclass(frozen=True, slots=True)
class NotifyClients:
    """An elastic notification (`shoal.engine.parallel.elastic`) for every attached client."""

    kind: str
    notice: ScaleNotice


@dataclass(frozen=True, slots=True)
class MoveStats:
    """Push stats reports to `address` from now on (the coordinator moved)."""

    address: str


@dataclass(frozen=True, slots=True)
class EngineDead:
    """On input: an IO thread failed. On output: tell every attached client, then stop."""


@dataclass(frozen=True, slots=True)
class Wake:
    """No work; only wakes the busy loop (to notice a shutdown)."""


InputItem = (
    AddRequest
    | AbortRequests
    | UtilityCall
    | AttachClient
    | DetachClient
    | SendOutputs
    | NotifyClients
    | MoveStats
    | EngineDead
    | Wake
)
OutputItem = SendOutputs | AttachClient | DetachClient | ReportStats | MoveStats | EngineDead
