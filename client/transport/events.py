"""The events a client's parts meet by: engine added / removed / dead, outputs, stats, notices.

A part that must act when something happens to the engines subscribes to the event instead of
overriding a method of the client: the router forgets a dead rank, the KV index indexes a rank
that attached, the cluster link rereads the membership. Listeners run in the order they
subscribed, synchronously, in the thread or task that emits. An event holds a bound method
weakly, so the client's output task, which holds the events, never keeps the client alive;
a listener that is a plain function is held as it is, and must not hold the client itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, ParamSpec

from shoal.engine.protocol import EngineCoreOutputs, EngineFacts, SchedulerStats

P = ParamSpec("P")


class Event(Generic[P]):
    """Listeners of one kind of happening, called in the order they subscribed (those that
    asked to go last after all the others)."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[], Callable[..., None] | None]] = []
        self._last: list[Callable[[], Callable[..., None] | None]] = []
        self._all: tuple[Callable[[], Callable[..., None] | None], ...] = ()  # in call order

    def subscribe(self, listener: Callable[P, None], *, last: bool = False) -> None:
        """Adds a listener: a bound method is held weakly (it goes with its object)."""
        if hasattr(listener, "__self__") and hasattr(listener, "__func__"):
            ref: Callable[[], Callable[..., None] | None] = weakref.WeakMethod(listener)
        else:
            ref = _Strong(listener)
        (self._last if last else self._listeners).append(ref)
        self._all = (*self._listeners, *self._last)

    def emit(self, *args: P.args, **kwargs: P.kwargs) -> None:
        for ref in self._all:
            listener = ref()
            if listener is not None:
                listener(*args, **kwargs)


class _Strong:
    """A listener held as it is, behind the same call as a weak one."""

    __slots__ = ("_listener",)

    def __init__(self, listener: Callable[..., None]) -> None:
        self._listener = listener

    def __call__(self) -> Callable[..., None]:
        return self._listener


@dataclass
class ClientEvents:
    """What happens to one client's engines, as its parts hear it.

    Attributes:
        engine_added: (index, facts) an engine answered HELLO: attached, or attached again.
        engine_removed: (index, was_dead) an engine left the set on purpose.
        engine_dead: (index) the output consumer learned of a death that does not end the
            client (the engine may come back, or others serve on); before any consumer runs.
        outputs: (outputs) a frame of an engine's outputs, before it is queued; a listener may
            replace `outputs.outputs` (the router drops those of moved requests).
        stats: (rank, stats, requests_seen) a rank's load, measured after it had taken in
            `requests_seen` of this client's requests.
        scale_notice: (notification) an elastic notification (`EEP_NOTIFICATION_CALL_ID`).
    """

    engine_added: Event[[int, EngineFacts]] = field(default_factory=Event)
    engine_removed: Event[[int, bool]] = field(default_factory=Event)
    engine_dead: Event[[int]] = field(default_factory=Event)
    outputs: Event[[EngineCoreOutputs]] = field(default_factory=Event)
    stats: Event[[int, SchedulerStats, int]] = field(default_factory=Event)
    scale_notice: Event[[Sequence[Any]]] = field(default_factory=Event)


class AsyncEvent(Generic[P]):
    """Like `Event`, for listeners that are coroutines: `emit` awaits each in turn. Its
    listeners are held as they are (only a task that runs for the client emits it)."""

    def __init__(self) -> None:
        self._listeners: list[Callable[P, Awaitable[None]]] = []

    def subscribe(self, listener: Callable[P, Awaitable[None]]) -> None:
        self._listeners.append(listener)

    async def emit(self, *args: P.args, **kwargs: P.kwargs) -> None:
        for listener in list(self._listeners):
            await listener(*args, **kwargs)
