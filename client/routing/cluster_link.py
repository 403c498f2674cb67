"""`ClusterLink`: a DP load-balancing client kept in step with a running cluster's registry.

This is the only part of `client/` that speaks Ray, and only on the control plane: it attaches
(a client index from the registry), long-polls membership changes (which double as the
client's heartbeat), connects to ranks that appear or come back with a new identity (each
HELLO in a task of its own, so a rank that never answers holds up nothing), drops ranks that
leave, and reports ranks this client lost; the registry decides whether they are dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Collection
from typing import Any

import ray

from shoal.actors.membership import Membership, RankState
from shoal.client.routing.lb_client import DPLBAsyncMPClient
from shoal.client.routing.lb_policy import LoadBalancePolicy, make_policy
from shoal.client.routing.migration import DEFAULT_MIGRATION_LIMIT
from shoal.client.transport.connections import EngineAttachError
from shoal.client.transport.engine_client import EngineSetClient
from shoal.cluster import elastic
from shoal.cluster.elastic import ScaleReport
from shoal.cluster.launch import (
    ClusterHandle,
    ClusterNotFoundError,
    is_stopped,
    registry_answers_again,
)
from shoal.cluster.launch import attach as attach_cluster
from shoal.engine.core.curve import CurveKeyPair
from shoal.engine.errors import EngineDeadError, ModelLoadError
from shoal.engine.loader.hub import local_model_config
from shoal.engine.protocol import EngineEndpoint, EngineFacts
from shoal.engine.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

# Long-poll length: also how often the registry hears that this client is alive.
WATCH_POLL_S = 2.0
# How long a rank may leave this client's HELLO unanswered before it is reported lost.
ATTACH_TIMEOUT_S = 10.0
# How long a client may take, after a resize commits, to route over exactly the new set.
CONVERGE_TIMEOUT_S = 30.0
# While waiting for a cluster to be launched or a rank to serve: how often to look.
_READY_POLL_S = 0.2
# How long a plain `shutdown` waits for the registry to note this client's departure.
_DETACH_TIMEOUT_S = 5.0


class ClusterLink:
    """Owns the membership watch of one attached client. Built by `attach`."""

    def __init__(
        self,
        cluster: ClusterHandle,
        client: EngineSetClient,
        membership: Membership,
        client_index: int,
        name: str,
    ) -> None:
        self.cluster = cluster
        self.registry = cluster.registry
        self.client = client
        self.membership = membership
        self.client_index = client_index
        self.name = name
        self._reported_dead: set[bytes] = set()
        self._attaching: dict[int, asyncio.Task[None]] = {}
        # Set when the client loses a rank: the watch reports it without waiting for its poll.
        self._engine_lost = asyncio.Event()
        lost = self._engine_lost  # the client holds the event, not this link
        client.add_engine_lost_listener(lambda _rank: lost.set())
        # An elastic notification: the membership changed, so the watch reads it at once.
        client.add_scale_listener(lambda _kind, _notice: lost.set())
        self._task = asyncio.create_task(self._watch(), name="ClusterMembershipWatch")

    @classmethod
    async def attach(
        cls,
        namespace: str,
        *,
        address: str = "auto",
        host: str | None = None,
        name: str | None = None,
        policy: str | LoadBalancePolicy = "cache-aware",
        ready_timeout_s: float = 0.0,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
    ) -> ClusterLink:
        """Attaches a new `DPLBAsyncMPClient` to the cluster in `namespace`.

        Args:
            policy: the routing policy's name (`shoal.client.routing.lb_policy.make_policy`),
                or a policy object, used as given.
            migration_limit: how often one request may move off a failed rank
                (`shoal.client.routing.migration`); 0: a rank's failure fails its requests.
            ready_timeout_s: how long to wait for the cluster to be launched and for one of
                its ranks to serve (a cluster that is still starting). 0: no wait.

        Raises:
            ClusterNotFoundError: no cluster runs there (within `ready_timeout_s`).
            TimeoutError: the cluster runs, but no rank served within `ready_timeout_s`.
            ValueError: unknown policy name.
        """
        routing_policy = make_policy(policy) if isinstance(policy, str) else policy
        if not ray.is_initialized():
            ray.init(address=address, namespace=namespace, log_to_driver=False)
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                handle = attach_cluster(namespace)
                break
            except ClusterNotFoundError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(_READY_POLL_S)
        membership: Membership = await handle.registry.membership.remote()
        client_name = name or f"{socket.gethostname()}:{os.getpid()}"
        # The data plane admits only keys the registry handed to the cluster's engines and
        # coordinator: this client's is made here, and only its public half travels.
        keys = CurveKeyPair.generate()
        client_index: int = await handle.registry.attach_client.remote(client_name, keys.public)
        try:
            client = DPLBAsyncMPClient(
                [],
                client_index=client_index,
                host=host or ray.util.get_node_ip_address(),
                stats_address=membership.stats_publish_address,
                stats_server_key=membership.coordinator_public_key,
                policy=routing_policy,
                migration_limit=migration_limit,
                hello_timeout_s=ATTACH_TIMEOUT_S,
                curve_keys=keys,
            )
        except BaseException:
            await handle.registry.detach_client.remote(client_index)
            raise
        # Ranks that die come back (Ray restarts them) and are attached again by the watch.
        client.set_engines_can_return(True)
        link = cls(handle, client, membership, client_index, client_name)
        # Every rank that answers is attached before the driver sends anything; one that does
        # not is reported (the registry restarts it if it hangs) and attached when it is back.
        await asyncio.gather(*await link._reconcile(membership))
        if ready_timeout_s > 0:
            try:
                await link._wait_until_serving(deadline)
            except BaseException:
                await link.aclose()
                raise
        return link

    async def _wait_until_serving(self, deadline: float) -> None:
        """Returns once a rank takes this client's requests; the watch attaches ranks as the
        membership lists them ready.

        Raises:
            TimeoutError: none did by `deadline` (`time.monotonic()`).
        """
        while not self.client.lb_engines:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no rank of the cluster in namespace {self.cluster.namespace!r} serves yet"
                )
            await asyncio.sleep(_READY_POLL_S)

    async def load_tokenizer(self) -> Tokenizer:
        """The model's tokenizer: from this node's copy of the checkpoint, or, where this node
        has none (a driver away from the GPU nodes), from a serving rank's.

        Raises:
            ModelLoadError: neither this node nor any serving rank could load it.
        """
        try:
            model = (await asyncio.to_thread(local_model_config, self.membership.config)).model
            return await asyncio.to_thread(load_tokenizer, model.tokenizer or model.model)
        except ModelLoadError as local_error:
            ranks = sorted(self.membership.ranks.values(), key=lambda info: info.rank)
            for info in ranks:
                if not info.is_routable:
                    continue
                with contextlib.suppress(ValueError, ray.exceptions.RayActorError):
                    tokenizer: Tokenizer = await self.cluster.engine(info.rank).tokenizer.remote()
                    logger.info("%s; using rank %d's tokenizer", local_error, info.rank)
                    return tokenizer
            raise

    async def scale(self, new_size: int, **kwargs: Any) -> ScaleReport:
        """Resizes the cluster (`shoal.cluster.elastic.scale`, in a thread), then waits until
        this client routes over exactly the new set of ranks.

        Raises:
            ValueError, ScaleInProgressError, ScaleError: as `scale` raises them.
            TimeoutError: the resize committed, but this client did not attach to every rank
                of the new set in time.
        """
        report = await asyncio.to_thread(
            elastic.scale, self.cluster, new_size, owner=self.name, **kwargs
        )
        self._engine_lost.set()  # read the membership now
        wanted = list(range(new_size))
        deadline = time.monotonic() + CONVERGE_TIMEOUT_S
        while sorted(self.client.lb_engines) != wanted:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"the cluster has {new_size} ranks, but this client routes over "
                    f"{self.client.lb_engines}"
                )
            await asyncio.sleep(_READY_POLL_S / 4)
        return report

    async def is_scaling(self) -> bool:
        """Whether a resize holds the cluster's scale lock now."""
        status: dict[str, Any] = await self.registry.status.remote()
        return status.get("scaling") is not None

    async def aclose(self) -> None:
        """`close`, then shuts the client down."""
        await self.close()
        self.client.shutdown()

    def shutdown(self) -> None:
        """`aclose` without awaiting: from a plain method, with or without a running loop.

        The watch is cancelled on its own loop's thread; detaching waits for the registry
        at most `_DETACH_TIMEOUT_S` (the cluster may be gone).
        """
        for task in (self._task, *self._attaching.values()):
            if task is not None and not task.done() and not task.get_loop().is_closed():
                task.get_loop().call_soon_threadsafe(task.cancel)
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(
                self.registry.detach_client.remote(self.client_index), timeout=_DETACH_TIMEOUT_S
            )
        self.client.shutdown()

    async def close(self) -> None:
        """Stops watching and detaches from the registry; callable from any loop (the tasks of
        one that has closed are over already)."""
        tasks = [t for t in (self._task, *self._attaching.values()) if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(ray.exceptions.RayActorError):  # the cluster may be gone
            await self.registry.detach_client.remote(self.client_index)

    async def _watch(self) -> None:
        """Each turn: a membership change, the poll's timeout, or a rank this client lost."""
        epoch = self.membership.epoch
        poll: asyncio.Future[Membership] | None = None
        try:
            while True:
                if poll is None:
                    poll = asyncio.ensure_future(
                        self.registry.wait_for_change.remote(
                            epoch, WATCH_POLL_S, self.client_index, self.name
                        )
                    )
                lost = asyncio.ensure_future(self._engine_lost.wait())
                try:
                    await asyncio.wait((poll, lost), return_when=asyncio.FIRST_COMPLETED)
                finally:  # also when `close` cancels the watch here
                    lost.cancel()
                self._engine_lost.clear()
                membership = self.membership
                if poll.done():
                    try:
                        polled = poll.result()
                        if polled.epoch >= membership.epoch:  # not older than a turn's reread
                            membership = polled
                    except ray.exceptions.RayActorError:
                        if not await self._registry_returns():
                            return
                        continue  # Ray restarted it; it read its saved state back
                    finally:
                        poll = None
                try:
                    epoch = await self._turn(membership)
                except ray.exceptions.RayActorError:  # the registry died during the turn
                    if not await self._registry_returns():
                        return
        finally:
            if poll is not None:
                poll.cancel()

    async def _registry_returns(self) -> bool:
        """After a registry call failed: whether the registry answers again (Ray restarted it).

        One stopped with its cluster never does. Then no rank comes back either, so requests
        waiting for one fail at once, as do later ones.
        """
        namespace = self.cluster.namespace
        if await asyncio.to_thread(
            registry_answers_again, self.registry, give_up=lambda: is_stopped(namespace)
        ):
            return True
        if await asyncio.to_thread(is_stopped, namespace):
            logger.info("the cluster in namespace %r was stopped", namespace)
        else:
            logger.warning("the cluster registry is gone; no more updates")
        self.client.set_engines_can_return(False)
        return False

    async def _turn(self, membership: Membership) -> int:
        """Reports lost ranks, then follows `membership`. Returns the epoch it followed.

        Raises:
            ray.exceptions.RayActorError: the registry died meanwhile.
        """
        reported, kept = await self._report_lost_engines()
        if reported:  # the registry's probes took time: read the membership again
            membership = await self.registry.membership.remote()
        self.membership = membership
        # A cluster that is stopping, or has no ranks left, has none to bring back: requests
        # fail at once instead of waiting for one.
        self.client.set_engines_can_return(bool(membership.ranks) and not membership.stopping)
        publish_address = membership.stats_publish_address
        if publish_address is not None and publish_address != self.client.stats_address:
            logger.info("the coordinator moved; subscribing at %s", publish_address)
            self.client.set_stats_address(publish_address)
        await self._reconcile(membership, reattach=kept)
        return membership.epoch

    async def _reconcile(
        self, membership: Membership, reattach: Collection[int] = ()
    ) -> list[asyncio.Task[None]]:
        """Brings this client's engine set in line with the membership.

        Drains ranks the membership lists as LEAVING (their requests still stream, or are
        handed over); drops ranks it no longer lists as this client knows them; starts, each
        in a task, a HELLO to every listed rank this client lacks and a repeated HELLO to the
        `reattach` ranks (lost on this client's side only). Returns the tasks it started.
        """
        wanted = {e.engine_index: e for e in membership.routable_endpoints()}
        leaving = {
            rank: info.endpoint.identity
            for rank, info in membership.ranks.items()
            if info.state == RankState.LEAVING and info.endpoint is not None
        }
        for rank, endpoint in self.client.endpoints().items():
            if leaving.get(rank) == endpoint.identity:
                self.client.set_rank_draining(rank, True)
                continue
            current = wanted.get(rank)
            if current is None or current.identity != endpoint.identity:
                logger.info("rank %d left or restarted; detaching", rank)
                self.client.remove_engine(rank)  # fails its HELLO too, if one is pending
            else:  # serving (again: a resize that was rolled back)
                self.client.set_rank_draining(rank, False)
        started = []
        for rank, endpoint in wanted.items():
            hello: Awaitable[EngineFacts]
            if rank in self._attaching:
                continue
            known = self.client.endpoints()
            if rank not in known:
                hello = self.client.add_engine_async(endpoint)
            elif rank in reattach and rank in self.client.dead_ranks():
                hello = self.client.reattach_engine_async(rank)
            else:
                continue
            task = asyncio.create_task(self._attach_rank(endpoint, hello), name=f"Attach{rank}")
            self._attaching[rank] = task
            started.append(task)
        return started

    async def _attach_rank(self, endpoint: EngineEndpoint, hello: Awaitable[EngineFacts]) -> None:
        """One rank's HELLO, off the watch loop: a rank that never answers holds up nothing."""
        rank = endpoint.engine_index
        try:
            await hello
            logger.info("attached rank %d at %s", rank, endpoint.input_address)
        except TimeoutError:
            logger.warning("rank %d did not answer HELLO; reporting it to the registry", rank)
            with contextlib.suppress(ray.exceptions.RayActorError):
                await self.registry.report_engine_lost.remote(rank, endpoint.identity)
        except (EngineAttachError, EngineDeadError) as e:
            logger.warning("could not attach rank %d: %s", rank, e)
        finally:
            if self._attaching.get(rank) is asyncio.current_task():
                del self._attaching[rank]

    async def _report_lost_engines(self) -> tuple[bool, list[int]]:
        """Tells the registry of the ranks this client lost since it last looked.

        The registry probes each one and keeps those whose engine answers (this client's
        connection was at fault); this client then says HELLO to them again.

        Returns:
            Whether it reported any, and the ranks the registry kept.
        """
        reported, kept = False, list[int]()
        endpoints = self.client.endpoints()
        leaving = {r for r, i in self.membership.ranks.items() if i.state == RankState.LEAVING}
        for rank in self.client.dead_ranks():
            endpoint = endpoints.get(rank)
            if endpoint is None or endpoint.identity in self._reported_dead or rank in leaving:
                continue  # a leaving rank's end is expected
            reported = True
            self._reported_dead.add(endpoint.identity)
            try:
                is_kept = await self.registry.report_engine_lost.remote(rank, endpoint.identity)
            except ray.exceptions.RayActorError:  # the registry is restarting: next turn
                self._reported_dead.discard(endpoint.identity)
                break
            if is_kept:
                logger.warning("rank %d is lost to this client only; attaching again", rank)
                self._reported_dead.discard(endpoint.identity)
                kept.append(rank)
        return reported, kept
