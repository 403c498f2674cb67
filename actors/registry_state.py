"""`RegistryState`: everything the registry keeps, one part per owner, and `StateStore`, where
it is written on every change: the GCS key-value store of the cluster's namespace (as Ray
Serve's controller checkpoints its state), read back by a registry that Ray restarts."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgspec
from ray.experimental import internal_kv

from shoal.actors.membership_table import TableState
from shoal.actors.scale_state import ResizeState
from shoal.engine.config import EngineConfig

logger = logging.getLogger(__name__)

# GCS key-value key (in the cluster's namespace) of the registry's saved state.
STATE_KEY = "shoal-registry-state"


@dataclass
class RegistryState:
    """The membership table's state and the resizes' state, saved as one value."""

    membership: TableState
    resizes: ResizeState = field(default_factory=ResizeState)

    @classmethod
    def new(cls, config: EngineConfig) -> RegistryState:
        return cls(TableState(config=config))


class StateStore:
    """The registry's state in the GCS key-value store of one namespace.

    Args:
        namespace: the cluster's Ray namespace.
    """

    def __init__(self, namespace: str) -> None:
        self._namespace = namespace

    def save(self, state: RegistryState) -> None:
        internal_kv._internal_kv_put(
            STATE_KEY, msgspec.msgpack.encode(state), namespace=self._namespace
        )

    def load(self) -> RegistryState | None:
        """The state the previous incarnation saved, resumed (`TableState.resume`); None when
        there is none."""
        saved = internal_kv._internal_kv_get(STATE_KEY, namespace=self._namespace)
        if saved is None:
            return None
        state = msgspec.msgpack.decode(saved, type=RegistryState)
        state.membership.resume(time.time())
        return state

    def delete(self) -> None:
        """Forgets the saved state (the cluster is stopped for good)."""
        internal_kv._internal_kv_del(STATE_KEY, namespace=self._namespace)
