"""`EngineSet`: the one place a client keeps which engines it has, and what it knows of each.

For every engine index the set holds its endpoint, the facts of the current attach, the
process this client launched for it (if any), and its liveness. An engine moves through:

    attach()            → ATTACHING   connected, HELLO sent, no facts yet
    mark_attached()     → ATTACHED    HELLO answered: routable
    set_draining()      → DRAINING    leaving the cluster (an elastic scale-down): its requests
                                      still stream, new ones go elsewhere
    learn_death()       → DEAD        it sent ENGINE_CORE_DEAD, the monitor declared it lost, or
                                      it let this client go; `may_return` says whether it can
                                      come back (`ReturnPolicy`): then a new HELLO
                                      (`begin_reattach`, then `mark_attached`) makes it
                                      ATTACHED again
                        → GONE        dead and unable to return (told to the consumer once)
    remove()            → (absent)    detached on purpose, from any state

Whoever changes the set goes through these methods (the client's connections, attach driver
and output loop), and emits what the change means to the other parts as the client's events
(`shoal.client.transport.events`); everything else only asks. It is safe
to ask from the engine monitor's and the output thread's threads: every method that changes
the engines, or walks them, holds the set's lock; the lookups of one engine (`endpoint`,
`facts`, `process`, `index_of`, `is_dead`), the return policy's two flags and `in` take none:
each is one
dict read or one attribute read or write, which the interpreter does whole, and reads a value
that only a locked change replaces.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

from shoal.engine.errors import EngineDeadError
from shoal.engine.protocol import EngineEndpoint, EngineFacts

EngineIdentity = bytes  # an engine's ROUTER routing id


@dataclass
class ReturnPolicy:
    """Whether an engine counted dead may be attached again, and so whether a death is final.

    Attributes:
        engines_can_return: someone attaches dead engines again (a cluster link, whose ranks
            Ray restarts, while its cluster runs and lists ranks): then no death is terminal.
        reattaches_launched: this client attaches again, for as long as its process lives,
            an engine it launched and lost.
    """

    engines_can_return: bool = False
    reattaches_launched: bool = False

    def allows(self, process: BaseProcess | None) -> bool:
        """Whether an engine counted dead, launched as `process` (None: not by this client),
        may come back."""
        if self.engines_can_return:
            return True
        return self.reattaches_launched and process is not None and process.exitcode is None


@dataclass
class _Engine:
    endpoint: EngineEndpoint
    process: BaseProcess | None = None  # launched by this client
    facts: EngineFacts | None = None  # of the current attach
    is_dead: bool = False
    is_gone: bool = False  # dead, and the consumer was told it cannot return
    is_draining: bool = False  # leaving: takes no new requests


class EngineSet:
    """The engines one client is attached to (see the module docstring for the states).

    Args:
        engines_can_return: the return policy's first flag (`ReturnPolicy`).
    """

    def __init__(self, *, engines_can_return: bool = False) -> None:
        self._lock = threading.Lock()
        self._engines: dict[int, _Engine] = {}
        self._index_of: dict[EngineIdentity, int] = {}
        self.returns = ReturnPolicy(engines_can_return)

    # --- what the set says ------------------------------------------------------------------

    def __contains__(self, engine_index: object) -> bool:
        return engine_index in self._engines

    def indices(self) -> list[int]:
        """Every engine index in the set, sorted."""
        with self._lock:
            return sorted(self._engines)

    def endpoint(self, engine_index: int) -> EngineEndpoint | None:
        entry = self._engines.get(engine_index)
        return entry.endpoint if entry is not None else None

    def endpoints(self) -> dict[int, EngineEndpoint]:
        with self._lock:
            return {i: e.endpoint for i, e in sorted(self._engines.items())}

    def facts(self, engine_index: int) -> EngineFacts | None:
        entry = self._engines.get(engine_index)
        return entry.facts if entry is not None else None

    def process(self, engine_index: int) -> BaseProcess | None:
        """The process this client launched for an engine (None: not launched by it)."""
        entry = self._engines.get(engine_index)
        return entry.process if entry is not None else None

    def index_of(self, identity: EngineIdentity) -> int | None:
        return self._index_of.get(identity)

    def is_dead(self, engine_index: int) -> bool:
        entry = self._engines.get(engine_index)
        return entry is not None and entry.is_dead

    def dead(self) -> list[int]:
        """The engines counted dead, sorted."""
        with self._lock:
            return sorted(i for i, e in self._engines.items() if e.is_dead)

    def routable(self) -> list[int]:
        """The engines that take requests now: attached (facts known), not dead, not
        draining, sorted."""
        with self._lock:
            return sorted(
                i
                for i, e in self._engines.items()
                if e.facts is not None and not e.is_dead and not e.is_draining
            )

    def attached_facts(self) -> dict[int, tuple[EngineEndpoint, EngineFacts]]:
        """Each live attached engine with the facts of this client's attach there."""
        with self._lock:
            return {
                i: (e.endpoint, e.facts)
                for i, e in self._engines.items()
                if e.facts is not None and not e.is_dead
            }

    def may_return(self, engine_index: int) -> bool:
        """Whether an engine counted dead may be attached again (`ReturnPolicy`)."""
        return self.returns.allows(self.process(engine_index))

    def is_terminal(self, dead: EngineDeadError) -> bool:
        """Whether this death ends the client's output stream for good: every engine is dead
        and none may come back. A set left empty (its last engine removed, say after a failed
        HELLO) ends it only when no engine may be attached again."""
        if dead.engine_index is None:
            return True
        with self._lock:
            indices = list(self._engines)
        if not indices:
            return not self.returns.engines_can_return
        return all(self.is_dead(i) and not self.may_return(i) for i in indices)

    # --- how the set changes -----------------------------------------------------------------

    def attach(self, endpoint: EngineEndpoint, process: BaseProcess | None = None) -> None:
        """Adds an engine being attached (ATTACHING).

        Raises:
            ValueError: an engine with this index is already in the set.
        """
        index = endpoint.engine_index
        with self._lock:
            if index in self._engines:
                raise ValueError(f"engine {index} is already attached; remove it first")
            self._engines[index] = _Engine(endpoint, process)
            self._index_of[endpoint.identity] = index

    def mark_attached(self, engine_index: int, facts: EngineFacts) -> None:
        """Records the facts of an answered HELLO (ATTACHING, or DEAD asked again → ATTACHED)."""
        with self._lock:
            entry = self._engines.get(engine_index)
            if entry is not None:
                entry.facts = facts
                entry.is_dead = entry.is_gone = False

    def begin_reattach(self, engine_index: int) -> None:
        """A dead engine is asked HELLO again: the facts of the attach that ended go, so that
        nothing compares against them until the answer brings new ones."""
        with self._lock:
            entry = self._engines.get(engine_index)
            if entry is not None:
                entry.facts = None

    def set_draining(self, engine_index: int, is_draining: bool = True) -> None:
        """Stops (or, for a resize rolled back, resumes) routing new requests to an engine."""
        with self._lock:
            entry = self._engines.get(engine_index)
            if entry is not None:
                entry.is_draining = is_draining

    def learn_death(self, engine_index: int) -> bool:
        """Records that an engine is dead.

        Returns:
            Whether that is news to tell the consumer: the first notice of this death, or the
            later one that an engine counted dead can no longer come back.
        """
        with self._lock:
            entry = self._engines.get(engine_index)
            if entry is None:
                return False  # an engine this client removed (a stop, say) saying goodbye
            if entry.is_dead and (entry.is_gone or self.returns.allows(entry.process)):
                return False
            entry.is_dead = True
            if not self.returns.allows(entry.process):
                entry.is_gone = True
            return True

    def remove(self, engine_index: int) -> tuple[EngineEndpoint, BaseProcess | None, bool]:
        """Takes an engine out of the set.

        Returns:
            Its endpoint, the process this client launched for it, and whether it was
            counted dead.

        Raises:
            ValueError: no engine with this index is in the set.
        """
        with self._lock:
            entry = self._engines.pop(engine_index, None)
            if entry is None:
                raise ValueError(f"engine {engine_index} is not attached")
            self._index_of.pop(entry.endpoint.identity, None)
            return entry.endpoint, entry.process, entry.is_dead
