"""`EngineSet`: the one place a client keeps which engines it has, and what it knows of each.

For every engine index the set holds its endpoint, the facts of the current attach, the
process this client launched for it (if any), and its liveness. An engine moves through:

    attach()            → ATTACHING   connected, HELLO sent, no facts yet
    set_facts()         → ATTACHED    HELLO answered: routable
    set_draining()      → DRAINING    leaving the cluster (an elastic scale-down): its requests
                                      still stream, new ones go elsewhere
    learn_death()       → DEAD        it sent ENGINE_CORE_DEAD, the monitor declared it lost, or
                                      it let this client go; `may_return` says whether it can
                                      come back: then a new HELLO (`begin_reattach`, then
                                      `set_facts` + `mark_alive`) makes it ATTACHED again
                        → GONE        dead and unable to return (told to the consumer once)
    remove()            → (absent)    detached on purpose, from any state

Whoever changes the set goes through these methods; the client classes hook what a change
means to them (routing, pending calls) around them, and everything else only asks. It is safe
to ask from the engine monitor's and the output thread's threads: every method that changes
the engines, or walks them, holds the set's lock; the lookups of one engine (`endpoint`,
`facts`, `index_of`, `is_dead`, `is_draining`, `is_key_refused`), the two flags
(`set_engines_can_return`, `reattach_launched_engines`) and `len` / `in` take none: each is one
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
        engines_can_return: whether engines counted dead may be attached again by someone
            (a cluster link, whose ranks Ray restarts); then no death is terminal.
    """

    def __init__(self, *, engines_can_return: bool = False) -> None:
        self._lock = threading.Lock()
        self._engines: dict[int, _Engine] = {}
        self._index_of: dict[EngineIdentity, int] = {}
        self._engines_can_return = engines_can_return
        # Whether this client attaches again, while its process lives, an engine it launched.
        self._reattaches_launched = False
        # Engines that refused this client's key at the CURVE handshake (the engine monitor
        # sees it), until they are attached afresh.
        self._key_refused: set[int] = set()

    # --- what the set says ------------------------------------------------------------------

    def __contains__(self, engine_index: object) -> bool:
        return engine_index in self._engines

    def __len__(self) -> int:
        return len(self._engines)

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

    def index_of(self, identity: EngineIdentity) -> int | None:
        return self._index_of.get(identity)

    def index_of_address(self, input_address: str) -> int | None:
        """The engine connected at `input_address` (the engine monitor's lookup)."""
        with self._lock:
            for index, entry in self._engines.items():
                if entry.endpoint.input_address == input_address:
                    return index
        return None

    def is_dead(self, engine_index: int) -> bool:
        entry = self._engines.get(engine_index)
        return entry is not None and entry.is_dead

    def dead(self) -> list[int]:
        """The engines counted dead, sorted."""
        with self._lock:
            return sorted(i for i, e in self._engines.items() if e.is_dead)

    def live(self) -> list[int]:
        """The engines not counted dead (attached or attaching), sorted."""
        with self._lock:
            return sorted(i for i, e in self._engines.items() if not e.is_dead)

    def routable(self) -> list[int]:
        """The engines that take requests now: attached (facts known), not dead, not
        draining, sorted."""
        with self._lock:
            return sorted(
                i
                for i, e in self._engines.items()
                if e.facts is not None and not e.is_dead and not e.is_draining
            )

    def note_key_refused(self, engine_index: int) -> None:
        """The engine refused this client's key at the handshake (it was never admitted)."""
        with self._lock:
            self._key_refused.add(engine_index)

    def is_key_refused(self, engine_index: int) -> bool:
        return engine_index in self._key_refused

    def is_draining(self, engine_index: int) -> bool:
        entry = self._engines.get(engine_index)
        return entry is not None and entry.is_draining

    def set_draining(self, engine_index: int, is_draining: bool = True) -> None:
        """Stops (or, for a resize rolled back, resumes) routing new requests to an engine."""
        with self._lock:
            entry = self._engines.get(engine_index)
            if entry is not None:
                entry.is_draining = is_draining

    def attached_facts(self) -> dict[int, tuple[EngineEndpoint, EngineFacts]]:
        """Each live attached engine with the facts of this client's attach there."""
        with self._lock:
            return {
                i: (e.endpoint, e.facts)
                for i, e in self._engines.items()
                if e.facts is not None and not e.is_dead
            }

    def process(self, engine_index: int) -> BaseProcess | None:
        entry = self._engines.get(engine_index)
        return entry.process if entry is not None else None

    def processes(self) -> list[BaseProcess]:
        """The engine processes this client launched (and must stop when it closes)."""
        with self._lock:
            return [e.process for e in self._engines.values() if e.process is not None]

    @property
    def engines_can_return(self) -> bool:
        return self._engines_can_return

    def may_return(self, engine_index: int) -> bool:
        """Whether an engine counted dead may be attached again."""
        if self._engines_can_return:
            return True
        process = self.process(engine_index)
        return self._reattaches_launched and process is not None and process.exitcode is None

    def is_terminal(self, dead: EngineDeadError) -> bool:
        """Whether this death ends the client's output stream for good: every engine is dead
        and none may come back. A set left empty (its last engine removed, say after a failed
        HELLO) ends it only when no engine may be attached again."""
        if dead.engine_index is None:
            return True
        with self._lock:
            indices = list(self._engines)
        if not indices:
            return not self._engines_can_return
        return all(self.is_dead(i) and not self.may_return(i) for i in indices)

    # --- how the set changes -----------------------------------------------------------------

    def set_engines_can_return(self, can_return: bool) -> None:
        """Whether someone attaches dead engines again (a cluster link, while its cluster
        runs and lists ranks)."""
        self._engines_can_return = can_return

    def reattach_launched_engines(self) -> None:
        """This client attaches again, for as long as its process lives, an engine it launched
        and lost."""
        self._reattaches_launched = True

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
            self._key_refused.discard(index)

    def set_facts(self, engine_index: int, facts: EngineFacts) -> None:
        """Records the facts of an answered HELLO (ATTACHING → ATTACHED)."""
        with self._lock:
            entry = self._engines.get(engine_index)
            if entry is not None:
                entry.facts = facts

    def begin_reattach(self, engine_index: int) -> None:
        """A dead engine is asked HELLO again: the facts of the attach that ended go, so that
        nothing compares against them until the answer brings new ones."""
        with self._lock:
            entry = self._engines.get(engine_index)
            if entry is not None:
                entry.facts = None

    def mark_alive(self, engine_index: int) -> None:
        """An engine counted dead answered HELLO again (DEAD → ATTACHED)."""
        with self._lock:
            entry = self._engines.get(engine_index)
            if entry is not None:
                entry.is_dead = entry.is_gone = False

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
            if entry.is_dead and (entry.is_gone or self._may_return_locked(entry)):
                return False
            entry.is_dead = True
            if not self._may_return_locked(entry):
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

    def _may_return_locked(self, entry: _Engine) -> bool:
        if self._engines_can_return:
            return True
        process = entry.process
        return self._reattaches_launched and process is not None and process.exitcode is None
