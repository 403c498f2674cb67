"""`ClusterOwnerActor`: the process that creates a cluster's ranks, so they live as the cluster
lives, whichever driver launched or resized it.

Ray ties a non-detached actor or placement group to the process that created it. A rank added
by a resize from a notebook, `shoal scale` or a second front end would otherwise end with that
process. Instead every rank's placement group and engine actor are created here: in the
launching job's own actor (a detached one for a detached cluster), which does nothing else and
so ends only with its job, or with `shoal stop`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import ray
from ray.actor import ActorProxy


class ClusterOwnerActor:
    """Runs the cluster layer's create calls in the owning process (a plain sync actor), and
    holds the handles of the actors they create: Ray ends an actor once no handle to it is
    left, so the owner keeps one for as long as the rank lives."""

    def __init__(self) -> None:
        self._held: dict[str, Any] = {}

    @ray.method
    def run(self, create: Callable[..., Any], args: tuple[Any, ...], keep_as: str | None) -> Any:
        """Calls `create(*args)` here and returns its result (the handles of what it created,
        owned by this process); with `keep_as`, also holds it under that name."""
        result = create(*args)
        if keep_as is not None:
            self._held[keep_as] = result
        return result

    @ray.method
    def release(self, name: str) -> None:
        """Drops a held handle (its actor was removed)."""
        self._held.pop(name, None)


# What callers hold: Ray's typed proxy, so mypy checks every `.remote` call's method,
# arguments and result against ClusterOwnerActor.
OwnerHandle: TypeAlias = ActorProxy[ClusterOwnerActor]
