"""The HELLO handshake as one state machine with no I/O: attach, attach again, recheck.

A client attaches to an engine by sending HELLO (`EngineHello`: its client index, its output
address, a call id) on its input ROUTER; the engine answers on a PUSH to that address with
`UtilityOutput(call_id, result=EngineFacts)`, or with a failure message when it refuses. One
`Handshake` is one such exchange with one engine. It makes the frames to send and reads the
answer; its drivers (`shoal.client.transport.attach_driver`: at construction, from a blocking
caller, from the event loop) only move frames and keep time.

Purposes:

    ATTACH     a new engine, just connected
    REATTACH   an engine counted dead whose process lives, asked again on the same connection
    RECHECK    an attached engine, asked whether it still counts this client attached; it
               knows the facts of the current attach (`known`)

States and events (`now` is the driver's monotonic clock):

    NEW ──start()──▶ WAITING                                    send HELLO
    WAITING ──on_tick(now ≥ resend_at)──▶ WAITING               send the same HELLO again
    WAITING ──on_tick(now ≥ deadline)──▶ DONE  TimedOut
    WAITING ──on_key_refused()──▶ DONE  Refused                 (the engine's ZAP said no)
    WAITING ──answer: failure message──▶ DONE  Refused          ATTACH / REATTACH
                                        ──▶ DONE  LetGo         RECHECK
    WAITING ──answer: no facts, or another engine's──▶ DONE  Refused   (a new incarnation
                                                                  bound the same address)
    WAITING ──answer: facts──▶ DONE  Attached                   ATTACH / REATTACH
    WAITING ──answer: facts, the known serial──▶ DONE  StillAttached     RECHECK
    WAITING ──answer: facts, a new serial──▶ DONE  LetGo                 RECHECK
    DONE ──any event──▶ DONE                                    nothing to send, no new outcome

Every step returns a `Step`: frames to send now (if any) and the outcome (once done). A
repeated HELLO carries the same call id: an engine answers a repeated HELLO from the same
connection with the same answer, so a HELLO or answer lost while the connection was being set
up costs one resend (HELLO_RESEND_S). An engine that dies meanwhile is no event here: the
client learns a death from the death notice (`read_notice`), which also fails the pending call.

What an outcome means to a driver:

    Attached       record the facts; the engine is routable (`AttachDriver.settle`)
    StillAttached  nothing changes
    LetGo          the engine no longer had this client attached: what the client had there
                   is lost, and the engine counts as lost (`AttachDriver.let_go`)
    Refused        ATTACH: the engine leaves the set (at construction, the client closes) and
                   the caller gets `EngineAttachError`; REATTACH: the same, or it stays
                   counted dead to be asked again
    TimedOut       as Refused, with `TimeoutError`; for RECHECK, no verdict: a deaf engine is
                   the engine monitor's to find

One recheck policy for every driver: a let-go engine counts as lost. The engine dropped the
requests and calls this client had there, and the client undoes what it kept for them in one
place, its loss path (the death notice through its own output socket): pending calls fail with
`EngineDeadError`, the DP client's router and cache view forget the rank, and whoever may
attach it again does (a cluster link, or the client for an engine it launched). A stats report
that no longer lists the client reaches the same verdict without a HELLO, and the two routes
must agree. The blocking client follows it too, from the caller's thread: it waits until the
loss is told, so that its next send attaches the engine again first and no request sent after
the recheck counts among the lost. A recheck the engine refuses is a let-go as well: the
engine had already dropped the client, then could not take it back.

The notices a client's engine monitor pushes into the client's own output socket are read here
too (`read_notice`): [ENGINE_CORE_DEAD, index] says an engine died or was lost,
[RECHECK_ATTACHED, b""] that the client may have been let go and should recheck.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from shoal.engine.protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreRequestType,
    EngineEndpoint,
    EngineFacts,
    EngineHello,
    UtilityOutput,
)
from shoal.engine.serial import MsgpackEncoder

# How long to wait for an engine's HELLO answer before asking again.
HELLO_RESEND_S = 2.0
# While a HELLO waits: how often a driver looks whether the engine refused this client's key.
KEY_REFUSAL_POLL_S = 0.1
# How long an engine may take to answer the HELLO of a recheck.
RECHECK_TIMEOUT_S = 5.0

# The notice (as [RECHECK_ATTACHED, b""]) that the client may have been let go. As long as
# ENGINE_CORE_DEAD, so one length test tells both notices from engine messages.
RECHECK_ATTACHED = b"RECHECK_ATTACHED"
assert len(RECHECK_ATTACHED) == len(ENGINE_CORE_DEAD)

Frames = tuple[bytes | memoryview, ...]


class Purpose(enum.Enum):
    """Why a HELLO is sent (see the module docstring)."""

    ATTACH = "attach"
    REATTACH = "reattach"
    RECHECK = "recheck"


@dataclass(frozen=True)
class Attached:
    """The engine attached this client (ATTACH, REATTACH)."""

    facts: EngineFacts


@dataclass(frozen=True)
class StillAttached:
    """The engine still counts this client attached, under the same attach (RECHECK)."""

    facts: EngineFacts


@dataclass(frozen=True)
class LetGo:
    """The engine no longer had this client attached (RECHECK).

    `facts` are those of the attach the recheck made (None when it refused the client).
    """

    facts: EngineFacts | None
    evidence: str


@dataclass(frozen=True)
class Refused:
    """The engine refused this client; `reason` is a whole sentence for the caller."""

    reason: str


@dataclass(frozen=True)
class TimedOut:
    """No answer before the deadline."""

    reason: str


Outcome = Attached | StillAttached | LetGo | Refused | TimedOut


@dataclass(frozen=True)
class Step:
    """What a driver does after an event: send `send` (if any) to the engine; `outcome`, once
    set, ends the handshake."""

    send: Frames | None = None
    outcome: Outcome | None = None
    is_resend: bool = False  # `send` repeats a HELLO that is not answered yet


class Handshake:
    """One HELLO exchange with one engine (the module docstring is its state machine).

    Args:
        endpoint: the engine asked.
        hello: the HELLO to send (its `call_id` names the answer).
        purpose: ATTACH, REATTACH or RECHECK.
        known: for RECHECK, the facts of the attach the client knows.
        timeout_s: how long to wait for the answer, from `start`.
        encoder: encodes the HELLO.
    """

    def __init__(
        self,
        endpoint: EngineEndpoint,
        hello: EngineHello,
        purpose: Purpose,
        *,
        timeout_s: float,
        known: EngineFacts | None = None,
        encoder: MsgpackEncoder | None = None,
    ) -> None:
        assert (known is not None) == (purpose is Purpose.RECHECK), "a recheck knows its facts"
        self.endpoint = endpoint
        self.purpose = purpose
        self.known = known
        self._hello = hello
        self._timeout_s = timeout_s
        encoder = encoder or MsgpackEncoder()
        self._frames: Frames = (EngineCoreRequestType.HELLO.value, *encoder.encode(hello))
        self._deadline: float | None = None  # set by start(): WAITING
        self._resend_at = 0.0
        self.outcome: Outcome | None = None  # set once: DONE

    @property
    def call_id(self) -> int:
        return self._hello.call_id

    @property
    def is_done(self) -> bool:
        return self.outcome is not None

    @property
    def deadline(self) -> float:
        """When the answer is due (valid once started)."""
        assert self._deadline is not None, "start() first"
        return self._deadline

    def start(self, now: float) -> Step:
        """NEW → WAITING: the HELLO to send."""
        assert self._deadline is None, "a handshake starts once"
        self._deadline = now + self._timeout_s
        self._resend_at = now + HELLO_RESEND_S
        return Step(send=self._frames)

    def wait_s(self, now: float) -> float:
        """How long a driver may wait for the answer before the next `on_tick` is due."""
        return max(0.0, min(self._resend_at, self.deadline, now + KEY_REFUSAL_POLL_S) - now)

    def on_tick(self, now: float) -> Step:
        """Time passed: the HELLO again when a resend is due; TimedOut past the deadline."""
        if self.outcome is not None:
            return Step()
        if now >= self.deadline:
            return self._finish(
                TimedOut(f"engine {self.endpoint.engine_index} did not answer HELLO in time")
            )
        if now >= self._resend_at:
            self._resend_at = now + HELLO_RESEND_S
            return Step(send=self._frames, is_resend=True)
        return Step()

    def on_key_refused(self) -> Step:
        """The engine refused this client's CURVE key at the connection's handshake."""
        if self.outcome is not None:
            return Step()
        return self._finish(
            Refused(
                f"engine {self.endpoint.engine_index} refused this client's CURVE key at the "
                "handshake: the key was not admitted (a client's key reaches the engines "
                "through the cluster's registry when it attaches)"
            )
        )

    def on_reply(self, output: UtilityOutput) -> Step:
        """The engine's answer, as decoded from the output socket."""
        assert output.call_id == self.call_id, "an answer to another HELLO"
        if output.failure_message is not None:
            return self.on_refusal(output.failure_message)
        return self.on_answer(output.result.result if output.result is not None else None)

    def on_refusal(self, message: str) -> Step:
        """The engine answered with a failure message."""
        if self.outcome is not None:
            return Step()
        if self.purpose is Purpose.RECHECK:
            return self._finish(LetGo(None, f"it refused to attach this client again: {message}"))
        return self._refuse(f"refused this client: {message}")

    def on_answer(self, result: Any) -> Step:
        """The engine answered with a result (the facts, if it is a well-behaved engine)."""
        if self.outcome is not None:
            return Step()
        if not isinstance(result, EngineFacts):
            return self._refuse("sent no facts at HELLO")
        if result.identity != self.endpoint.identity:
            return self._refuse(f"answered HELLO as another engine ({result.identity!r})")
        if self.known is None:
            return self._finish(Attached(result))
        if result.attach_serial == self.known.attach_serial:
            return self._finish(StillAttached(result))
        return self._finish(LetGo(result, "it attached this client afresh"))

    def _refuse(self, what: str) -> Step:
        return self._finish(Refused(f"engine {self.endpoint.engine_index} {what}"))

    def _finish(self, outcome: Outcome) -> Step:
        self.outcome = outcome
        return Step(outcome=outcome)


class HelloMaker:
    """Makes the handshakes of one client: its index, its output address, its wishes.

    Args:
        client_index: the client's index on every engine.
        output_address: where the engines push this client's outputs.
        wants_kv_events: whether the engines send this client their KV events.
    """

    def __init__(self, client_index: int, output_address: str, *, wants_kv_events: bool) -> None:
        self.client_index = client_index
        self.output_address = output_address
        self.wants_kv_events = wants_kv_events
        self._encoder = MsgpackEncoder()

    def handshake(
        self,
        endpoint: EngineEndpoint,
        purpose: Purpose,
        *,
        timeout_s: float,
        known: EngineFacts | None = None,
    ) -> Handshake:
        """A new handshake (NEW) with a fresh call id."""
        hello = EngineHello(
            self.client_index,
            self.output_address,
            uuid.uuid1().int >> 64,
            wants_kv_events=self.wants_kv_events,
        )
        return Handshake(
            endpoint, hello, purpose, timeout_s=timeout_s, known=known, encoder=self._encoder
        )


# --- the notices on the client's own output socket ------------------------------------------


@dataclass(frozen=True)
class DeathNotice:
    """[ENGINE_CORE_DEAD, index]: the engine died, or is lost to this client."""

    engine_index: int


@dataclass(frozen=True)
class RecheckNotice:
    """[RECHECK_ATTACHED, b""]: this client may have been let go; recheck its engines."""


@dataclass(frozen=True)
class MalformedNotice:
    """A death notice that names no engine (no engine or monitor of a client sends that)."""

    detail: bytes


Notice = DeathNotice | RecheckNotice | MalformedNotice


def death_notice(engine_index: int) -> list[bytes]:
    """The frames of a death notice for `engine_index`."""
    return [ENGINE_CORE_DEAD, str(engine_index).encode()]


RECHECK_NOTICE = [RECHECK_ATTACHED, b""]


def read_notice(frames: Sequence[zmq.Frame | bytes]) -> Notice | None:
    """The notice a message of the output socket is, or None for a data message."""
    if len(frames) != 2 or len(frames[0]) != len(ENGINE_CORE_DEAD):
        return None
    kind = _bytes(frames[0])
    if kind == RECHECK_ATTACHED:
        return RecheckNotice()
    if kind != ENGINE_CORE_DEAD:
        return None
    detail = _bytes(frames[1])
    if not detail.isdigit():
        return MalformedNotice(detail)
    return DeathNotice(int(detail))


def _bytes(frame: zmq.Frame | bytes) -> bytes:
    return frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)
