"""`DataPlane`: what the registry tells the data plane's actors (the engines, the coordinator)
when the membership changes under them: keys admitted and revoked, the coordinator's new address.

A key change is told before the registry's caller goes on (bounded by
`KEY_PROPAGATION_TIMEOUT_S`), so a client attached a moment ago can connect at once. An actor
that fails or is slow is logged and left: it reads the membership when it (re)starts.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ray import ObjectRef

from shoal.actors.engine_liveness import find_actor, find_engine
from shoal.actors.names import COORDINATOR_NAME

if TYPE_CHECKING:
    from shoal.actors.coordinator import CoordinatorHandle
    from shoal.actors.engine_actor import EngineActorHandle

logger = logging.getLogger(__name__)

# How long an attach waits for the serving engines and the coordinator to admit its key.
KEY_PROPAGATION_TIMEOUT_S = 10.0


class DataPlane:
    """The engine actors and the coordinator of one namespace, found by name at each call.

    Args:
        namespace: the cluster's Ray namespace.
    """

    def __init__(self, namespace: str) -> None:
        self._namespace = namespace

    async def admit_engine(self, rank: int, public_key: bytes) -> None:
        """The coordinator takes `rank`'s stats reports under `public_key` from now on."""
        coordinator = self._coordinator()
        if coordinator is not None:
            await _tell([coordinator.admit_engine.remote(rank, public_key)])

    async def admit_client(
        self, engine_names: list[str], client_index: int, public_key: bytes
    ) -> None:
        """The named engines and the coordinator let client `client_index` in."""
        refs = [
            e.admit_client.remote(client_index, public_key) for e in self._engines(engine_names)
        ]
        coordinator = self._coordinator()
        if coordinator is not None:
            refs.append(coordinator.admit_client.remote(client_index, public_key))
        await _tell(refs)

    async def revoke_client(self, engine_names: list[str], client_index: int) -> None:
        """The named engines and the coordinator let client `client_index` go."""
        refs = [e.revoke_client.remote(client_index) for e in self._engines(engine_names)]
        coordinator = self._coordinator()
        if coordinator is not None:
            refs.append(coordinator.revoke_client.remote(client_index))
        await _tell(refs)

    async def redirect_stats(self, engine_names: list[str], report_address: str) -> None:
        """The named engines push their stats reports to `report_address` from now on."""
        refs = [e.set_stats_address.remote(report_address) for e in self._engines(engine_names)]
        for result in await asyncio.gather(*refs, return_exceptions=True):
            if isinstance(result, Exception):  # a dead rank reads the membership on restart
                logger.info("an engine was not told the new stats address: %s", result)

    def _engines(self, names: list[str]) -> list[EngineActorHandle]:
        return [e for name in names if (e := find_engine(name, self._namespace)) is not None]

    def _coordinator(self) -> CoordinatorHandle | None:
        coordinator: CoordinatorHandle | None = find_actor(COORDINATOR_NAME, self._namespace)
        return coordinator


async def _tell(refs: list[ObjectRef[None]]) -> None:
    """Waits (bounded) for every call; one that fails or is slow is logged."""
    if not refs:
        return
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*refs, return_exceptions=True), KEY_PROPAGATION_TIMEOUT_S
        )
    except TimeoutError:
        logger.warning("a key change did not reach every engine in time")
        return
    for result in results:
        if isinstance(result, Exception):
            logger.info("a key change did not reach an actor: %s", result)
