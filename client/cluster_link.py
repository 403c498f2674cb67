"""`ClusterLink`: a DP load-balancing client kept in step with a running cluster's registry.

This is the only part of `client/` that speaks Ray, and only on the control plane: it attaches
(a client index from the registry), long-polls membership changes (which double as the
client's heartbeat), connects to ranks that appear or come back with a new identity, drops
ranks that leave, and reports ranks this client saw die.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

import ray
from ray.actor import ActorHandle

from actors.registry import Membership
from client.dp_client import DPLBAsyncMPClient
from client.lb_policy import POLICIES
from client.mp_client import EngineAttachError
from cluster.launch import attach as attach_cluster
from cluster.launch import registry_answers_again
from engine.errors import EngineDeadError

logger = logging.getLogger(__name__)

# Long-poll length: also how often the registry hears that this client is alive.
WATCH_POLL_S = 2.0


class ClusterLink:
    """Owns the membership watch of one attached client. Built by `attach`."""

    def __init__(
        self,
        registry: ActorHandle,
        client: DPLBAsyncMPClient,
        membership: Membership,
        client_index: int,
    ) -> None:
        self.registry = registry
        self.client = client
        self.membership = membership
        self.client_index = client_index
        self._reported_dead: set[bytes] = set()
        self._task = asyncio.create_task(self._watch(), name="ClusterMembershipWatch")

    @classmethod
    async def attach(
        cls,
        namespace: str,
        *,
        address: str = "auto",
        host: str | None = None,
        name: str | None = None,
        policy: str = "least_loaded",
    ) -> ClusterLink:
        """Attaches a new `DPLBAsyncMPClient` to the cluster in `namespace`.

        Raises:
            ClusterNotFoundError: no cluster runs there.
            ValueError: unknown policy name.
        """
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")
        if not ray.is_initialized():
            ray.init(address=address, namespace=namespace, log_to_driver=False)
        handle = attach_cluster(namespace)
        membership: Membership = await handle.registry.membership.remote()
        client_name = name or f"{socket.gethostname()}:{os.getpid()}"
        client_index: int = await handle.registry.attach_client.remote(client_name)
        try:
            client = DPLBAsyncMPClient(
                membership.routable_endpoints(),
                client_index=client_index,
                host=host or ray.util.get_node_ip_address(),
                stats_address=membership.stats_publish_address,
                policy=POLICIES[policy](),
            )
        except BaseException:
            await handle.registry.detach_client.remote(client_index)
            raise
        # Ranks that die come back (Ray restarts them) and are attached again by the watch.
        client.resources.engines_can_return = True
        return cls(handle.registry, client, membership, client_index)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(ray.exceptions.RayActorError):  # the cluster may be gone
            await self.registry.detach_client.remote(self.client_index)

    async def _watch(self) -> None:
        epoch = self.membership.epoch
        while True:
            try:
                membership: Membership = await self.registry.wait_for_change.remote(
                    epoch, WATCH_POLL_S, self.client_index
                )
            except ray.exceptions.RayActorError:
                if await asyncio.to_thread(registry_answers_again, self.registry):
                    continue  # Ray restarted it; it read its saved state back
                logger.warning("the cluster registry is gone; no more membership updates")
                return
            epoch, self.membership = membership.epoch, membership
            await self._report_dead_engines()
            await self._reconcile(membership)

    async def _reconcile(self, membership: Membership) -> None:
        wanted = {e.engine_index: e for e in membership.routable_endpoints()}
        for rank, endpoint in list(self.client.engines.items()):
            current = wanted.get(rank)
            if current is None or current.identity != endpoint.identity:
                logger.info("rank %d left or restarted; detaching", rank)
                self.client.remove_engine(rank)
        for rank, endpoint in wanted.items():
            if rank in self.client.engines:
                continue
            try:
                await self.client.add_engine_async(endpoint)
                logger.info("attached rank %d at %s", rank, endpoint.input_address)
            except (EngineAttachError, EngineDeadError, TimeoutError) as e:
                logger.warning("could not attach rank %d: %s", rank, e)

    async def _report_dead_engines(self) -> None:
        for rank in list(self.client.resources.dead_engines):
            endpoint = self.client.engines.get(rank)
            if endpoint is None or endpoint.identity in self._reported_dead:
                continue
            self._reported_dead.add(endpoint.identity)
            await self.registry.report_engine_dead.remote(rank, endpoint.identity)
