"""`RegistryActor`: the cluster's source of truth for membership, endpoints, epochs and clients.

One named actor per namespace. Engines register their own ZMQ endpoints; the registry watches
each registered engine actor and marks its rank DEAD the moment the actor dies, and when a
client reports an engine lost it probes the actor and restarts it if it hangs
(`actors/engine_liveness.py`). Clients read
the membership and long-poll `wait_for_change` to learn of restarts and resizes. Control plane
only: nothing here is on the per-request path, and it knows nothing of placement groups.

Resizes (the scale lock, each resize's phase and commit) are its methods in
`shoal.actors.registry_resizes`; its state is `shoal.actors.registry_state.RegistryState`.

Restarts: every change is written to the GCS key-value store (as Ray Serve's controller
checkpoints its state), and a registry that Ray restarts reads it back: ranks, endpoints,
clients and the next client index survive, the epoch moves on so every long-poller sees a
change, and each registered engine is watched again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, TypeAlias

import msgspec
import ray
from ray.actor import ActorProxy
from ray.experimental import internal_kv

from shoal.actors.engine_liveness import (
    ENGINE_PROBE_TIMEOUT_S,
    Liveness,
    find_actor,
    find_engine,
    probe_engine,
    restart_engine,
    watch_engine,
)
from shoal.actors.membership import ClientInfo, Membership, RankInfo, RankState
from shoal.actors.names import COORDINATOR_NAME
from shoal.actors.registry_resizes import ResizeMethods, scaling_status
from shoal.actors.registry_state import RegistryState
from shoal.actors.rendezvous import RendezvousServer
from shoal.engine.config import EngineConfig
from shoal.engine.protocol import EngineEndpoint

logger = logging.getLogger(__name__)

# GCS key-value key (in the cluster's namespace) of the registry's saved state.
STATE_KEY = "shoal-registry-state"

# Rank states whose engine is registered and alive (clients may hold it; the actor is watched).
_SERVING = (RankState.READY, RankState.JOINING, RankState.LEAVING)
# A client that has not long-polled or heartbeated for this long is pruned.
CLIENT_TIMEOUT_S = 30.0
# How long an attach waits for the serving engines and the coordinator to admit its key.
KEY_PROPAGATION_TIMEOUT_S = 10.0


class RegistryActor(ResizeMethods):
    """Async Ray actor: all methods run on one event loop, so state needs no locks.

    Args:
        namespace: the Ray namespace the cluster lives in (engine actors are looked up there).
        config: the engine configuration every rank is built from.
        detached: whether the cluster outlives the driver that launched it.
        client_timeout_s: a client silent for this long is pruned.
        engine_probe_timeout_s: an engine reported lost that does not answer a health probe
            within this long is restarted.
    """

    def __init__(
        self,
        namespace: str,
        config: EngineConfig,
        detached: bool = False,
        client_timeout_s: float = CLIENT_TIMEOUT_S,
        engine_probe_timeout_s: float = ENGINE_PROBE_TIMEOUT_S,
    ) -> None:
        self.namespace = namespace
        self.detached = detached
        self.client_timeout_s = client_timeout_s
        self.engine_probe_timeout_s = engine_probe_timeout_s
        self._state = RegistryState(config=config)
        self._changed = asyncio.Event()
        self._watchers: dict[int, asyncio.Task[None]] = {}
        self._probes: dict[bytes, asyncio.Task[bool]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._rendezvous: RendezvousServer | None = None
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self._restore()
        self._save()

    # --- membership ------------------------------------------------------------------------

    @ray.method
    async def plan_rank(
        self,
        rank: int,
        actor_name: str,
        placement_group_name: str,
        registration_digest: bytes,
    ) -> int:
        """Records a rank the cluster is creating (state STARTING); only the actor holding
        the token of `registration_digest` (`membership.registration_token`) may register it.

        Returns:
            The new epoch.
        """
        names = (actor_name, placement_group_name)
        self._set_rank(
            RankInfo(rank, RankState.STARTING, *names, registration_digest=registration_digest)
        )
        return self._bump()

    @ray.method
    async def register_engine(
        self, endpoint: EngineEndpoint, node_ip: str, registration_token: bytes
    ) -> int:
        """Called by an engine actor once its sockets are bound (again after every restart).

        The rank becomes READY (a LEAVING rank stays LEAVING, and a rank that an
        expert-parallel resize started is JOINING until the resize commits) and its actor is watched from
        now on: when the actor dies, the rank turns DEAD.

        Returns:
            The rank's new incarnation number.

        Raises:
            KeyError: if the rank was never planned (or has been removed).
            PermissionError: the token is not the one the rank's own actor holds (an actor
                the cluster did not start): nothing changes, and the real actor can still
                register.
        """
        rank = endpoint.engine_index
        if rank not in self._state.ranks:
            raise KeyError(f"rank {rank} is not planned in namespace {self.namespace!r}")
        info = self._state.ranks[rank]
        if not info.admits_registration(registration_token):
            raise PermissionError(f"rank {rank}: a registration its engine actor did not make")
        state = RankState.READY
        if info.state == RankState.LEAVING:
            state = RankState.LEAVING
        elif (plan := self._joining_plan(rank)) is not None and plan.expert_to_rank is not None:
            state = RankState.JOINING  # routable once its resize commits
        incarnation = info.incarnation + 1
        self._set_rank(
            replace(info, state=state, incarnation=incarnation, endpoint=endpoint, node_ip=node_ip)
        )
        self._bump()
        self._watch(rank, info.actor_name, endpoint.identity)
        if endpoint.public_key:  # its stats reports are taken from now on
            await self._tell_data_plane(
                [], lambda actor: actor.admit_engine.remote(rank, endpoint.public_key)
            )
        return incarnation

    @ray.method
    async def report_engine_lost(self, rank: int, identity: bytes) -> bool:
        """A client lost its connection to the incarnation `identity` of `rank`.

        One client's word does not take a rank away from every client: the fault may be that
        client's own connection. The registry asks the actor itself (`probe_engine`); an engine
        that answers as `identity` stays READY. One that does not answer in time is hung (a
        stopped process, a stuck kernel): it is marked DEAD and killed, and Ray starts it again
        under a new identity. One whose actor is gone is marked DEAD. Reports about an older
        incarnation, or a rank already DEAD, change nothing; concurrent reports about one
        incarnation share one probe.

        Returns:
            True if the registry keeps that incarnation serving (it answered): the client
            should say HELLO to it again. False: it is gone; the membership says what replaces
            it.
        """
        if not self._is_serving(rank, identity):
            return False
        probe = self._probes.get(identity)
        if probe is None:
            probe = asyncio.get_running_loop().create_task(
                self._probe_reported_engine(rank, identity)
            )
            self._probes[identity] = probe
            probe.add_done_callback(lambda _: self._probes.pop(identity, None))
        return await asyncio.shield(probe)

    @ray.method
    async def set_rank_leaving(self, rank: int) -> int:
        """Marks a rank as leaving (clients stop routing to it). Returns the new epoch.

        Raises:
            KeyError: if the rank is unknown.
        """
        self._set_rank(replace(self._state.ranks[rank], state=RankState.LEAVING))
        return self._bump()

    @ray.method
    async def remove_rank(self, rank: int) -> int:
        """Forgets a rank (after its actor and placement group are gone). Returns the new epoch."""
        self._state.ranks.pop(rank, None)
        watcher = self._watchers.pop(rank, None)
        if watcher is not None:
            watcher.cancel()
        return self._bump()

    @ray.method
    async def set_coordinator(
        self, report_address: str, publish_address: str, public_key: bytes | None
    ) -> int:
        """Records the coordinator's addresses. Returns the new epoch.

        A coordinator that restarted on new addresses is followed: every planned rank's engine
        is told where to push its reports (a rank still starting hears it once its constructor
        is done; one that starts later reads the membership), and clients see the new publish
        address in the membership.
        """
        previous = self._state.stats_report_address
        self._state.stats_report_address = report_address
        self._state.stats_publish_address = publish_address
        if public_key is not None:
            self._state.coordinator_public_key = public_key
        if previous is not None and previous != report_address:
            task = asyncio.get_running_loop().create_task(self._redirect_stats(report_address))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return self._bump()

    @ray.method
    async def membership(self) -> Membership:
        """The current membership (a copy)."""
        return self._membership()

    def _membership(self) -> Membership:
        s = self._state
        return Membership(
            epoch=s.epoch,
            ranks=dict(s.ranks),
            config=s.config,
            stats_publish_address=s.stats_publish_address,
            stats_report_address=s.stats_report_address,
            stopping=s.stopping,
            coordinator_public_key=s.coordinator_public_key,
            client_keys=dict(s.client_keys),
        )

    @ray.method
    async def wait_for_change(
        self,
        known_epoch: int,
        timeout_s: float,
        client_index: int | None,
        client_name: str | None,
    ) -> Membership:
        """Long-poll: returns as soon as the epoch differs from `known_epoch`, or at the timeout.

        Args:
            known_epoch: the epoch the caller already has.
            timeout_s: the longest the call waits.
            client_index: the caller's index; the call then doubles as its heartbeat. A client
                pruned while it was silent (paused, say) is listed again, as `client_name`:
                its index was never given to anyone else.
            client_name: how to list the caller if it has to be listed again.

        Returns:
            The membership at return time (its epoch equals `known_epoch` on timeout).
        """
        if client_index is not None and not self._touch_client(client_index):
            self._relist_client(client_index, client_name)
        deadline = time.monotonic() + timeout_s
        while self._state.epoch == known_epoch:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                break
        return self._membership()

    # --- clients -----------------------------------------------------------------------------

    @ray.method
    async def attach_client(self, name: str, public_key: bytes | None) -> int:
        """Attaches a client under a new client index, one never used before in this cluster.

        Indices are not reused: an engine's stats report counts each client's requests by
        index, and a report made before a client left could otherwise be read by the next
        holder of its index as counting the newcomer's own requests — hiding the load it
        adds until the engine reports again.

        `public_key` is the client's CURVE key: it is handed to every serving engine and to the
        coordinator before this returns (an engine that starts later reads it from the
        membership), so the client can attach to them at once, as that index and no other.

        Returns:
            The client's index; it goes into every request the client sends.
        """
        self._prune_clients()
        index = self._state.next_client_index
        self._state.next_client_index += 1
        now = time.time()
        self._state.clients[index] = ClientInfo(index, name, now, now)
        if public_key is not None:
            self._state.client_keys[index] = public_key
        self._save()
        if public_key is not None:
            await self._tell_data_plane(
                self._serving_engine_names(),
                lambda actor: actor.admit_client.remote(index, public_key),
            )
        return index

    @ray.method
    async def detach_client(self, client_index: int) -> None:
        """Frees a client index (unknown indices are ignored); its key is revoked everywhere."""
        had_key = self._state.client_keys.pop(client_index, None) is not None
        if self._state.clients.pop(client_index, None) is not None or had_key:
            self._save()
        if had_key:
            task = asyncio.get_running_loop().create_task(
                self._tell_data_plane(
                    self._serving_engine_names(),
                    lambda actor: actor.revoke_client.remote(client_index),
                )
            )
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    @ray.method
    async def clients(self) -> list[ClientInfo]:
        """The attached clients by index (gone clients are pruned first)."""
        return self._clients()

    def _clients(self) -> list[ClientInfo]:
        if self._prune_clients():
            self._save()
        return sorted(self._state.clients.values(), key=lambda c: c.client_index)

    # --- lifecycle and scaling ------------------------------------------------------------------

    @ray.method
    async def set_served_by(self, server: str | None) -> None:
        """Records the process that serves the cluster and tears it down on `request_stop`."""
        self._state.served_by = server
        self._save()

    @ray.method
    async def request_stop(self) -> int:
        """Asks whoever serves the cluster (e.g. `shoal serve`) to tear it down.

        Returns:
            The new epoch (long-pollers wake with `Membership.stopping` set).
        """
        self._state.stopping = True
        return self._bump()

    @ray.method
    async def status(self) -> dict[str, Any]:
        """A plain, JSON-ready summary for `shoal status`."""
        s = self._state
        return {
            "namespace": self.namespace,
            "epoch": s.epoch,
            "model": s.config.model.model,
            "data_parallel_size": s.config.parallel.data_parallel_size,
            "detached": self.detached,
            "served_by": s.served_by,
            "stopping": s.stopping,
            "stats_publish_address": s.stats_publish_address,
            "expert_parallel": _expert_parallel_status(s.ep_placement),
            "scaling": scaling_status(s.scale),
            "scale_history": [msgspec.to_builtins(e) for e in s.scale_history],
            "ranks": [
                {
                    "rank": r.rank,
                    "state": r.state.value,
                    "incarnation": r.incarnation,
                    "node_ip": r.node_ip,
                    "address": r.endpoint.input_address if r.endpoint else None,
                    "actor_name": r.actor_name,
                }
                for r in sorted(s.ranks.values(), key=lambda r: r.rank)
            ],
            "clients": [
                {
                    "client_index": c.client_index,
                    "name": c.name,
                    "attached_at": c.attached_at,
                    "last_seen": c.last_seen,
                }
                for c in self._clients()
            ],
        }

    @ray.method
    async def ep_rendezvous(self, host: str, rank: int, placement: list[int]) -> tuple[str, int]:
        """Where expert-parallel ranks form their groups: a TCPStore this actor serves.

        Asked by every rank as it starts (again after a restart); the ranks keep their group
        generations in the store (`shoal.engine.parallel.distributed`).

        Args:
            host: the asking rank's bind address: a loopback one keeps the store on loopback,
                any other puts it on this node's address.
            rank: the asking rank.
            placement: its expert -> rank table, recorded for `status` (a joining rank's is
                recorded when its resize commits).

        Returns:
            The store's (host, port).
        """
        if self._rendezvous is None:
            bind = host if host.startswith("127.") else ray.util.get_node_ip_address()
            self._rendezvous = RendezvousServer(bind)
        if self._joining_plan(rank) is None and self._state.ep_placement != placement:
            self._state.ep_placement = list(placement)
            self._save()
        return self._rendezvous.address()

    @ray.method
    async def ping(self) -> bool:
        return True

    # --- internals ---------------------------------------------------------------------------

    def _set_rank(self, info: RankInfo) -> None:
        self._state.ranks[info.rank] = replace(info, changed_at=time.time())

    def _save(self) -> None:
        """Writes the state where a restarted registry finds it (heartbeats are not saved)."""
        internal_kv._internal_kv_put(
            STATE_KEY, msgspec.msgpack.encode(self._state), namespace=self.namespace
        )

    def _restore(self) -> None:
        """Picks up the state the previous incarnation saved; every client counts as just seen."""
        saved = internal_kv._internal_kv_get(STATE_KEY, namespace=self.namespace)
        if saved is None:
            logger.warning("registry restarted without saved state; starting empty")
            return
        state = msgspec.msgpack.decode(saved, type=RegistryState)
        now = time.time()
        state.clients = {i: replace(c, last_seen=now) for i, c in state.clients.items()}
        state.epoch += 1
        self._state = state
        for info in state.ranks.values():
            if info.endpoint is not None and info.state in _SERVING:
                self._watch(info.rank, info.actor_name, info.endpoint.identity)
        logger.warning(
            "registry restarted at epoch %d: %d ranks, %d clients",
            state.epoch,
            len(state.ranks),
            len(state.clients),
        )

    def _bump(self) -> int:
        self._state.epoch += 1
        self._save()
        # Wake every waiter of this change, then arm a fresh event for the next one.
        self._changed.set()
        self._changed = asyncio.Event()
        return self._state.epoch

    def _touch_client(self, client_index: int) -> bool:
        info = self._state.clients.get(client_index)
        if info is None:
            return False
        self._state.clients[client_index] = replace(info, last_seen=time.time())
        return True

    def _relist_client(self, client_index: int, name: str | None) -> None:
        if not 0 <= client_index < self._state.next_client_index:
            return  # never handed out here
        name = name or f"client {client_index}"
        logger.info("client %d (%s) was pruned but polls again; listed again", client_index, name)
        now = time.time()
        self._state.clients[client_index] = ClientInfo(client_index, name, now, now)
        self._save()

    def _prune_clients(self) -> bool:
        """Drops clients silent past the timeout; True if any went (the caller saves)."""
        cutoff = time.time() - self.client_timeout_s
        silent = [i for i, c in self._state.clients.items() if c.last_seen < cutoff]
        for index in silent:
            logger.info(
                "client %d (%s) went silent; pruned", index, self._state.clients[index].name
            )
            del self._state.clients[index]
        return bool(silent)

    def _watch(self, rank: int, actor_name: str, identity: bytes) -> None:
        previous = self._watchers.pop(rank, None)
        if previous is not None:
            previous.cancel()
        self._watchers[rank] = asyncio.get_running_loop().create_task(
            self._watch_engine(rank, actor_name, identity)
        )

    async def _watch_engine(self, rank: int, actor_name: str, identity: bytes) -> None:
        """Marks the rank DEAD when the incarnation registered as `identity` dies."""
        actor = find_engine(actor_name, self.namespace)
        if actor is None:
            logger.warning("rank %d: no actor %r to watch; liveness unknown", rank, actor_name)
            return
        if await watch_engine(actor, identity, lambda: self._is_current(rank, identity)):
            logger.warning("rank %d: engine actor died", rank)
            self._mark_dead(rank, identity)

    async def _probe_reported_engine(self, rank: int, identity: bytes) -> bool:
        actor = find_engine(self._state.ranks[rank].actor_name, self.namespace)
        liveness = await probe_engine(actor, identity, self.engine_probe_timeout_s)
        if liveness == Liveness.ALIVE:
            logger.info("rank %d was reported lost by a client but answers; kept", rank)
            return True
        if liveness == Liveness.HUNG and actor is not None:  # HUNG: it was there to probe
            logger.warning(
                "rank %d was reported lost and did not answer a health probe in %.0f s; "
                "restarting it",
                rank,
                self.engine_probe_timeout_s,
            )
            restart_engine(actor)
        self._mark_dead(rank, identity)
        return False

    async def _redirect_stats(self, report_address: str) -> None:
        calls = []
        for info in self._state.ranks.values():
            actor = find_engine(info.actor_name, self.namespace)
            if actor is not None:
                calls.append(actor.set_stats_address.remote(report_address))
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, Exception):  # a dead rank reads the membership on restart
                logger.info("an engine was not told the new stats address: %s", result)

    def _serving_engine_names(self) -> list[str]:
        """The actors of ranks that serve now (a starting or restarting rank reads the keys
        from the membership once it has registered)."""
        return [r.actor_name for r in self._state.ranks.values() if r.state in _SERVING]

    async def _tell_data_plane(self, engine_names: list[str], call: Any) -> None:
        """Makes `call(actor)` on the named engines and the coordinator and waits (bounded)
        until they are done: a key change reaches the data plane before the caller goes on.
        One that fails or is slow is logged; it reads the membership when it restarts."""
        actors = [find_actor(name, self.namespace) for name in [*engine_names, COORDINATOR_NAME]]
        refs = [call(actor) for actor in actors if actor is not None]
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

    def _mark_dead(self, rank: int, identity: bytes) -> None:
        """Marks a rank DEAD if `identity` is still its serving incarnation."""
        if self._is_serving(rank, identity):
            self._set_rank(replace(self._state.ranks[rank], state=RankState.DEAD))
            self._bump()

    def _is_serving(self, rank: int, identity: bytes) -> bool:
        """Whether `identity` is the rank's registered incarnation and the rank is not DEAD."""
        return self._is_current(rank, identity) and self._state.ranks[rank].state in _SERVING

    def _is_current(self, rank: int, identity: bytes) -> bool:
        info = self._state.ranks.get(rank)
        return info is not None and info.endpoint is not None and info.endpoint.identity == identity


# What callers hold: Ray's typed proxy, so mypy checks every `.remote` call's method,
# arguments and result against RegistryActor.
RegistryHandle: TypeAlias = ActorProxy[RegistryActor]


def _expert_parallel_status(placement: list[int] | None) -> dict[str, Any] | None:
    """EP size and each rank's experts, from the expert -> rank table (None: no EP)."""
    if placement is None:
        return None
    size = max(placement) + 1
    experts = [[e for e, r in enumerate(placement) if r == rank] for rank in range(size)]
    return {"size": size, "num_experts": len(placement), "experts_per_rank": experts}
